#!/usr/bin/env bash
# The small lab end to end: the commands that produced the shipped assets and the figures in the
# issue notes, in order. Each step resumes or overwrites atomically; run a single step by copying
# its line. Times are for this project's 2-core CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
step=${1:-all}

if [[ $step == all || $step == target ]]; then
  # ~100 minutes of training steps; resumes from runs/target/ckpt/latest.pt
  $PY -m specblock.training.target train --batch 16 --lr 1.5e-3 --warmup 100 --max-steps 2400 \
      --max-minutes 100 --eval-every 100 --ckpt-every 50
  $PY -m specblock.training.target export specblock/assets/target
  $PY experiments/target_speed.py
  $PY experiments/target_card.py
fi
if [[ $step == all || $step == drafter ]]; then
  # resumes from runs/drafter_specblock/ckpt.pt
  $PY -m specblock.training drafter --target specblock/assets/target --run-dir runs/drafter_specblock \
      --out specblock/assets/drafters/specblock --max-minutes "${DRAFTER_MINUTES:-40}" --max-steps 3000 \
      --lr 2e-3 --intermediate 512 --eval-every 100
fi
if [[ $step == all || $step == measure ]]; then
  # On a quiet machine: every figure below is a timing.
  rm -rf runs/traces
  $PY -m specblock.runtime calibrate --out specblock/sim/data/latency_cpu.json
  $PY experiments/target_speed.py
  $PY experiments/engine_overhead.py
  $PY -m specblock.runtime bench --methods ar,lookup,specblock,specblock@m1,specblock@topk2 \
      --set specblock@m1:M=1 --set specblock@topk2:widths=2,2,2,2 \
      --prompts 4 --runs 3 --max-new-tokens 96 --out experiments/results/bench_specblock --trace-dir runs/traces
  $PY experiments/specblock_eval.py --bench experiments/results/bench_specblock.json \
      --latency specblock/sim/data/latency_cpu.json
  $PY experiments/sim_fidelity.py
  $PY experiments/target_card.py
fi
