#!/usr/bin/env bash
# SpecBlock as a chain where tree rows are dear (stop 70, AMD EPYC Zen 5, eager packed-q4-amx on dot products): one
# block (M = 1) with the rank head's widths at 1 per position (a chain of budget 2 / 3 / 4 tokens), or 1 / 1 / 1 / 0
# (the chain stops where the rank head puts the position in its last bucket) at budget 4, alone and with prompt
# lookup's branch; EAGLE-3 (budget 1 on this CPU) and SpecBlock at their shipped settings for reference. Writes
# experiments/results/${NAME:-bench_smollm2_zen5_chains_s70}.
set -euo pipefail
PY=${PY:-.venv/bin/python}
M="ar,eagle3,eagle3+lookup,specblock,specblock+lookup"
S=()
for v in ch2:1,1,1,1:2 ch3:1,1,1,1:3 ch4:1,1,1,1:4 stop4:1,1,1,0:4; do
  IFS=: read -r name widths budget <<< "$v"
  for m in "specblock@$name" "specblock+lookup@$name"; do
    M+=",$m"
    S+=(--set "$m:M=1" --set "$m:widths=$widths" --set "$m:budget=$budget")
  done
  S+=(--set "specblock+lookup@$name:lookup_on_top=true")
done
$PY -m specblock.runtime bench --target smollm2-135m-instruct --methods "$M" "${S[@]}" --dtype packed-q4-amx \
    --prompts "${PROMPTS:-3}" --runs "${RUNS:-3}" --max-new-tokens 48 --threads 2 \
    --out "experiments/results/${NAME:-bench_smollm2_zen5_chains_s70}"
