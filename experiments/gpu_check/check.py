"""The GPU check: one command that settles draftlab's GPU path in one lent window (see README.md beside this file).

    timeout 540 python experiments/gpu_check/check.py --device cuda --out OUT        # first call: the kernels
    python experiments/gpu_check/check.py --device cuda --out OUT --parts rest       # second call, if time is left
    python experiments/gpu_check/check.py --device cpu --out OUT --parts all         # every part, tiny sizes (CI)

Each part runs on its own, so one failure does not hide the others, and writes its results as it ends:
``OUT/results.json`` holds every part's status, seconds and numbers (a second call adds to the first's),
``OUT/summary.md`` the same as a table; the exit status is 1 when any part failed. Parts, in priority order
(what no CPU can settle first, so a run cut short loses least):

  first call (``--parts first``, the default)
  env            versions (torch, Triton, CUDA), the GPU and its compute capability
  kernel_tests   ``pytest tests/kernels`` on the device: Triton compiled, the mutants must fail
  ttt_right      TTT attention's output and every gradient against an fp64 reference, with thresholds
  ttt_fast       TTT attention's time and peak memory: torch, blockwise, Triton tiles, flex (mask cached)
  soft_ce        the soft cross-entropy right (thresholds) and fast
  ttt_step       a whole TTT-7 step of a Llama-3-8B-shaped draft under bf16 autocast, per attention choice
  second call (``--parts rest``)
  lossless, bf16_greedy, llama8b, engine, train, conformance, pytest_gpu   (parts.py)
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

import kernel_parts  # noqa: E402  (after the path set-up)
import parts  # noqa: E402

FIRST = {"env": parts.env, "kernel_tests": kernel_parts.kernel_tests, "ttt_right": kernel_parts.ttt_right,
         "ttt_fast": kernel_parts.ttt_fast, "soft_ce": kernel_parts.soft_ce, "ttt_step": kernel_parts.ttt_step}
REST = {name: fn for name, fn in parts.PARTS.items() if name != "env"}
PARTS = {**FIRST, **REST}
GROUPS = {"first": list(FIRST), "rest": list(REST), "all": list(PARTS)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda | cpu (cpu: tiny sizes, what CI runs)")
    ap.add_argument("--out", type=Path, required=True, help="folder for results.json, summary.md and run logs")
    ap.add_argument("--parts", default="first",
                    help=f"first | rest | all, or a comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--carry", type=Path, default=ROOT / ".gpu_check",
                    help="the folder prepare.sh built: tokenizer/ and shared_data/ (default .gpu_check)")
    args = ap.parse_args(argv)
    wanted = [n for p in args.parts.split(",") if p for n in GROUPS.get(p, [p])]
    unknown = set(wanted) - set(PARTS)
    if unknown:
        ap.error(f"unknown parts {sorted(unknown)} (known: {', '.join(PARTS)}, or first / rest / all)")
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = parts.Context.make(args.device, args.out, args.carry)
    results = _earlier(args.out, args.device)
    for name in wanted:
        results[name] = run_part(name, ctx)
        write_results(args.out, args.device, results)
    print(summary(args.device, results), flush=True)
    return 1 if any(r["status"] == "failed" for r in results.values()) else 0


def run_part(name: str, ctx) -> dict:
    print(f"== {name}", flush=True)
    t0 = time.perf_counter()
    try:
        outcome = PARTS[name](ctx)
        status = "skipped" if outcome.get("skipped") else "passed"
    except Exception as e:  # a part's failure is a result, not the end of the check
        outcome = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
        status = "failed"
        print(outcome["traceback"], flush=True)
    result = {"status": status, "seconds": round(time.perf_counter() - t0, 1), **outcome}
    print(f"   {status} in {result['seconds']} s: {json.dumps(brief(result), default=str)[:1500]}", flush=True)
    return result


def _earlier(out: Path, device: str) -> dict:
    """The results a first call left in ``out`` (a second call adds to them); parts run again replace theirs."""
    try:
        payload = json.loads((out / "results.json").read_text())
    except (OSError, ValueError):
        return {}
    return payload.get("results", {}) if payload.get("device") == device else {}


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
