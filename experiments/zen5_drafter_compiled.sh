#!/usr/bin/env bash
# Compiled drafters beside the eager target where drafting is a larger share of an iteration (stop 70, AMD EPYC Zen 5,
# eager packed-q4-amx on dot products): SpecBlock and EAGLE-3 at their serving settings for this CPU, alone and with
# prompt lookup's branch, each with its eager and its compiled drafter step (METHOD@cd: drafter_compiled=true). On the
# Xeon at packed fp16 SpecBlock's compiled block gained nothing measurable there (bench_smollm2_drafter_compiled_eager.md).
# Writes experiments/results/${NAME:-bench_smollm2_zen5_drafter_compiled_s70}.
set -euo pipefail
PY=${PY:-.venv/bin/python}
M="ar"
S=()
for m in specblock specblock+lookup eagle3 eagle3+lookup; do
  M+=",$m,$m@cd"
  S+=(--set "$m@cd:drafter_compiled=true")
done
$PY -m specblock.runtime bench --target smollm2-135m-instruct --methods "$M" "${S[@]}" --dtype packed-q4-amx \
    --prompts "${PROMPTS:-3}" --runs "${RUNS:-3}" --max-new-tokens 48 --threads 2 \
    --out "experiments/results/${NAME:-bench_smollm2_zen5_drafter_compiled_s70}"
