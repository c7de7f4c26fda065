#!/usr/bin/env bash
# The objectives tables, paired comparisons, acceptance survival and held-out simulated-τ curves, regenerated from
# the kept run records (records/) by draftlab-table and draftlab-report.
#   experiments/objectives/tables.sh [runs/objectives]   (with a run directory: first copy its job records here)
set -euo pipefail
HERE=experiments/objectives
R=$HERE/records
if [ $# -ge 1 ]; then   # records/<bench>_<method>_<loss>_<weighting>_<optimizer>_t<T>.json, named from each record
  mkdir -p "$R"
  for f in "$1"/*/*/record.json; do
    name=$(python -c "
import json, sys
r = json.load(open(sys.argv[1])); a = r['eval']['axes']; bench = 'gsm8k' if sys.argv[1].split('/')[-3].endswith('gsm8k') else 'specbench'
opt = 'muon' if 'muon' in a['optimizer'] else 'adamw'
print(f\"{bench}_{r['eval']['method']}_{a['loss']}_{a['weighting']}_{opt}_t{r['eval']['temperature']:g}\")" "$f")
    cp "$f" "$R/$name.json"
  done
fi
# tau and SR with 95 % intervals over questions: one row per method and arm (the methods layout keys rows by the
# axes each method declares, here loss, weighting and optimizer), T = 0 and T = 1.
draftlab-table $R/specbench_*.json --layout methods --ci --cell joint --out $HERE/table_specbench.md
draftlab-table $R/gsm8k_*.json --layout methods --ci --cell joint --out $HERE/table_gsm8k.md
# Paired differences against forward KL (decay, AdamW) of the same method, bench and temperature, with per-position
# acceptance (survival) and the held-out simulated-tau curve against training seconds.
for bench in specbench gsm8k; do
  for m in eagle3 dflash; do
    for T in 0 1; do
      ref=$R/${bench}_${m}_kl_method_adamw_t$T.json
      [ -f "$ref" ] || continue
      paths=("$ref"); names=(--name kl)
      for f in $R/${bench}_${m}_*_t$T.json; do   # each arm named by its loss_weighting_optimizer
        [ "$f" = "$ref" ] && continue
        arm=$(basename "$f" .json); arm=${arm#"${bench}_${m}_"}; paths+=("$f"); names+=(--name "${arm%_t$T}")
      done
      draftlab-report "${paths[@]}" "${names[@]}" --out $HERE/report_${bench}_${m}_t$T --format md \
          --curves val/simulated_tau --curve-x seconds --title "$m, $bench, T = $T: arms against forward KL"
    done
  done
done
