#!/usr/bin/env bash
# SSD over the trained EAGLE-3 recipe draft (experiments/ssd/README.md, "EAGLE-3 primary"): AR / SD / SSD with
# the target on CPU 0 (SSD's worker on CPU 1) at T = 0 and 0.7, then AR / SD on both cores.
#   experiments/ssd/run_eagle3.sh [runs dir] [draft dir]     # about 35 minutes on 2 cores; each step skipped once done
set -euo pipefail
R=${1:-runs/ssd_eagle3}
DRAFT=${2:-$HOME/.cache/draftlab/artifacts/eagle3/65d847bd8e85e2a2/draft}
one() { OMP_NUM_THREADS=1 taskset -c 0 draftlab-eval draft_path="$DRAFT" "$@"; }
two() { OMP_NUM_THREADS=2 draftlab-eval draft_path="$DRAFT" eval.baselines.ssd=null eval.baselines.ssd_fast=null "$@"; }
[ -f "$R/t0/record.json" ] || one experiment=ssd_eagle3_smollm2 hydra.run.dir="$R/t0"
[ -f "$R/t07/record.json" ] || one experiment=ssd_eagle3_smollm2_t07 hydra.run.dir="$R/t07"
[ -f "$R/t0_2cores/record.json" ] || two experiment=ssd_eagle3_smollm2 hydra.run.dir="$R/t0_2cores"
[ -f "$R/t07_2cores/record.json" ] || two experiment=ssd_eagle3_smollm2_t07 eval.baselines.ssd_c05=null hydra.run.dir="$R/t07_2cores"
