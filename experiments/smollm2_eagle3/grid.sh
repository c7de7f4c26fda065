#!/usr/bin/env bash
# The recipe's Spec-Bench grid on its trained draft: T in {0, 0.7, 1.0}, 128 new tokens, first turn. In each
# run AR, the EAGLE-3 draft (tree: auto), PLD, suffix decoding and the hybrid (EAGLE-3 + suffix in one tree)
# answer the same questions in one process; at T=0 the fixed tree sizes 1, 2, 4 and 8 too
# (experiment=smollm2_eagle3_trees), for the tree: auto check.
#   draftlab-train experiment=smollm2_eagle3 eval.enabled=false       # train first (resumable)
#   experiments/smollm2_eagle3/grid.sh [sweep root]                   # 3 questions per category everywhere
#   HOT_PER_CATEGORY=1 experiments/smollm2_eagle3/grid.sh             # 1 per category at T > 0 (~35 min less)
# On 2 cores: T=0 (9 drafters) ~55 min; T > 0 (5 drafters) ~11 min per question per category.
set -euo pipefail
OUT=${1:-runs/recipe/grid}
HOT=${HOT_PER_CATEGORY:-3}
HERE=experiments/smollm2_eagle3
[[ -f "$OUT/t0/record.json" ]] || draftlab-train experiment=smollm2_eagle3_trees hydra.run.dir="$OUT/t0"
for t in 0.7 1.0; do
  [[ -f "$OUT/t$t/record.json" ]] || draftlab-train experiment=smollm2_eagle3 eval.temperature=$t \
      bench.per_category="$HOT" hydra.run.dir="$OUT/t$t"
done
draftlab-table "$OUT" --layout methods --format both --out $HERE/table_grid
python experiments/tree_auto/compare.py "$OUT/t0" --label EAGLE-3 --group categories --out experiments/tree_auto/table_t0_3q
python experiments/tree_auto/compare.py "$OUT/t0" --label EAGLE-3 --out experiments/tree_auto/table_t0_3q_columns
