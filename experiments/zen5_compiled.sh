#!/usr/bin/env bash
# What --method auto should run on a CPU with AVX512-BF16 but no AMX (AMD EPYC Zen 5), where packed-q4-amx runs on
# dot products (stop 70): plain decoding eager and compiled; compiled prompt lookup; compiled EAGLE-3 at the shipped
# budget 2 and at 1, each alone and with prompt lookup's branch on top; compiled SpecBlock at its shipped settings and
# at M = 1 budget 3 (rank widths: the compiled settings elsewhere), alone and with the branch; eager EAGLE-3 at budgets
# 2 and 1, alone and with the branch (zen5_budgets.sh's eager winner, measured again on 3 prompts per domain). Run at
# eaa9af2's settings; the rows named without a budget keep them (pinned below) now that serving.json holds the winners.
# Writes experiments/results/${NAME:-bench_smollm2_zen5_compiled_s70}.
set -euo pipefail
PY=${PY:-.venv/bin/python}
M="ar,ar@c,lookup@c,eagle3@c,eagle3+lookup@c,eagle3@c1,eagle3+lookup@c1,specblock@c,specblock+lookup@c"
M+=",specblock@m1c3,specblock+lookup@m1c3,eagle3,eagle3+lookup,eagle3@b1,eagle3+lookup@b1"
S=()
for v in ar@c lookup@c eagle3@c eagle3+lookup@c eagle3@c1 eagle3+lookup@c1 specblock@c specblock+lookup@c \
         specblock@m1c3 specblock+lookup@m1c3; do
  S+=(--set "$v:compiled=true")
done
for v in eagle3@c1 eagle3+lookup@c1 eagle3@b1 eagle3+lookup@b1; do S+=(--set "$v:budget=1"); done
# the settings shipped before this run (serving.json now holds its winners for this CPU kind), pinned
for v in eagle3@c eagle3+lookup@c eagle3 eagle3+lookup; do S+=(--set "$v:budget=2"); done
for v in specblock@c specblock+lookup@c; do
  S+=(--set "$v:M=2" --set "$v:budget=4" --set "$v:policy=specblock.policies.expected:ExpectedAcceptanceBranching")
done
for v in specblock@m1c3 specblock+lookup@m1c3; do
  S+=(--set "$v:M=1" --set "$v:budget=3" --set "$v:policy=specblock.policies.branching:RankBucketBranching")
done
for v in eagle3+lookup@c1 eagle3+lookup@b1 specblock+lookup@m1c3; do S+=(--set "$v:lookup_on_top=true"); done
$PY -m specblock.runtime bench --target smollm2-135m-instruct --methods "$M" "${S[@]}" --dtype packed-q4-amx \
    --prompts "${PROMPTS:-3}" --runs "${RUNS:-3}" --max-new-tokens 48 --threads 2 \
    --out "experiments/results/${NAME:-bench_smollm2_zen5_compiled_s70}"
