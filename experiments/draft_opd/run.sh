#!/usr/bin/env bash
# Draft-OPD vs continued SFT at equal training time, from the quickstart's supervised EAGLE-3 draft, on
# SmolLM2-135M-Instruct (2 CPU cores, ~45 min). Every step is content-addressed: re-running resumes.
#   experiments/draft_opd/run.sh runs/draft_opd [minutes per arm, default 10]
# With RECIPE=<recipe run dir>, step 8 also runs from the recipe's draft (45-minute arms, then about an hour of
# evaluation on 2 cores).
set -euo pipefail
OUT=${1:-runs/draft_opd}
MIN=${2:-10}
BUDGET=$(printf "00:00:%02d:00" "$MIN")
mkdir -p "$OUT"
record() { python -c "import json,sys; print(json.load(open(sys.argv[1]))['artifacts']['draft'])" "$1/record.json"; }
# Decoding settings shared by rollouts and evaluation: the quickstart's small fixed tree (6 nodes, depth 3).
TREE=(method.drafter.tree=fixed method.drafter.nodes=6 method.drafter.depth=3 method.drafter.branching=3)

# fp32 throughout: on an AVX2-only CPU (no native bf16) the quickstart's bf16 autocast ran ~10x slower.
FP32=(trainer.precision=32-true)

# 1. The supervised draft: the quickstart's data and TTT-2 (32 regenerated conversations), 4 epochs in fp32.
[ -f "$OUT/sft/record.json" ] || draftlab-train experiment=quickstart eval.enabled=false logger=csv \
    "${FP32[@]}" trainer.max_epochs=4 hydra.run.dir="$OUT/sft"
BASE=$(record "$OUT/sft")

# 2. Draft-OPD for $MIN minutes: GSM8K-train + ShareGPT prompts, 96-token rollouts at T=0 with the same
#    tree it is evaluated with; 8 replay steps of 4 rollouts per phase of 4 prompts.
[ -f "$OUT/opd/record.json" ] || draftlab-train experiment=draft_opd_smollm2 init.from="$BASE" \
    "${TREE[@]/#method./method.base.}" method.module.rollout_drafter.nodes=6 \
    method.module.refresh_every=8 method.module.sequences_per_step=4 method.module.generation.max_new_tokens=96 \
    method.module.optimizer.lr=3e-4 method.data.val_fraction=0 trainer.max_time="$BUDGET" "${FP32[@]}" \
    eval.enabled=false logger=csv hydra.run.dir="$OUT/opd"

# 2b. The paper's ablations, each the Draft-OPD arm above with one setting changed (ABLATIONS="" skips them):
#     no decay (gamma 1), all forward KL, all reverse KL, random anchors; the official sampled estimators; and
#     the Draft-OPD arm itself with another seed (other prompts and order), for the spread of one setting.
#     Two random-anchor arms: `random` replays the committed continuation at random positions as all accepted
#     (so it also drops the rejected positions and their reverse-KL term); `random_rounds` runs a real
#     verification round of the rollout drafter at as many random positions, so only the placement differs.
#     Those extra rounds make its phases dearer, so in $MIN minutes it takes fewer optimiser steps; the arm
#     `random_rounds_steps` (not in the default list) trains it for the Draft-OPD arm's step count instead
#     (OPD_STEPS, default 33: what that arm made in 5 minutes), with the 5-minute arms' schedule length (one
#     epoch of 1504 batches, as Lightning estimates it there), so both see the same prompts, phases and LRs.
ALL_ABLATIONS="seed1 nodecay forward reverse random random_rounds sampled"
declare -A ABL=([seed1]=seed=1 [nodecay]=method.module.objective.gamma=1.0 [forward]=method.module.objective.divergence=forward
                [reverse]=method.module.objective.divergence=reverse [random]=method.module.anchors=random
                [random_rounds]=method.module.anchors=random_rounds [sampled]=method.module.objective.estimator=sampled
                [random_rounds_steps]="method.module.anchors=random_rounds trainer.max_steps=${OPD_STEPS:-33} +method.module.total_steps=1504 trainer.max_time=00:01:00:00")
for arm in ${ABLATIONS-$ALL_ABLATIONS}; do
  [ -f "$OUT/opd_$arm/record.json" ] || draftlab-train experiment=draft_opd_smollm2 init.from="$BASE" \
      "${TREE[@]/#method./method.base.}" method.module.rollout_drafter.nodes=6 \
      method.module.refresh_every=8 method.module.sequences_per_step=4 method.module.generation.max_new_tokens=96 \
      method.module.optimizer.lr=3e-4 method.data.val_fraction=0 trainer.max_time="$BUDGET" "${FP32[@]}" \
      ${ABL[$arm]} eval.enabled=false logger=csv hydra.run.dir="$OUT/opd_$arm"  # unquoted: one or more overrides
done

# 3. Continued SFT for $MIN minutes on the supervised data (its features are already cached; SFT_MORE=0 skips).
[ "${SFT_MORE:-1}" = 0 ] || [ -f "$OUT/sft_more/record.json" ] || draftlab-train experiment=quickstart method=eagle3_continue \
    init.from="$BASE" trainer.max_epochs=1000 +trainer.max_time="$BUDGET" method.data.val_fraction=0 "${FP32[@]}" \
    eval.enabled=false logger=csv hydra.run.dir="$OUT/sft_more"

# 4. Each draft on Spec-Bench (one question per category, 128 tokens, T=0) against AR in its own process.
# EVAL_ARMS="sft opd_forward ..." evaluates only those (the drafts are deterministic at T=0, so tau is the
# same in any process; SR needs its own AR run, measured beside each draft).
for arm in ${EVAL_ARMS-sft opd sft_more $(for a in ${ABLATIONS-$ALL_ABLATIONS}; do echo "opd_$a"; done)}; do
  [ -f "$OUT/eval_$arm/record.json" ] || draftlab-eval experiment=quickstart method=eagle3 \
      draft_path="$(record "$OUT/$arm")" bench=specbench bench.per_category=1 eval.max_new_tokens=128 \
      "${TREE[@]}" eval.baselines.pld=null eval.baselines.suffix=null logger=csv hydra.run.dir="$OUT/eval_$arm"
done
[ -f "$OUT/eval_sft/record.json" ] && [ -f "$OUT/eval_opd/record.json" ] && [ -f "$OUT/eval_sft_more/record.json" ] &&
  draftlab-report "$OUT/eval_sft" "$OUT/eval_opd" "$OUT/eval_sft_more" --name "SFT (start)" \
    --name "Draft-OPD" --name "SFT continued" --out experiments/draft_opd/report --format md

# 5. GSM8K test questions never trained on (Spec-Bench's math_reasoning rows are GSM8K test; none is in the
#    GSM8K train prompts), 10 questions, same drafter.
for arm in ${GSM8K_ARMS-sft sft_more opd opd_seed1 opd_forward opd_random opd_random_rounds}; do
  [ -f "$OUT/gsm8k_$arm/record.json" ] || draftlab-eval experiment=quickstart method=eagle3 \
      draft_path="$(record "$OUT/$arm")" bench=specbench 'bench.categories=[math_reasoning]' bench.per_category=10 \
      eval.max_new_tokens=128 "${TREE[@]}" eval.baselines.pld=null eval.baselines.suffix=null logger=csv \
      hydra.run.dir="$OUT/gsm8k_$arm"
done

# 6. Held-out tau against training time (the plateau of the paper's Figure 1): continued SFT and Draft-OPD for
#    CURVE_MIN minutes (default 15) with a checkpoint every CURVE_EVERY minutes (5), run side by side on one
#    core each, so both arms get the same CPU time; then every checkpoint decodes Spec-Bench (one question
#    per category, 96 tokens, T=0) with the evaluated tree (curve.py). CURVE=0 skips this step.
if [ "${CURVE:-1}" = 1 ]; then
CMIN=${CURVE_MIN:-15}
CBUDGET=$(printf "00:00:%02d:00" "$CMIN")
CKPT=(callbacks.model_checkpoint.save_top_k=-1 +callbacks.model_checkpoint.train_time_interval._target_=datetime.timedelta
      +callbacks.model_checkpoint.train_time_interval.minutes="${CURVE_EVERY:-5}")
if [ ! -f "$OUT/curve_opd/record.json" ] || [ ! -f "$OUT/curve_sft/record.json" ]; then
  OMP_NUM_THREADS=1 draftlab-train experiment=draft_opd_smollm2 init.from="$BASE" \
      "${TREE[@]/#method./method.base.}" method.module.rollout_drafter.nodes=6 \
      method.module.refresh_every=8 method.module.sequences_per_step=4 method.module.generation.max_new_tokens=96 \
      method.module.optimizer.lr=3e-4 method.data.val_fraction=0 trainer.max_time="$CBUDGET" "${FP32[@]}" \
      "${CKPT[@]}" eval.enabled=false logger=csv hydra.run.dir="$OUT/curve_opd" & P1=$!
  OMP_NUM_THREADS=1 draftlab-train experiment=quickstart method=eagle3_continue \
      init.from="$BASE" trainer.max_epochs=1000 +trainer.max_time="$CBUDGET" method.data.val_fraction=0 "${FP32[@]}" \
      "${CKPT[@]}" eval.enabled=false logger=csv hydra.run.dir="$OUT/curve_sft" & P2=$!
  wait "$P1"; wait "$P2"   # set -e: either arm failing stops the script
fi
python experiments/draft_opd/curve.py --start "$BASE" "$OUT/curve_sft" "$OUT/curve_opd" \
    --name "SFT continued" --name "Draft-OPD" --out experiments/draft_opd/curve
fi

# 7. The DFlash base: a supervised DFlash draft (block 4; experiment=dflash_smollm2's 32 regenerated
#    conversations, 10 minutes), then Draft-OPD and continued supervised training from it for $MIN minutes
#    each on one core (DFLASH=0 skips). Evaluated as above: Spec-Bench (one per category) and GSM8K test (10).
if [ "${DFLASH:-1}" = 1 ]; then
  B4=(method.draft.block_size=4)
  [ -f "$OUT/dflash_sft/record.json" ] || draftlab-train experiment=dflash_smollm2 "${B4[@]}" eval.enabled=false \
      logger=csv hydra.run.dir="$OUT/dflash_sft"
  DBASE=$(record "$OUT/dflash_sft")
  # The two arms side by side on one core each, as the time curve: any other load hits both alike.
  if [ ! -f "$OUT/dflash_opd/record.json" ] || [ ! -f "$OUT/dflash_sft_more/record.json" ]; then
    OMP_NUM_THREADS=1 draftlab-train experiment=draft_opd_dflash_smollm2 init.from="$DBASE" \
        "${B4[@]/#method./method.base.}" method.module.refresh_every=8 method.module.sequences_per_step=4 \
        method.module.generation.max_new_tokens=96 method.module.optimizer.lr=3e-4 method.data.val_fraction=0 \
        trainer.max_time="$BUDGET" "${FP32[@]}" eval.enabled=false logger=csv hydra.run.dir="$OUT/dflash_opd" & P1=$!
    OMP_NUM_THREADS=1 draftlab-train experiment=dflash_smollm2 "${B4[@]}" +method.draft.init.from="$DBASE" \
        trainer.max_time="$BUDGET" method.data.val_fraction=0 "${FP32[@]}" eval.enabled=false logger=csv \
        hydra.run.dir="$OUT/dflash_sft_more" & P2=$!
    wait "$P1"; wait "$P2"
  fi
  for arm in dflash_sft dflash_opd dflash_sft_more; do
    [ -f "$OUT/eval_$arm/record.json" ] || draftlab-eval experiment=smollm2_small method=dflash \
        draft_path="$(record "$OUT/$arm")" bench=specbench bench.per_category=1 eval.max_new_tokens=128 \
        logger=csv hydra.run.dir="$OUT/eval_$arm"
    [ -f "$OUT/gsm8k_$arm/record.json" ] || draftlab-eval experiment=smollm2_small method=dflash \
        draft_path="$(record "$OUT/$arm")" bench=specbench 'bench.categories=[math_reasoning]' bench.per_category=10 \
        eval.max_new_tokens=128 logger=csv hydra.run.dir="$OUT/gsm8k_$arm"
  done
fi

# 8. From the recipe's supervised EAGLE-3 draft (RECIPE=<its run dir>, made by experiments/smollm2_eagle3:
#    `draftlab-train experiment=smollm2_eagle3 eval.enabled=false hydra.run.dir=runs/recipe/train`): Draft-OPD
#    (experiment=draft_opd_smollm2 as configured: 128-token rollouts with a fixed 8-node tree) and continued SFT
#    on the recipe's own data (its features are cached), RECIPE_MIN minutes each (default 45, the config's), side
#    by side on one core each, with a checkpoint every RECIPE_EVERY minutes (15) for the time curve. Both at the
#    same constant learning rate (1e-4, no warm-up: a schedule sized for a whole epoch would still be warming up
#    when the time runs out), so only the data and objective differ.
#    Then the start and both drafts decode Spec-Bench (RECIPE_PER_CATEGORY questions per category, default 3)
#    and GSM8K test (10) with the rollouts' fixed tree (8 nodes, depth 4, top-k 4): a fixed tree makes τ a
#    property of the draft alone. Two queues of one core each; every job skips when its record exists.
if [ -n "${RECIPE:-}" ]; then
  RBASE=$(record "$RECIPE")
  RMIN=${RECIPE_MIN:-45}
  RBUDGET=$(printf "00:00:%02d:00" "$RMIN")
  RPER=${RECIPE_PER_CATEGORY:-3}
  LR=(method.module.optimizer.lr=1e-4 method.module.schedule.warmup_ratio=0 method.module.schedule.min_ratio=1.0)
  RTREE=(method.drafter.tree=fixed method.drafter.nodes=8 method.drafter.depth=4 method.drafter.branching=4)
  RCKPT=(callbacks.model_checkpoint.save_top_k=-1 +callbacks.model_checkpoint.train_time_interval._target_=datetime.timedelta
         +callbacks.model_checkpoint.train_time_interval.minutes="${RECIPE_EVERY:-15}")
  R="$OUT/recipe_${RMIN}min"
  if [ ! -f "$R/opd/record.json" ] || [ ! -f "$R/sft_more/record.json" ]; then
    OMP_NUM_THREADS=1 draftlab-train experiment=draft_opd_smollm2 init.from="$RBASE" method.data.val_fraction=0 \
        "${LR[@]}" trainer.max_time="$RBUDGET" "${FP32[@]}" "${RCKPT[@]}" eval.enabled=false logger=csv \
        hydra.run.dir="$R/opd" & P1=$!
    OMP_NUM_THREADS=1 draftlab-train experiment=smollm2_eagle3 method=eagle3_continue init.from="$RBASE" \
        trainer.max_epochs=1000 +trainer.max_time="$RBUDGET" method.data.val_fraction=0 "${LR[@]}" "${FP32[@]}" \
        "${RCKPT[@]}" eval.enabled=false logger=csv hydra.run.dir="$R/sft_more" & P2=$!
    wait "$P1"; wait "$P2"
  fi
  NOBASE=(eval.baselines.pld=null eval.baselines.suffix=null eval.baselines.hybrid=null eval.baselines.hybrid_gated=null)
  draft_of() { if [ "$1" = start ]; then echo "$RBASE"; else record "$R/$1"; fi; }
  spec() { [ -f "$R/eval_$1/record.json" ] || OMP_NUM_THREADS=1 draftlab-eval experiment=smollm2_eagle3 method=eagle3 \
      draft_path="$(draft_of "$1")" bench.per_category="$RPER" "${RTREE[@]}" "${NOBASE[@]}" logger=csv \
      hydra.run.dir="$R/eval_$1"; }
  gsm() { [ -f "$R/gsm8k_$1/record.json" ] || OMP_NUM_THREADS=1 draftlab-eval experiment=smollm2_eagle3 method=eagle3 \
      draft_path="$(draft_of "$1")" 'bench.categories=[math_reasoning]' bench.per_category=10 "${RTREE[@]}" \
      "${NOBASE[@]}" logger=csv hydra.run.dir="$R/gsm8k_$1"; }
  curve() { OMP_NUM_THREADS=1 python experiments/draft_opd/curve.py --start "$RBASE" "$R/sft_more" "$R/opd" \
      --name "SFT continued" --name "Draft-OPD" --out experiments/draft_opd/curve_recipe \
      --override method.drafter.nodes=8 --override method.drafter.depth=4 --override method.drafter.branching=4 \
      --override eval.max_new_tokens=128; }
  (spec opd && spec start && gsm opd && gsm start) & P1=$!
  (spec sft_more && curve && gsm sft_more) & P2=$!
  wait "$P1"; wait "$P2"
fi
