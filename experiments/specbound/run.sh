#!/usr/bin/env bash
# SpecBound on SmolLM2-135M-Instruct, end to end (experiments/specbound/README.md). About 70 minutes on 2 cores:
# heads (~18 min), the calibration report and the exit-policy grid + cost model (~2 min), Spec-Bench T=0 with
# the ablations (~25 min). Every step is skipped once its output exists; the trained heads are reused by key.
set -euo pipefail
OUT=${1:-runs/specbound}
HERE=experiments/specbound
[[ -f "$OUT/train/record.json" ]] || draftlab-train experiment=specbound_smollm2 eval.enabled=false hydra.run.dir="$OUT/train"
python $HERE/calibration.py "$OUT/train" --out $HERE/calibration
[[ -f $HERE/policy.md ]] || python $HERE/policy.py "$OUT/train" --out $HERE/policy
[[ -f "$OUT/eval/record.json" ]] || draftlab-train experiment=specbound_smollm2 hydra.run.dir="$OUT/eval"
draftlab-table "$OUT/eval" --layout methods --format both --out $HERE/table_t0
python $HERE/categories.py "$OUT/eval" --out $HERE/table_categories
# The decoded sweep over the exit rule (1 question per category, ~4 min per point); d_max and w_max are the
# ablations above. Skipped once its records exist.
ls "$OUT"/sweep/*/record.json >/dev/null 2>&1 || draftlab-train -m experiment=specbound_smollm2 bench.per_category=1 \
    eval.baselines=null method.drafter.alpha=0.5,1.0 method.drafter.tau=0.3,0.5 hydra.sweep.dir="$OUT/sweep"
draftlab-table "$OUT/sweep" --layout methods --format both --out $HERE/table_sweep
# The decoded sweep over the bounds (d_max x w_max, at the stricter exit rules tau 0.5 / 0.7 with alpha 1.0; 1
# question per category, ~4.5 min per point), drafting from the trained heads; skipped once its records exist.
HEADS=$(python -c "import json,sys; print(json.load(open(sys.argv[1]))['artifacts']['draft'])" "$OUT/train/record.json")
ls "$OUT"/sweep_bounds/*/record.json >/dev/null 2>&1 || draftlab-eval -m experiment=specbound_smollm2 \
    draft_path="$HEADS" bench.per_category=1 eval.baselines=null method.drafter.alpha=1.0 \
    method.drafter.tau=0.5,0.7 method.drafter.d_max=18,24 method.drafter.w_max=3,6 hydra.sweep.dir="$OUT/sweep_bounds"
python $HERE/sweep.py "$OUT/sweep_bounds" --out $HERE/sweep_bounds
