#!/usr/bin/env bash
# Training objectives at equal training time (README.md): EAGLE-3 and DFlash on SmolLM2-135M-Instruct, each arm
# trained for the same wall-clock on experiment=smollm2_small's regenerated conversations, then evaluated against
# AR. Hydra multiruns of experiment=objectives: a finished training or evaluation is reused (content-addressed
# drafts, eval.reuse), so re-running this script finishes only the missing jobs.
#   experiments/objectives/run.sh runs/objectives [minutes per arm, default 2]
set -euo pipefail
OUT=${1:-runs/objectives}
MIN=${2:-2}
COMMON=(experiment=objectives method=eagle3,dflash eval.temperature=0,1.0 logger=csv
        trainer.max_time="$(printf "00:00:%02d:00" "$MIN")")
GSM8K=('bench.categories=[math_reasoning]' bench.per_category=8)   # GSM8K test questions (Spec-Bench's math rows)
mkdir -p "$OUT"

# 1. The loss axis: forward KL, TV, LK and hard CE, each method's own position decay, AdamW. Each job trains its
#    draft (or reuses it) and answers Spec-Bench (one question per category) at T = 0 and T = 1; then GSM8K.
draftlab-train -m "${COMMON[@]}" loss=kl,tv,lk,ce hydra.sweep.dir="$OUT/loss_specbench"
draftlab-train -m "${COMMON[@]}" loss=kl,tv,lk,ce "${GSM8K[@]}" hydra.sweep.dir="$OUT/loss_gsm8k"
# 2. Position weighting: D-PACE in place of the decay, on KL and CE (Spec-Bench).
draftlab-train -m "${COMMON[@]}" loss=kl,ce loss.weighting=dpace hydra.sweep.dir="$OUT/dpace_specbench"
# 3. Optimiser: Muon on the hidden matrices (AdamW on embeddings, heads, norms), on KL and CE (Spec-Bench).
draftlab-train -m "${COMMON[@]}" loss=kl,ce optimizer=muon hydra.sweep.dir="$OUT/muon_specbench"
