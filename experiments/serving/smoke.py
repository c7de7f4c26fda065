"""Smoke run of a real vLLM server: start it, send N ShareGPT first turns concurrently, measure, stop it.

Run with the project venv; the server runs in vLLM's own venv (``--vllm-python``):

    python experiments/serving/smoke.py --vllm-python /work/vllm-venv/bin/python --out /tmp/smoke.json
    python experiments/serving/smoke.py ... --draft /tmp/smollm2_eagle3_vllm   # + EAGLE-3, 3 tokens

Measures the server's start-up time (process start to ``/health`` 200), the decode throughput of the batch
(completion tokens / wall time of the concurrent run), per-request latency, the peak proportional set size (PSS) of
the server's process group (sampled every 0.5 s), and the ``vllm:`` counters of ``/metrics`` (spec-decode ones
when a draft is given).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import threading
import time
import urllib.request
from pathlib import Path

from draftlab.serving import ChatClient, ServerProcess, free_port, vllm_command

SHAREGPT = Path(__file__).resolve().parents[2].parent / "shared/data/conversations/sharegpt_v3_first5000.jsonl"


def first_user_turns(path: Path, n: int, max_chars: int) -> list[str]:
    out = []
    with open(path) as f:
        for line in f:
            turns = json.loads(line).get("conversations") or []
            if turns and turns[0].get("from") == "human" and turns[0].get("value", "").strip():
                out.append(turns[0]["value"][:max_chars])
            if len(out) == n:
                break
    return out


def group_rss_mib(pgid: int, field: str = "Pss") -> float:
    """Memory of every process in a process group, MiB, from /proc/PID/smaps_rollup: ``Pss`` (shared pages split
    between the processes that map them, so the sum is not inflated) or ``Rss``."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[2]) != pgid:  # field 5 of stat: pgrp
                continue
            rss = next(line for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
                       if line.startswith(field + ":"))
            total += int(rss.split()[1])
        except (OSError, ValueError, StopIteration):
            continue
    return total / 1024


class PeakMemory(threading.Thread):
    def __init__(self, pgid: int):
        super().__init__(daemon=True)
        self.pgid, self.peak, self._done = pgid, 0.0, threading.Event()

    def run(self):
        while not self._done.is_set():
            self.peak = max(self.peak, group_rss_mib(self.pgid))
            self._done.wait(0.5)

    def stop(self) -> float:
        self._done.set()
        self.join()
        return self.peak


def scrape_metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    wanted = re.compile(r"^(vllm:(spec_decode\w*|generation_tokens_total|prompt_tokens_total|"
                        r"request_success_total)\S*)\s+(\S+)$")
    return {m.group(1): float(m.group(3)) for line in text.splitlines() if (m := wanted.match(line))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-python", default=os.environ.get("DRAFTLAB_VLLM_PYTHON", "../vllm-venv/bin/python"))
    p.add_argument("--model", default=None, help="HF directory (default: the embedded SmolLM2 asset)")
    p.add_argument("--draft", default=None, help="EAGLE-3 draft directory in vLLM's layout")
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompt-chars", type=int, default=2000, help="first user turns are cut to this length")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-gib", default="2", help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--request-timeout", type=float, default=900)
    p.add_argument("--extra", nargs="*", default=[], help="more server flags, e.g. --enforce-eager")
    p.add_argument("--log", default="/tmp/vllm_smoke_server.log")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    model = args.model
    if model is None:
        from draftlab.assets import fetch

        model = str(fetch("smollm2-135m-instruct"))
    prompts = first_user_turns(SHAREGPT, args.prompts, args.prompt_chars)
    port = free_port()
    spec = ({"method": "eagle3", "model": args.draft, "num_speculative_tokens": args.num_speculative_tokens}
            if args.draft else None)
    cmd = vllm_command(model, port=port, dtype=args.dtype, max_model_len=args.max_model_len,
                       served_model_name="target", speculative_config=spec, python=args.vllm_python,
                       extra=args.extra)
    env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": args.kv_cache_gib, "TOKENIZERS_PARALLELISM": "false"}
    Path(args.log).write_text("")
    print("server:", " ".join(cmd), flush=True)
    result: dict = {"cmd": cmd, "env": env, "prompts": len(prompts), "max_tokens": args.max_tokens,
                    "concurrency": args.concurrency, "dtype": args.dtype}
    with ServerProcess(cmd, port=port, startup_timeout=args.startup_timeout, log_path=args.log,
                       env=env) as server:
        result["startup_s"] = round(server.startup_s, 1)
        result["idle_pss_mib"] = round(group_rss_mib(server.proc.pid))
        result["idle_rss_mib"] = round(group_rss_mib(server.proc.pid, "Rss"))
        print(f"healthy after {server.startup_s:.1f} s, PSS {result['idle_pss_mib']} MiB", flush=True)
        client = ChatClient(server.url, model="target", concurrency=args.concurrency,
                            timeout=args.request_timeout, retries=0,
                            defaults={"temperature": 0.0, "return_token_ids": True})
        warm = client.chat_many_sync([[{"role": "user", "content": "Hello!"}]], max_tokens=8)[0]
        result["warmup"] = {"text": warm.text, "latency_s": round(warm.latency_s, 2)}
        memory = PeakMemory(server.proc.pid)
        memory.start()
        t0 = time.perf_counter()
        done = client.chat_many_sync([[{"role": "user", "content": q}] for q in prompts],
                                     max_tokens=args.max_tokens)
        wall = time.perf_counter() - t0
        result["peak_pss_mib"] = round(memory.stop())
        tokens = sum(c.completion_tokens for c in done)
        latencies = sorted(c.latency_s for c in done)
        result.update(
            wall_s=round(wall, 2), completion_tokens=tokens, prompt_tokens=sum(c.usage["prompt_tokens"] for c in done),
            tokens_per_s=round(tokens / wall, 2),
            latency_s={"p50": round(latencies[len(latencies) // 2], 2), "max": round(latencies[-1], 2)},
            finish_reasons={r: sum(c.finish_reason == r for c in done) for r in {c.finish_reason for c in done}},
            token_ids_returned=all(c.token_ids is not None and len(c.token_ids) == c.completion_tokens
                                   for c in done),
            sample={"prompt": prompts[0][:120], "text": done[0].text[:300]},
            metrics=scrape_metrics(server.url))
    result["server_stopped"] = not server.running
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
