"""Cost of one decode step against context length: a dense AR step, a SparseSpec-L draft step over the
compacted view, the compaction itself, and dense verify passes of 1..17 rows.

    python experiments/sparsespec_l/scaling.py --out experiments/sparsespec_l/scaling

The context is real text (L-Eval documents, tokenised and concatenated), the selection is the method's own
(sinks + window + top slots by the prefill's attention mass), the budget the config's (10 %, >= 128 slots).
Each number is the median of ``--reps`` timed calls after a warm-up, in one process, side by side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from analysis.markdown import markdown_table
from draftlab.decoding.tree import DraftTree, ancestor_mask
from draftlab.methods.sparsespec_l.selection import budget_slots, select_slots
from draftlab.targets import load_target
from draftlab.targets.base import PassRequest
from draftlab.targets.cache import SparseView
from draftlab.utils.atomic import atomic_write_text

DOCS = Path(__file__).resolve().parents[2].parent / "shared/data/long_context/leval_16k40k.jsonl"


def _median_s(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def text_tokens(target, n: int) -> list[int]:
    ids: list[int] = []
    for line in DOCS.read_text().splitlines():
        ids += target.tokenizer(json.loads(line)["turns"][0], add_special_tokens=False)["input_ids"]
        if len(ids) >= n:
            return ids[:n]
    raise ValueError(f"the documents hold fewer than {n} tokens")


def measure(target, context: int, *, reps: int, budget: float, min_budget: int, rows=(1, 3, 5, 9, 17)) -> dict:
    g = target.geometry
    ids = text_tokens(target, context)
    cache = target.new_cache(1, context + 32)
    t0 = time.perf_counter()
    out = target.forward(torch.tensor([ids]), cache=cache,
                         request=PassRequest(logits_rows=torch.tensor([context - 1]), attn_mass_rows=16))
    prefill_s = time.perf_counter() - t0
    cache.commit(context)
    keep = budget_slots(context, budget, min_budget)
    slots = select_slots(out.attn_mass[:, 0], context, keep, sinks=4, window=64)  # [L, Hkv, K]
    view = SparseView({li: slots[li] for li in range(g.num_layers)})
    small = view.compact(cache, scratch_rows=18)
    step = torch.tensor([[ids[-1]]])
    pos = torch.tensor([context])

    def ar():
        target.forward(step, pos, cache)  # scratch row, never committed

    def draft():
        target.forward(step, pos, small)

    def verify(n):
        tree = DraftTree.chain(ids[-1], ids[:n - 1])
        mask = torch.cat([torch.ones(n, context, dtype=torch.bool), ancestor_mask(tree.parents)], 1)
        x, p = tree.tokens[None], context + tree.depth
        return lambda: target.forward(x, p, cache, mask, request=PassRequest(attn_mass_rows=16))

    kv_bytes = 2 * g.num_layers * g.num_kv_heads * g.head_dim * cache.k.element_size()  # per slot
    return {"context": context, "prefill_s": prefill_s, "budget_slots": keep,
            "ar_step_ms": 1e3 * _median_s(ar, reps), "draft_step_ms": 1e3 * _median_s(draft, reps),
            "compact_ms": 1e3 * _median_s(lambda: view.compact(cache, 18, out=small), reps),
            "verify_ms": {n: 1e3 * _median_s(verify(n), reps) for n in rows},
            "kv_mb_dense": kv_bytes * context / 2**20, "kv_mb_draft": kv_bytes * keep / 2**20}


def table_lines(rows: list[dict]) -> list[str]:
    """The ``<out>.md`` table: one row per context of ``rows`` (``measure``'s dicts, or ``<out>.json``'s)."""
    ns = list(rows[0]["verify_ms"])
    headers = ["context", "prefill s", "AR step ms", "draft step ms (10 %)", "draft / AR", "compact ms",
               *(f"verify {n} rows ms" for n in ns), "KV MB dense", "KV MB draft"]
    cells = [[r["context"], f"{r['prefill_s']:.1f}", f"{r['ar_step_ms']:.1f}", f"{r['draft_step_ms']:.1f}",
              f"{r['draft_step_ms'] / r['ar_step_ms']:.2f}", f"{r['compact_ms']:.1f}",
              *(f"{r['verify_ms'][n]:.1f}" for n in ns), f"{r['kv_mb_dense']:.0f}", f"{r['kv_mb_draft']:.0f}"]
             for r in rows]
    return markdown_table(headers, cells, "r" * len(headers), tight_rule=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="writes <out>.json, <out>.md and <out>.png")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8000])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--target", default="asset:smollm2-135m-instruct")
    a = ap.parse_args()
    torch.set_num_threads(2)
    target = load_target(a.target)
    with torch.no_grad():
        rows = [measure(target, c, reps=a.reps, budget=0.1, min_budget=128) for c in tqdm(a.contexts, desc="contexts")]
    atomic_write_text(a.out.with_suffix(".json"), json.dumps(rows, indent=1) + "\n")
    ns = list(rows[0]["verify_ms"])
    lines = table_lines(rows)
    atomic_write_text(a.out.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ctx = [r["context"] for r in rows]
    ax.plot(ctx, [r["ar_step_ms"] for r in rows], "o-", label="AR step (dense)")
    ax.plot(ctx, [r["draft_step_ms"] for r in rows], "s-", label="draft step (10 % view)")
    ax.plot(ctx, [r["verify_ms"][ns[-1]] for r in rows], "^--", label=f"verify pass, {ns[-1]} rows")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("ms")
    ax.set_title(f"{target.name.split('/')[-1]}: step cost vs context (2 CPU cores)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(a.out.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
