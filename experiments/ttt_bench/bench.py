"""TTT training throughput and peak memory: prefix+diagonal attention vs the naive full-mask reference.

Both implementations run the same EAGLE-3 draft (SmolLM2-135M geometry: d=576, 9/3 heads, head_dim 64,
intermediate 1536, draft vocabulary 8192) through ``ttt_forward`` forward + backward on random target
features, side by side in one invocation. Each (implementation, T) point runs in a fresh subprocess so
its peak resident memory (``ru_maxrss``) is its own; the reported memory is the peak of the first
training step minus the process's peak before it (model, inputs and the interpreter excluded; gradients
and AdamW state, the same for both, included). Throughput is measured on the following steps.

    python experiments/ttt_bench/bench.py                  # T = 256, 512, 1024; K = 7
    python experiments/ttt_bench/bench.py --lengths 2048 --steps 2
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def worker(impl: str, T: int, K: int, steps: int, batch: int, threads: int) -> dict:
    from draftlab.methods.eagle3 import Eagle3Config, Eagle3Draft, ttt_forward

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    V, VD, d = 49152, 8192, 576
    cfg = Eagle3Config(hidden_size=d, intermediate_size=1536, num_heads=9, num_kv_heads=3, head_dim=64,
                       vocab_size=V, draft_vocab_size=VD)
    draft = Eagle3Draft(cfg)
    ids = torch.randint(0, VD, (batch, T))  # [B, T] inside the identity draft vocabulary
    aux = torch.randn(batch, T, 3 * d)  # [B, T, 3d]
    logits = torch.randn(batch, T, V) * 3  # [B, T, V]
    loss_mask = torch.ones(batch, T, dtype=torch.long)
    attn = torch.ones(batch, T, dtype=torch.long)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-4)

    def step():
        out = ttt_forward(draft, ids, aux, logits, loss_mask, attn, ttt_length=K,
                          impl="naive" if impl == "naive" else "torch")
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(out.loss)

    # Memory: the high-water mark of the first step over what the process held before it. It includes
    # gradients and AdamW state (identical for both implementations) plus the step's activations.
    base = _rss_mib()
    step()
    peak = _rss_mib() - base
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    dt = (time.perf_counter() - t0) / steps
    return {"impl": impl, "T": T, "K": K, "batch": batch, "step_s": dt, "tokens_per_s": batch * T / dt,
            "peak_extra_mib": peak, "loss": loss}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--ttt-length", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worker", nargs=2, metavar=("IMPL", "T"), help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(HERE / "results.json"))
    args = ap.parse_args()
    if args.worker:
        res = worker(args.worker[0], int(args.worker[1]), args.ttt_length, args.steps, args.batch, args.threads)
        print(json.dumps(res))
        return
    rows = []
    for T in args.lengths:
        pair = {}
        for impl in ("prefix_diagonal", "naive"):
            cmd = [sys.executable, __file__, "--worker", impl, str(T), "--ttt-length", str(args.ttt_length),
                   "--steps", str(args.steps), "--batch", str(args.batch), "--threads", str(args.threads)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            pair[impl] = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(pair[impl])
        p, n = pair["prefix_diagonal"], pair["naive"]
        print(f"T={T:5d} K={args.ttt_length}  prefix+diagonal {p['tokens_per_s']:8.1f} tok/s {p['peak_extra_mib']:8.1f} MiB"
              f"  | naive {n['tokens_per_s']:8.1f} tok/s {n['peak_extra_mib']:8.1f} MiB"
              f"  | speed x{p['tokens_per_s'] / n['tokens_per_s']:.2f}  memory x{n['peak_extra_mib'] / max(p['peak_extra_mib'], 1e-9):.2f}"
              f"  | loss diff {abs(p['loss'] - n['loss']):.2e}", flush=True)
    Path(args.out).write_text(json.dumps({"threads": args.threads, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
