"""The GPU check: one command that proves draftlab's GPU path (see README.md beside this file).

    python experiments/gpu_check/check.py --device cuda --out OUT      # on a GPU machine (about 5 minutes, H200)
    python experiments/gpu_check/check.py --device cpu --out OUT       # the same parts at tiny sizes (CI)

Each part runs on its own, so one failure does not hide the others; ``OUT/results.json`` holds every
part's status, seconds and numbers, ``OUT/summary.md`` the same as a table, and the exit status is 1 when
any part failed. ``--parts a,b`` runs a subset (a re-run after a fix). Parts (``parts.py``):

  env            versions and the device
  pytest_gpu     ``pytest -m gpu``: the suite's tests that need CUDA (GPU only)
  conformance    the conformance suite (greedy == AR, the first round's law, artifact round trip) with the
                 tiny target on the device
  lossless       greedy == AR and the powered sampling test on a random SmolLM2-shaped target (fp32)
  bf16_greedy    the same target in bf16: how often greedy speculative output leaves AR, and the top-2
                 logit gap where it does
  ttt_kernels    TTT attention alone (torch, blockwise, Triton, compiled flex; 32 / 8 heads of 128, bf16, T = 2k /
                 4k / 8k): time, peak memory and the difference from the torch reference
  train          ``draftlab-train`` end to end on the device: EAGLE-3 with online and with offline features
  llama8b        an 8B Llama shape (bf16, random weights): EAGLE-3 training step time and peak memory, the
                 engine's AR tokens/s beside HF ``generate``, the verify-cost curve
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for p in (ROOT / "src", ROOT):  # run from a checkout without installing it (the GPU machine has no network)
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import parts  # noqa: E402  (after the path set-up)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda | cpu (cpu: tiny sizes, what CI runs)")
    ap.add_argument("--out", type=Path, required=True, help="folder for results.json, summary.md and run logs")
    ap.add_argument("--parts", default=",".join(parts.PARTS), help=f"subset of {','.join(parts.PARTS)}")
    ap.add_argument("--carry", type=Path, default=ROOT / ".gpu_check",
                    help="the folder prepare.sh built: tokenizer/ and shared_data/ (default .gpu_check)")
    args = ap.parse_args(argv)
    wanted = [p for p in args.parts.split(",") if p]
    unknown = set(wanted) - set(parts.PARTS)
    if unknown:
        ap.error(f"unknown parts {sorted(unknown)} (known: {', '.join(parts.PARTS)})")
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = parts.Context.make(args.device, args.out, args.carry)
    results = {}
    for name in wanted:
        results[name] = run_part(name, ctx)
        write_results(args.out, args.device, results)
    print(summary(args.device, results), flush=True)
    return 1 if any(r["status"] == "failed" for r in results.values()) else 0


def run_part(name: str, ctx) -> dict:
    print(f"== {name}", flush=True)
    t0 = time.perf_counter()
    try:
        outcome = parts.PARTS[name](ctx)
        status = "skipped" if outcome.get("skipped") else "passed"
    except Exception as e:  # a part's failure is a result, not the end of the check
        outcome = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
        status = "failed"
        print(outcome["traceback"], flush=True)
    result = {"status": status, "seconds": round(time.perf_counter() - t0, 1), **outcome}
    print(f"   {status} in {result['seconds']} s: {json.dumps(brief(result), default=str)[:1500]}", flush=True)
    return result


def brief(result: dict) -> dict:
    return {k: v for k, v in result.items() if k not in {"status", "seconds", "traceback", "log"}}


def write_results(out: Path, device: str, results: dict) -> None:
    payload = {"device": device, "results": results}
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(payload, indent=1, default=str))
    os.replace(tmp, out / "results.json")
    (out / "summary.md").write_text(summary(device, results))


def summary(device: str, results: dict) -> str:
    lines = [f"# GPU check, --device {device}", "", "| part | status | s | numbers |", "|---|---|---|---|"]
    for name, r in results.items():
        numbers = json.dumps(brief(r), default=str)
        lines.append(f"| {name} | {r['status']} | {r['seconds']} | {numbers[:600]} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
