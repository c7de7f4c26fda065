"""Where a compiled verify pass's time goes: k-row passes timed against the one-row pass (interleaved), and the
operators of the 1-row and 8-row passes (torch.profiler, self CPU time per pass), SmolLM2 compiled.

    python experiments/engine_baseline/verify_profile.py --dtype bf16 --out experiments/engine_baseline/records
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import torch
import torch.profiler as prof

from draftlab.decoding.cost import time_interleaved
from draftlab.targets import load_target
from draftlab.targets.probe import verify_passes

ROWS = (1, 2, 4, 8, 16)


def operators(call, reps: int = 5, top: int = 12) -> list[dict]:
    """The ``top`` operators by self CPU time over ``reps`` passes: name, ms per pass, calls per pass."""
    with torch.no_grad(), prof.profile(activities=[prof.ProfilerActivity.CPU]) as p:
        for _ in range(reps):
            call()
    rows = sorted(p.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    return [{"op": e.key[:60], "ms_per_pass": e.self_cpu_time_total / 1e3 / reps, "calls_per_pass": e.count / reps}
            for e in rows]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "records"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    target = load_target("asset:smollm2-135m-instruct", dtype=args.dtype, compile="on")
    calls = verify_passes(target, ROWS, context=128)
    with torch.no_grad():
        for call in calls:  # compile every bucket first
            call()
        times = time_interleaved(calls, args.reps)
    record = {"dtype": args.dtype, "rows": list(ROWS), "ms": [1e3 * t for t in times],
              "ar_steps": [t / times[0] for t in times], "reps": args.reps,
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip(),
              "profile": {str(k): operators(calls[ROWS.index(k)]) for k in (1, 8)}}
    print(f"{args.dtype} verify pass / one-row pass: " + ", ".join(
        f"{r}: {s:.2f} ({m:.1f} ms)" for r, s, m in zip(ROWS, record["ar_steps"], record["ms"])))
    for k, ops in record["profile"].items():
        print(f"{k}-row pass, self CPU ms per pass:")
        for o in ops:
            print(f"  {o['ms_per_pass']:7.2f}  x{o['calls_per_pass']:<5.0f} {o['op']}")
    out = Path(args.out) / f"verify_profile_{args.dtype}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
