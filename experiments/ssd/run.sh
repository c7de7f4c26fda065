#!/usr/bin/env bash
# SSD on SmolLM2-135M-Instruct (experiments/ssd/README.md): calibrations, then AR / SD / SSD with the target on
# CPU 0 (SSD's worker on CPU 1), AR / SD on both cores, then the report.
#   experiments/ssd/run.sh [runs dir]          # about 50 minutes on 2 cores; each step skipped once done
set -euo pipefail
R=${1:-runs/ssd}
D=experiments/ssd
mkdir -p "$D/calibration"
cal() { python -m draftlab.methods.ssd.calibrate method.base.drafter.layers=24 method.base.drafter.depth=3 "$@"; }
[ -f "$D/calibration/t0.json" ] || cal --temperature 0 --out $D/calibration/t0.json
[ -f "$D/calibration/t07.json" ] || cal --temperature 0.7 --out $D/calibration/t07.json
one() { OMP_NUM_THREADS=1 taskset -c 0 draftlab-eval "$@"; }
[ -f "$R/t0/record.json" ] || one experiment=ssd_smollm2 hydra.run.dir="$R/t0"
[ -f "$R/t07/record.json" ] || one experiment=ssd_smollm2_t07 hydra.run.dir="$R/t07"
[ -f "$R/t0_2cores/record.json" ] || OMP_NUM_THREADS=2 draftlab-eval experiment=ssd_smollm2 eval.baselines=null hydra.run.dir="$R/t0_2cores"
[ -f "$R/t07_2cores/record.json" ] || OMP_NUM_THREADS=2 draftlab-eval experiment=ssd_smollm2_t07 eval.baselines=null hydra.run.dir="$R/t07_2cores"
python $D/report.py --one-core "$R/t0" "$R/t07" --two-cores "$R/t0_2cores" "$R/t07_2cores" \
    --calibration $D/calibration/t0.json $D/calibration/t07.json --out $D
