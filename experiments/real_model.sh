#!/usr/bin/env bash
# The real target (SmolLM2-135M-Instruct, issue 13): every method that needs no training, its
# latency curve and the acceptance the drafters must reach. Run from the repo root on a quiet
# machine; each step writes experiments/results/*_smollm2.* (the figures in the README and docs/real_model.md).
set -euo pipefail
# The published tables are bf16: every bench and calibrate pins --dtype bfloat16 (the default is auto).
PY=${PY:-.venv/bin/python}
T=smollm2-135m-instruct
# 0. T(n) for the simulator and the physical-limit line
$PY -m specblock.runtime calibrate --target $T --dtype bfloat16 --out specblock/sim/data/latency_cpu_smollm2.json --reps 15
$PY experiments/physical_limit.py specblock/sim/data/latency_cpu_smollm2.json --out experiments/results/physical_limit_smollm2
# 1. the main table's training-free rows: 3 prompts per domain, medians of 3 interleaved runs, bf16
$PY -m specblock.runtime bench --target $T --methods ar,lookup,hf-lookup --dtype bfloat16 --prompts 3 --runs 3 --max-new-tokens 96 \
    --out experiments/results/bench_smollm2 --trace-dir runs/traces_smollm2
# 2. lossless at fp32: the same prompts, every training-free method against AR token for token
$PY -m specblock.runtime bench --target $T --methods ar,lookup,random,hf-lookup --dtype float32 --prompts 3 --runs 1 \
    --max-new-tokens 96 --out experiments/results/bench_smollm2_fp32
