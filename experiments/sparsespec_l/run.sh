#!/usr/bin/env bash
# SparseSpec-L on SmolLM2-135M-Instruct, long context (experiments/sparsespec_l/README.md). About 35 minutes
# on 2 cores: the evaluation (~30 min: 3 prompts x AR + 9 drafters, each paying its own ~6k-8k-token
# prefill), then the step-cost scaling curve (~3 min). Each step is skipped once its output exists. Run
# nothing else meanwhile: the numbers are wall-clock ratios on 2 shared cores.
set -euo pipefail
OUT=${1:-runs/sparsespec_l}
HERE=experiments/sparsespec_l
export WANDB_MODE=${WANDB_MODE:-offline}
[[ -f "$OUT/eval/record.json" ]] || draftlab-eval experiment=sparsespec_l_long hydra.run.dir="$OUT/eval"
python $HERE/report.py "$OUT/eval" --out $HERE/table
mkdir -p $HERE/records/answers
cp "$OUT/eval/record.json" $HERE/records/
cp "$OUT"/eval/answers/*.jsonl $HERE/records/answers/
[[ -f $HERE/scaling.json ]] || python $HERE/scaling.py --out $HERE/scaling
