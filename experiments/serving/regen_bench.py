"""Regeneration throughput: the same N ShareGPT conversations through HF batches and through a vLLM server.

Both runs go through ``draftlab.data.regenerate.regenerate`` (same records, same bookkeeping), on the embedded
target SmolLM2-135M-Instruct: ``engine=hf`` (the target's ``model.generate`` in batches, in this process) and
``engine=server`` (a vLLM CPU server started by the launcher from vLLM's own venv, one chat completion per
turn, all conversations in flight). Printed side by side: new tokens, generation seconds, tok/s and the ratio;
the server's start-up time is reported apart (it is paid once per run, not per token).

    python experiments/serving/regen_bench.py --vllm-python /work/vllm-venv/bin/python \\
        --n 32 --max-new-tokens 64 --out /tmp/regen_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from draftlab.data.regenerate import RegenConfig, regenerate
from draftlab.data.sources import ConversationSource, DataSpec
from draftlab.targets import load_target

SHAREGPT = Path(__file__).resolve().parents[2].parent / "shared/data/conversations/sharegpt_v3_first5000.jsonl"


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-python", default=os.environ.get("DRAFTLAB_VLLM_PYTHON", "/work/vllm-venv/bin/python"))
    p.add_argument("--data", default=str(SHAREGPT))
    p.add_argument("--n", type=int, default=32, help="conversations")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-prompt-tokens", type=int, default=768)
    p.add_argument("--max-assistant-turns", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--hf-batch-size", type=int, default=8)
    p.add_argument("--hf-threads", type=int, default=1, help="torch threads of the HF run (vLLM computes on one)")
    p.add_argument("--concurrency", type=int, default=32, help="server requests in flight")
    p.add_argument("--kv-cache-gib", default="2")
    p.add_argument("--extra", nargs="*", default=[], help="more vLLM flags, e.g. --enforce-eager")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--workdir", default=None, help="where the JSONL outputs go (default: a temporary folder)")
    p.add_argument("--out", default=None, help="write the numbers here as JSON")
    return p.parse_args(argv)


def _summary(report, extra: dict) -> dict:
    tps = report.new_tokens / report.seconds if report.seconds else 0.0
    return {"success": report.success, "error": report.error, "skipped": report.skipped,
            "new_tokens": report.new_tokens, "seconds": round(report.seconds, 2), "tok_s": round(tps, 2), **extra}


def main(argv=None) -> dict:
    a = _args(argv)
    torch.set_num_threads(a.hf_threads)
    # Normalised as the data stage does (leading assistant turns re-anchored, empty turns dropped).
    convs, _ = DataSpec(sources=[ConversationSource(path=a.data, format="sharegpt", name="sharegpt", limit=a.n)]).load()
    target = load_target("asset:smollm2-135m-instruct")
    work = Path(a.workdir or tempfile.mkdtemp(prefix="regen_bench-"))
    shutil.rmtree(work / "hf", ignore_errors=True)
    shutil.rmtree(work / "server", ignore_errors=True)
    common = dict(temperature=a.temperature, max_new_tokens=a.max_new_tokens, max_prompt_tokens=a.max_prompt_tokens,
                  max_assistant_turns=a.max_assistant_turns, seed=0)
    results: dict = {"n": len(convs), "load_avg_start": os.getloadavg(), "cpus": os.cpu_count(),
                     "settings": {**common, "hf_batch_size": a.hf_batch_size, "hf_threads": a.hf_threads,
                                  "concurrency": a.concurrency, "extra": a.extra}}
    if not a.skip_hf:
        rep = regenerate(target, convs, work / "hf" / "regen.jsonl",
                         RegenConfig(**common, batch_size=a.hf_batch_size), progress=False)
        results["hf"] = _summary(rep, {"batch_size": a.hf_batch_size})
        print(f"hf:     {rep}", flush=True)
    launch = {"builder": "vllm", "python": a.vllm_python, "dtype": "float32", "startup_timeout": 1200,
              "log_path": str(work / "vllm.log"), "extra": list(a.extra),
              "env": {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": a.kv_cache_gib,
                      "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}}
    scfg = RegenConfig(**common, batch_size=len(convs), engine="server",
                       server={"launch": launch, "concurrency": a.concurrency, "timeout": 900, "max_retries": 1})
    t0 = time.perf_counter()
    rep = regenerate(target, convs, work / "server" / "regen.jsonl", scfg, progress=False)
    total = time.perf_counter() - t0
    results["server"] = _summary(rep, {"concurrency": a.concurrency,
                                       "startup_and_stop_s": round(total - rep.seconds, 1)})
    print(f"server: {rep}", flush=True)
    results["load_avg_end"] = os.getloadavg()
    _print_table(results)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=2))
    return results


def _print_table(r: dict) -> None:
    rows = [(k, r[k]) for k in ("hf", "server") if k in r]
    print(f"\n{r['n']} conversations x up to {r['settings']['max_new_tokens']} new tokens "
          f"(load average at start {r['load_avg_start'][0]:.1f}, {r['cpus']} CPUs)")
    print(f"{'engine':8} {'success':>7} {'new tokens':>10} {'gen s':>8} {'tok/s':>8}  notes")
    for name, s in rows:
        note = (f"batch {s['batch_size']}, {r['settings']['hf_threads']} torch thread(s)" if name == "hf"
                else f"{s['concurrency']} in flight; start-up + stop {s['startup_and_stop_s']} s not counted")
        print(f"{name:8} {s['success']:>7} {s['new_tokens']:>10} {s['seconds']:>8.1f} {s['tok_s']:>8.1f}  {note}")
    if "hf" in r and r["hf"]["tok_s"]:
        print(f"server / hf tok/s ratio: {r['server']['tok_s'] / r['hf']['tok_s']:.2f}x")


if __name__ == "__main__":
    main()
