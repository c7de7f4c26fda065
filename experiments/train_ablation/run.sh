#!/usr/bin/env bash
# EAGLE-3 training levers at equal CPU time on the embedded target (SmolLM2-135M-Instruct).
#   experiments/train_ablation/run.sh [out root]            # then: python experiments/train_ablation/compare.py <out root>
# Every row trains from the same offline features (400 ShareGPT + 300 GSM8K-train conversations, original
# responses, max 1024 tokens: 651 samples, 348k tokens; 5 % held out) and is validated on the same held-out
# split with the same 7-step chain (val_ttt_length=7), so val/acc_0 and val/simulated_tau compare across rows.
# CPU time: each row gets the optimiser steps its variant would run, at the step-time ratios of a
# fixed-shape benchmark (TTT-7 bf16 1.47x, TTT-2 bf16 4.13x the TTT-7 fp32 rate), in the time TTT-7 fp32
# needs for 67 steps (about 12 quiet 2-core minutes). A step count, not a wall-clock limit, so a busy
# machine slows a row down without changing what it learns. On real, variable-length batches the bf16
# gain was smaller, so the bf16 rows ran longer than the fp32 ones: compare.py reports each row's measured
# seconds and, for the two-epoch rows, the validation after the first epoch (less time than the fp32 rows).
# The LR schedule (warm-up 2 % + cosine) spans each row's own steps; rows over one epoch (154 batches) run
# two epochs of half the steps (limit_train_batches), validating after each.
set -euo pipefail
ONLY=${ONLY:-}   # ONLY="k7_bf16_target k2_bf16_target": just those rows
OUT=${1:-runs/train_ablation}
# The recipe's settings at the time of these rows are pinned (TTT-7, fp32, 5 % held out, one validation
# per epoch); each row then changes its own levers.
common=(experiment=smollm2_eagle3 regen.enabled=false data.sources.sharegpt.limit=400 data.sources.gsm8k.limit=300
        data.max_length=1024 eval.enabled=false method.module.val_ttt_length=7 method.data.val_fraction=0.05
        trainer.val_check_interval=1.0)
row() {  # row <name> <epochs> <batches per epoch> <overrides...>
  local name=$1 epochs=$2 batches=$3; shift 3
  if [[ -n "$ONLY" && " $ONLY " != *" $name "* ]]; then return; fi
  draftlab-train "${common[@]}" task_name="ablation_$name" trainer.max_epochs="$epochs" \
    +trainer.limit_train_batches="$batches" hydra.run.dir="$OUT/$name" "$@" || echo "row $name FAILED" >&2
}
fp32=(method.module.ttt_length=7 trainer.precision=32-true)
bf16=(method.module.ttt_length=7 trainer.precision=bf16-mixed)
row k7_fp32_random 1 67 "${fp32[@]}"                                                        # the recipe's old choices
row k7_fp32_target 1 67 "${fp32[@]}" method.draft.init.lm_head=target                       # + LM head from the target
row k7_bf16_target 1 98 "${bf16[@]}" method.draft.init.lm_head=target                       # + bf16 autocast
row k2_bf16_target 2 139 method.draft.init.lm_head=target method.module.ttt_length=2 trainer.precision=bf16-mixed
row curriculum_bf16_target 2 90 "${bf16[@]}" method.draft.init.lm_head=target \
    'method.module.ttt_curriculum=[[0.7,2]]'                                               # TTT-2 for 70 %, then TTT-7
