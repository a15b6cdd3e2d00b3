#!/usr/bin/env bash
# --method auto's candidates on this machine, every one at its shipped settings (serving.json, with the overrides for
# this CPU kind): plain decoding, prompt lookup, EAGLE-3 and SpecBlock alone and with lookup's branch, eager and
# compiled, in one interleaved run. Its JSON is what experiments/best_method.py --cpu KIND records (eager and
# --compiled) for a kind of CPU the shipped records were not measured on. Writes
# experiments/results/${NAME:-bench_smollm2_cpu_auto}.
set -euo pipefail
PY=${PY:-.venv/bin/python}
M="ar"
S=()
for m in ar lookup eagle3 eagle3+lookup specblock specblock+lookup; do
  [ "$m" = ar ] || M+=",$m"
  M+=",$m@c"
  S+=(--set "$m@c:compiled=true")
done
$PY -m specblock.runtime bench --target smollm2-135m-instruct --methods "$M" "${S[@]}" --dtype "${DTYPE:-packed-q4-amx}" \
    --prompts "${PROMPTS:-3}" --runs "${RUNS:-5}" --max-new-tokens 48 --threads 2 \
    --out "experiments/results/${NAME:-bench_smollm2_cpu_auto}"
