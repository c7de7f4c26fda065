#!/usr/bin/env bash
# The block-family tables and survival curves, regenerated from the kept run records (records/) by draftlab-table
# and draftlab-report.
#   experiments/block_family/tables.sh            (after copying runs/block_family/eval_*/record.json to records/)
set -euo pipefail
HERE=experiments/block_family
R=$HERE/records
# Spec-Bench, one question per category, T = 0 and T = 1: one row per method and drafter setting (the methods
# layout keys rows by the axes each method declares: branching, selector), tau and SR with 95 % intervals.
draftlab-table $R/eval_*_specbench_t0.json $R/eval_*_specbench_t1.json --layout methods --ci --cell joint \
    --out $HERE/table_specbench.md
# GSM8K test questions (Spec-Bench's math_reasoning rows), 8, T = 0.
draftlab-table $R/eval_*_gsm8k_t0.json --layout methods --ci --cell joint --out $HERE/table_gsm8k.md
# Per-position acceptance (survival P(accepted >= l)) at T = 0 on Spec-Bench.
ARMS=(eagle3 dflash dflash_tree dflash2 dflash2_unary dspark)
NAMES=("EAGLE-3 (8 nodes)" "DFlash B=4" "DFlash B=4 tree (3 x 8 nodes)" "DFlash2 B=4" "DFlash2 B=4, selector off"
       "DSpark B=4")
paths=(); names=()
for i in "${!ARMS[@]}"; do paths+=("$R/eval_${ARMS[$i]}_specbench_t0.json"); names+=(--name "${NAMES[$i]}"); done
draftlab-report "${paths[@]}" "${names[@]}" --out $HERE/report_t0 --format md
