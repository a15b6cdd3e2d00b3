#!/usr/bin/env bash
# Node budgets on the eager packed-q4-amx target where it runs on AVX512-BF16 dot products (stop 69, AMD EPYC Zen 5):
# plain decoding; EAGLE-3 at budgets 1 / 2 / 3 and with prompt lookup's branch on top at 1 / 2 / 3; SpecBlock at M = 2
# (expected-acceptance widths) budgets 2 / 4 / 6 and at M = 1 (rank widths) budgets 2 / 3, each alone and with the
# branch on top. Shipped settings: EAGLE-3 budget 2, SpecBlock M = 2 budget 4 (serving.json). Writes
# experiments/results/${NAME:-bench_smollm2_zen5_budgets_s69}.
set -euo pipefail
PY=${PY:-.venv/bin/python}
M="ar"
S=()
for b in 1 2 3; do
  M+=",eagle3@b$b,eagle3+lookup@b$b"
  S+=(--set "eagle3@b$b:budget=$b" --set "eagle3+lookup@b$b:budget=$b" --set "eagle3+lookup@b$b:lookup_on_top=true")
done
for mb in 2:2:expected:ExpectedAcceptanceBranching 2:4:expected:ExpectedAcceptanceBranching \
          2:6:expected:ExpectedAcceptanceBranching 1:2:branching:RankBucketBranching 1:3:branching:RankBucketBranching; do
  IFS=: read -r m b mod cls <<< "$mb"
  for v in "specblock@m${m}b$b" "specblock+lookup@m${m}b$b"; do
    M+=",$v"
    S+=(--set "$v:budget=$b" --set "$v:M=$m" --set "$v:policy=specblock.policies.$mod:$cls")
  done
  S+=(--set "specblock+lookup@m${m}b$b:lookup_on_top=true")
done
$PY -m specblock.runtime bench --target smollm2-135m-instruct --methods "$M" "${S[@]}" --dtype packed-q4-amx \
    --prompts "${PROMPTS:-2}" --runs "${RUNS:-3}" --max-new-tokens 48 --threads 2 \
    --out "experiments/results/${NAME:-bench_smollm2_zen5_budgets_s69}"
