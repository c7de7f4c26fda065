#!/usr/bin/env bash
# Draft capacity at equal CPU time: the recipe with one draft layer and with two, trained side by side for the
# same wall-clock budget (one core each, fp32), validated every VAL_EVERY steps on the same held-out split.
#   experiments/smollm2_eagle3/capacity.sh OUT_DIR            # MIN=40 VAL_EVERY=40 by default
# Re-running resumes each arm from its last checkpoint (its budget restarts, so prefer to let it finish).
# Writes OUT_DIR/layers{1,2}/record.json and OUT_DIR/capacity.md/.png (held-out acc_0 and simulated tau
# against training tokens, by curve.py).
set -euo pipefail
OUT=${1:?usage: capacity.sh OUT_DIR}
MIN=${MIN:-40}
VAL_EVERY=${VAL_EVERY:-40}
BUDGET=$(printf "00:00:%02d:00" "$MIN")
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"

arm() {  # $1 = number of draft layers
  OMP_NUM_THREADS=1 draftlab-train experiment=smollm2_eagle3 eval.enabled=false logger=csv \
    method.draft.num_layers="$1" trainer.precision=32-true +trainer.max_time="$BUDGET" \
    trainer.val_check_interval="$VAL_EVERY" hydra.run.dir="$OUT/layers$1" > "$OUT/layers$1.log" 2>&1
}
arm 1 & P1=$!
arm 2 & P2=$!
wait $P1 $P2

python "$HERE/curve.py" "$OUT/layers1" "$OUT/layers2" \
  --name "1 draft layer, ${MIN} min on one core" --name "2 draft layers, ${MIN} min on one core" \
  --out "$OUT/capacity"
