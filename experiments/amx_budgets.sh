#!/usr/bin/env bash
# Node budgets on the compiled packed-q4-amx target (stop 68): EAGLE-3 with prompt lookup's branch at drafter budgets
# 1-4, SpecBlock with it at M = 1 (rank widths) budgets 3 / 5 / 8 and M = 2 (expected-acceptance widths) budgets 4 / 8,
# the chain on top of each; plain decoding eager and compiled, EAGLE-3 and SpecBlock (M = 1, budget 3) without the
# branch. Writes experiments/results/${NAME:-bench_smollm2_compiled_amx_budgets_s68}.
set -euo pipefail
PY=${PY:-.venv/bin/python}
M="ar,ar@c,eagle3@c,specblock@c"
S=(--set ar@c:compiled=true --set eagle3@c:compiled=true --set specblock@c:compiled=true --set specblock@c:M=1
   --set specblock@c:budget=3 --set specblock@c:policy=specblock.policies.branching:RankBucketBranching)
for b in 1 2 3 4; do
  M+=",eagle3+lookup@c$b"
  S+=(--set "eagle3+lookup@c$b:compiled=true" --set "eagle3+lookup@c$b:budget=$b" --set "eagle3+lookup@c$b:lookup_on_top=true")
done
for mb in 1:3:branching:RankBucketBranching 1:5:branching:RankBucketBranching 1:8:branching:RankBucketBranching \
          2:4:expected:ExpectedAcceptanceBranching 2:8:expected:ExpectedAcceptanceBranching; do
  IFS=: read -r m b mod cls <<< "$mb"
  v="specblock+lookup@m${m}c$b"
  M+=",$v"
  S+=(--set "$v:compiled=true" --set "$v:budget=$b" --set "$v:lookup_on_top=true" --set "$v:M=$m"
      --set "$v:policy=specblock.policies.$mod:$cls")
done
$PY -m specblock.runtime bench --target smollm2-135m-instruct --methods "$M" "${S[@]}" --dtype packed-q4-amx \
    --prompts "${PROMPTS:-1}" --runs "${RUNS:-2}" --max-new-tokens 48 --threads 2 \
    --out "experiments/results/${NAME:-bench_smollm2_compiled_amx_budgets_s68}"
