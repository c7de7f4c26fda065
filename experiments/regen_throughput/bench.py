"""Regeneration throughput of the embedded target at batch sizes 1, 8 and 16 (ratios to batch 1).

    python experiments/regen_throughput/bench.py [--prompts 16] [--max-new-tokens 64] [--threads 2]

Uses the same ``regenerate`` code as ``draftlab-data`` on the first user turns of ShareGPT conversations
(one assistant turn each, so every batch size does the same work), fresh output files per batch size.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from draftlab.data.conversations import load_conversations, normalize
from draftlab.data.regenerate import RegenConfig, regenerate
from draftlab.targets import load_target

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--data", default=str(ROOT.parent / "shared/data/conversations/sharegpt_v3_first5000.jsonl"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target("asset:smollm2-135m-instruct")
    convs, _ = normalize(load_conversations(args.data, format="sharegpt"))
    # First exchange only, prompts of moderate length, so batches are comparable.
    picked = []
    for c in convs:
        first = c.messages[: next(i for i, m in enumerate(c.messages) if m["role"] == "assistant") + 1]
        if len(first[-2]["content"]) < 600:
            c.messages = first
            picked.append(c)
        if len(picked) == args.prompts:
            break
    rows = []
    for bs in args.batch_sizes:
        cfg = RegenConfig(temperature=0.7, top_p=0.95, max_new_tokens=args.max_new_tokens, batch_size=bs, seed=0)
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            rep = regenerate(target, picked, Path(d) / "out.jsonl", cfg, progress=False)
            dt = time.perf_counter() - t0
        rows.append({"batch_size": bs, "new_tokens": rep.new_tokens, "seconds": dt, "tokens_per_s": rep.new_tokens / dt})
    base = rows[0]["tokens_per_s"]
    print(f"regeneration throughput, SmolLM2-135M fp32, {args.threads} threads, {len(picked)} prompts, "
          f"<= {args.max_new_tokens} new tokens each")
    print(f"{'batch':>5} {'new tokens':>10} {'seconds':>8} {'tok/s':>8} {'x batch 1':>9}")
    for r in rows:
        print(f"{r['batch_size']:>5} {r['new_tokens']:>10} {r['seconds']:>8.1f} {r['tokens_per_s']:>8.1f} "
              f"{r['tokens_per_s'] / base:>9.2f}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
