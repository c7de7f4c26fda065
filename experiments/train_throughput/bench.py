"""EAGLE-3 training throughput on the embedded target: feature extraction and training tokens/s.

    python experiments/train_throughput/bench.py [--conversations 24] [--steps 3] [--threads 2]

Real ShareGPT conversations rendered with SmolLM2's chat template (the data stage's code, max length 1024)
go through the data pipeline's own pieces, side by side in one process:

- **features**: ``precompute_features`` (the offline store ``draftlab-train`` writes: three tapped layers
  + the last hidden state per token, safetensors per sample), tokens/s over every token of the samples;
- **training**: optimiser steps of ``Eagle3Module`` on those features (batch 4, length-bucketed batches,
  AdamW), for TTT-7 and TTT-2 in fp32 and under bf16 autocast (``trainer.precision=bf16-mixed``: the
  draft's passes in bf16, the target's logits in fp32). Variants are interleaved round-robin and each
  keeps its fastest round, so a slow phase of the machine hits them alike. Tokens/s counts real
  (unpadded) tokens of the batches.

The reference numbers are the ones measured before this benchmark existed (features ~280 tok/s,
training ~123 tok/s for TTT-7 fp32); the ratios printed beside them are only meaningful on the same
2-core machine.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from analysis.markdown import markdown_table
from draftlab.data.conversations import load_conversations, normalize
from draftlab.data.features import precompute_features
from draftlab.data.template import render_conversations
from draftlab.data.vocab import build_vocab_mapping, token_frequencies
from draftlab.methods.eagle3 import Eagle3Draft
from draftlab.methods.eagle3.data import Eagle3DataModule
from draftlab.methods.eagle3.module import Eagle3Module
from draftlab.targets import load_target

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = {"features": 280.0, "train_ttt7_fp32": 123.0}
VARIANTS = {"ttt7_fp32": (7, False), "ttt7_bf16": (7, True), "ttt2_fp32": (2, False), "ttt2_bf16": (2, True)}


def train_round(module: Eagle3Module, opt, batches, bf16: bool) -> tuple[float, int]:
    """(seconds, real tokens) of one optimiser step per batch."""
    tokens = 0
    t0 = time.perf_counter()
    for batch in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = module.loss(batch)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(module.draft.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += int(batch["attention_mask"].sum())
    return time.perf_counter() - t0, tokens


def table_lines(results: dict, variants: list[str]) -> list[str]:
    """The printed table: feature and training tokens/s of ``results`` (``results.json``'s entries), each
    variant against TTT-7 fp32 and the reference numbers."""
    feats = results["features"]["tokens_per_s"]
    base = results["ttt7_fp32"]["tokens_per_s"]
    rows = [["features (offline store)", f"{feats:.0f}", "", f"{feats / REFERENCE['features']:.2f}x of 280"]]
    for name in variants:
        tps = results[name]["tokens_per_s"]
        rows.append([f"train {name}", f"{tps:.0f}", f"{tps / base:.2f}x",
                     f"{tps / REFERENCE['train_ttt7_fp32']:.2f}x of 123"])
    return markdown_table(["stage", "tokens/s", "vs TTT-7 fp32", "vs reference"], rows, "lrrr")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--steps", type=int, default=3, help="optimiser steps per variant and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--data", default=str(ROOT.parent / "shared/data/conversations/sharegpt_v3_first5000.jsonl"))
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target("asset:smollm2-135m-instruct")
    convs, _ = normalize(load_conversations(args.data, format="sharegpt"))
    samples, _ = render_conversations(target.tokenizer, convs[: 4 * args.conversations],
                                      max_length=args.max_length, truncation="truncate")
    samples = samples[: args.conversations]
    n_tok = sum(len(s.input_ids) for s in samples)
    print(f"{len(samples)} conversations, {n_tok} tokens (mean {n_tok / len(samples):.0f})", flush=True)

    torch.manual_seed(0)
    mapping = build_vocab_mapping(token_frequencies(samples, target.geometry.vocab_size), 8192)
    probe = Eagle3Draft.from_target(target, vocab_mapping=mapping)
    taps = probe.taps(target)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        with torch.no_grad():
            feats = precompute_features(target, samples, Path(tmp) / "feats", aux_layer_ids=taps)
        feat_s = time.perf_counter() - t0
        results = {"features": {"tokens": n_tok, "seconds": feat_s, "tokens_per_s": n_tok / feat_s}}
        print(f"features: {n_tok / feat_s:.0f} tok/s ({feat_s:.1f} s)", flush=True)

        dm = Eagle3DataModule(samples, batch_size=4, val_fraction=0.0, feature_dir=feats, seed=0)
        dm.setup()
        batches = list(dm.train_dataloader())[: args.steps]
        runs = {}
        for name, (k, _) in VARIANTS.items():
            torch.manual_seed(0)
            draft = Eagle3Draft.from_target(target, vocab_mapping=mapping)
            module = Eagle3Module(draft, target, ttt_length=k)
            opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-4)
            train_round(module, opt, batches[:1], VARIANTS[name][1])  # warm-up: allocator, oneDNN kernels
            runs[name] = (module, opt)
        best: dict[str, tuple[float, int]] = {}
        for r in range(args.rounds):
            for name, (module, opt) in runs.items():
                s, tok = train_round(module, opt, batches, VARIANTS[name][1])
                if name not in best or tok / s > best[name][1] / best[name][0]:
                    best[name] = (s, tok)
                print(f"  round {r}: {name:10s} {tok / s:7.1f} tok/s", flush=True)
    for name, (s, tok) in best.items():
        results[name] = {"tokens": tok, "seconds": s, "tokens_per_s": tok / s}
    print("\n" + "\n".join(table_lines(results, list(best))))
    results["threads"] = args.threads
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
