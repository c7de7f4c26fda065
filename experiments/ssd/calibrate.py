"""Calibrate SSD's geometric fan-out for a primary on sample prompts (``draftlab.methods.ssd.calibrate``).

    python experiments/ssd/calibrate.py --layers 4 --depth 4 --temperature 0 --prompts 16 \
        --out experiments/ssd/calibration/t0.json

Prompts: the first user turns of ShareGPT conversations (not Spec-Bench's questions, which the evaluation
answers), rendered with the target's chat template. Prints a, r and the miss rate of each uniform fan-out.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from draftlab.data.conversations import load_sharegpt
from draftlab.data.template import render_prompt
from draftlab.methods.draft_model import DraftModelDrafter
from draftlab.methods.ssd.calibrate import measure
from draftlab.targets import load_target

SHARED = Path(os.environ.get("DRAFTLAB_SHARED_DATA", "../shared/data"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="asset:smollm2-135m-instruct")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--sharegpt", default=str(SHARED / "conversations" / "sharegpt_v3_first5000.jsonl"))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    target = load_target(args.target)
    prompts = []
    for conv in load_sharegpt(args.sharegpt):
        first = next((m for m in conv.messages if m["role"] == "user"), None)
        if first is None:
            continue
        ids = render_prompt(target.tokenizer, [first])
        if len(ids) <= args.max_prompt_tokens:
            prompts.append(ids)
        if len(prompts) == args.prompts:
            break
    drafter = DraftModelDrafter(layers=args.layers, depth=args.depth)
    with torch.inference_mode():
        cal = measure(target, drafter, drafter.speculator(target), prompts, depth=args.depth,
                      temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                      source={"target": args.target, "primary": {"method": "draft_model", "layers": args.layers},
                              "prompts": f"ShareGPT first user turns, first {len(prompts)} of <= "
                                         f"{args.max_prompt_tokens} tokens", "max_new_tokens": args.max_new_tokens})
    cal.save(args.out)
    print(f"{cal.rounds} rounds: a = {cal.accept:.3f}, r = {cal.power:.3f}")
    for f in range(1, 9):
        print(f"  uniform F = {f}: miss rate {cal.miss_rate(f):.3f} (power law {f ** -cal.power:.3f})")


if __name__ == "__main__":
    main()
