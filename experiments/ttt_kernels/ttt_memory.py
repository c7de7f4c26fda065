"""One TTT-7 training step at long sequence lengths: peak memory and time of each TTT attention implementation.

The implementations (``module.attention``; ``draftlab.kernels.ttt_attention``) run the same EAGLE-3 draft of
SmolLM2-135M geometry (d = 576, 9 / 3 heads, head_dim 64, intermediate 1536, V_d = 8192, V = 49,152) through
``ttt_forward`` forward + backward on random target features (batch 1, fp32, K = 7):

- ``naive``: the keys of all steps concatenated under the explicit ``[T, (k+1)T]`` mask;
- ``torch``: prefix + diagonal, one ``[T, T]`` fp32 score block per step kept for backward (the former default);
- ``blockwise``: online softmax in 512 x 512 blocks, recompute in backward;
- ``new``: the CPU default now (``attention: auto``, ``cross_entropy: auto``): blockwise attention and the
  chunked soft cross-entropy, which keeps no fp32 log-softmax for backward.
The first three use the plain torch cross-entropy, so they differ in the attention alone.

Each (T, implementation) point runs in a fresh process so its peak resident memory is its own; the parent
stops a point whose resident memory passes ``--limit-gib`` (it is reported as over the limit, and that
implementation is not tried at longer T). Peak = the step's high-water mark above the process's before it
(model, inputs, the teacher's input logits excluded). Ratios are taken within this one run.

    python experiments/ttt_kernels/ttt_memory.py --lengths 1024 2048 4096 8192 --out experiments/ttt_kernels
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

IMPLS = ("naive", "torch", "blockwise", "new")


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def worker(impl: str, T: int, K: int, threads: int) -> dict:
    import torch

    from draftlab.methods.eagle3 import Eagle3Config, Eagle3Draft, ttt_forward

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    V, VD, d = 49152, 8192, 576
    cfg = Eagle3Config(hidden_size=d, intermediate_size=1536, num_heads=9, num_kv_heads=3, head_dim=64,
                       vocab_size=V, draft_vocab_size=VD)
    draft = Eagle3Draft(cfg)
    ids = torch.randint(0, VD, (1, T))  # [1, T] inside the identity draft vocabulary
    aux = torch.randn(1, T, 3 * d)  # [1, T, 3d]
    logits = torch.randn(1, T, V) * 3  # [1, T, V]
    loss_mask = torch.ones(1, T, dtype=torch.long)
    attn = torch.ones(1, T, dtype=torch.long)
    base = _rss_mib()
    t0 = time.perf_counter()
    kernels = dict(impl="blockwise", cross_entropy="chunked") if impl == "new" else dict(impl=impl, cross_entropy="torch")
    out = ttt_forward(draft, ids, aux, logits, loss_mask, attn, ttt_length=K, **kernels)
    out.loss.backward()
    seconds = time.perf_counter() - t0
    grad_norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in draft.parameters() if p.grad is not None)))
    return {"impl": impl, "T": T, "K": K, "step_s": seconds, "peak_mib": _rss_mib() - base,
            "loss": float(out.loss), "grad_norm": grad_norm}


def _run_point(impl: str, T: int, K: int, threads: int, limit_gib: float) -> dict:
    """One point in a child process; stopped (and reported) when its resident memory passes the limit."""
    cmd = [sys.executable, __file__, "--worker", impl, str(T), "--ttt-length", str(K), "--threads", str(threads)]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak_kib = 0
    while child.poll() is None:
        try:
            with open(f"/proc/{child.pid}/status") as f:
                rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (FileNotFoundError, StopIteration, ProcessLookupError):
            rss = 0
        peak_kib = max(peak_kib, rss)
        if rss > limit_gib * 2 ** 20:
            child.kill()
            child.wait()
            return {"impl": impl, "T": T, "K": K, "over_limit_gib": limit_gib}
        time.sleep(0.1)
    out, err = child.communicate()
    if child.returncode != 0:
        raise RuntimeError(f"{impl} T={T} failed:\n{err[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])


def _cell(row: dict | None, key: str, fmt: str) -> str:
    if row is None:
        return "not run"
    if "over_limit_gib" in row:
        return f"> {row['over_limit_gib']:g} GiB"
    return format(row[key], fmt)


def table(rows: list[dict]) -> str:
    """Peak MiB and step seconds per implementation, and each one's ratio to today's ``torch`` (same T)."""
    by = {(r["impl"], r["T"]): r for r in rows}
    impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
    lengths = sorted({r["T"] for r in rows})

    def ratio(a, c, key):
        if a is None or c is None or "over_limit_gib" in a or "over_limit_gib" in c:
            return "-"
        return f"{a[key] / c[key]:.3f}"

    head = ["T"] + [f"{i}: peak MiB" for i in impls] + [f"{i} / torch memory" for i in impls if i != "torch"] \
        + [f"{i}: step s" for i in impls] + [f"{i} / torch time" for i in impls if i != "torch"]
    lines = ["| " + " | ".join(head) + " |", "|" + " ---: |" * len(head)]
    for T in lengths:
        t = by.get(("torch", T))
        cells = [f"{T:,}"] + [_cell(by.get((i, T)), "peak_mib", ".0f") for i in impls]
        cells += [ratio(by.get((i, T)), t, "peak_mib") for i in impls if i != "torch"]
        cells += [_cell(by.get((i, T)), "step_s", ".1f") for i in impls]
        cells += [ratio(by.get((i, T)), t, "step_s") for i in impls if i != "torch"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--ttt-length", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--limit-gib", type=float, default=16.0)
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    ap.add_argument("--worker", nargs=2, metavar=("IMPL", "T"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help="directory for ttt_memory.json and table_ttt.md")
    ap.add_argument("--merge", help="an earlier run's ttt_memory.json whose rows join this run's table")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]), args.ttt_length, args.threads)))
        return
    rows: list[dict] = []
    earlier = json.loads(Path(args.merge).read_text())["rows"] if args.merge else []
    stopped: set[str] = set()
    from tqdm import tqdm

    points = [(T, impl) for T in args.lengths for impl in args.impls]
    for T, impl in tqdm(points, desc="TTT steps"):
        if impl in stopped:
            continue  # over the limit at a shorter T: it only grows
        row = _run_point(impl, T, args.ttt_length, args.threads, args.limit_gib)
        rows.append(row)
        if "over_limit_gib" in row:
            stopped.add(impl)
        tqdm.write(json.dumps(row))
        if args.out:  # after every point: an interrupted run keeps what it measured
            out = Path(args.out)
            meta = {"threads": args.threads, "limit_gib": args.limit_gib, "cpu": _cpu(), "rows": rows}
            tmp = out / "ttt_memory.json.tmp"
            tmp.write_text(json.dumps(meta, indent=2))
            os.replace(tmp, out / "ttt_memory.json")
            tmp = out / "table_ttt.md.tmp"
            tmp.write_text(table(earlier + rows))
            os.replace(tmp, out / "table_ttt.md")
    print(table(earlier + rows))


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
