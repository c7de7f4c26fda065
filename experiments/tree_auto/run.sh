#!/usr/bin/env bash
# tree: auto against fixed tree sizes on Spec-Bench (one question per category by default, 128 new tokens, T=0),
# one trained EAGLE-3 draft, EAGLE-2 trees of top_k 4 and depth 4 (the recipe's), AR in the same process.
#   experiments/tree_auto/run.sh <draft dir> [sweep root]
set -euo pipefail
DRAFT=${1:?usage: run.sh <draft dir> [sweep root]}
OUT=${2:-runs/tree_auto}
# PER_CATEGORY=3 for three questions per category; the recipe's baselines are off (one AR + one drafter per run).
common=(experiment=smollm2_eagle3 draft_path="$DRAFT" method.drafter.branching=4 method.drafter.depth=4 eval.temperature=0
        bench.per_category="${PER_CATEGORY:-1}" eval.baselines=null)
draftlab-eval -m "${common[@]}" method.drafter.tree=auto method.drafter.nodes=32 hydra.sweep.dir="$OUT/auto"
draftlab-eval -m "${common[@]}" method.drafter.tree=fixed method.drafter.nodes=2,4,8,16,32 hydra.sweep.dir="$OUT/fixed"
python experiments/tree_auto/compare.py "$OUT/fixed" "$OUT/auto" --out experiments/tree_auto/table_t0
