#!/usr/bin/env bash
# The ConFu Table 1 cell at T = 0 (8 nodes) from the re-measured recipe's EAGLE-3 draft, on one core:
#   experiments/confu/recipe_t0.sh <recipe EAGLE-3 draft dir> OUT_DIR
# Rows: the draft as it is, the draft continued for the same steps on the same data, ConFu from the draft.
# The recipe trains on original responses, so this cell does too (regen.enabled=false); everything else is
# confu_smollm2's. Each step is skipped once its record.json exists; trained drafts are content-addressed.
set -euo pipefail
D=${1:?usage: recipe_t0.sh DRAFT_DIR OUT_DIR}
R=${2:?usage: recipe_t0.sh DRAFT_DIR OUT_DIR}
C=(experiment=confu_smollm2 "init.from=$D" regen.enabled=false logger=csv)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
[ -f "$R/eagle3/record.json" ] || draftlab-eval "${C[@]}" method=eagle3 "draft_path=$D" "hydra.run.dir=$R/eagle3"
[ -f "$R/eagle3_continue/record.json" ] || draftlab-train "${C[@]}" method=eagle3_continue "hydra.run.dir=$R/eagle3_continue"
[ -f "$R/confu/record.json" ] || draftlab-train "${C[@]}" method=confu "hydra.run.dir=$R/confu"
draftlab-table "$R/eagle3" "$R/eagle3_continue" "$R/confu" --layout table1 --format both \
  --out "$(dirname "$0")/table1_recipe"
