#!/usr/bin/env bash
# Trained ablations of the SpecBlock drafter (issue 4 on the lab model, issue 14 on the real one), each
# with the same budget: the same data, seed, fresh init, number of steps and recipe; the LR schedule
# follows steps (the minute cap is set out of reach), then held-out per-position acceptance.
# Acceptance is not a timing, so the figures hold on a busy machine; only the wall time does not.
#
#   bash experiments/specblock_ablations.sh [STEPS]        # lab model, default 250 steps per variant
#   VARIANTS="no-cross-block" THREADS=1 bash experiments/specblock_ablations.sh   # some only
#   TARGET=smollm2-135m-instruct bash experiments/specblock_ablations.sh 100     # the real model
#   TARGET=smollm2-135m-instruct PARALLEL=2 TAG=_s58 TRAIN_FLAGS=--compile bash experiments/specblock_ablations.sh 400
#     (TAG= names a second set: runs under $H/runs/$TARGET/ablations$TAG, results *_smollm2$TAG; TRAIN_FLAGS= adds
#      trainer flags to every variant alike, such as --compile, which changes speed, not the recipe; SEED= another
#      seed for every variant, default 0)
#   ... RANK_STEPS=400 ...   # also full-rank: the full variant's rank head trained alone for that many more steps
#     (--train-only rank-head over its frozen backbone), in the table and the bench beside full and full-topk4
#
# The real model trains from the feature cache of `real_drafters.sh features` with the shipped
# recipe (2 layers, 8k draft vocabulary, batch 4 x 257) but a shorter budget and a 20-step warmup;
# its table is a fresh held-out evaluation of each exported variant on EVAL_WINDOWS windows
# (default 64), more than training's 8, so that differences of a few points are above the noise; the
# shipped drafter (longer training) is evaluated on the same windows as a last row.
# Two variants train side by side with PARALLEL=2 (one thread each; THREADS= is the table's). Then every finished variant is
# benched at the shipped drafter's serving settings (SKIP_BENCH=1: not; SKIP_TABLE=1: the bench alone).
#
# Resumable: a variant whose run already ended (a "final" line in its metrics) is skipped, and
# an interrupted one resumes from its checkpoint. Writes experiments/results/specblock_ablations.{json,md}
# (lab) or specblock_ablations_smollm2.{json,md} (real).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
ALL="full no-shift no-prefix-broadcast no-valid-prefix no-cross-block"
declare -A FLAGS=([full]="" [no-shift]="--no-shift" [no-prefix-broadcast]="--no-prefix-broadcast"
                  [no-valid-prefix]="--no-valid-prefix" [no-cross-block]="--no-cross-block")
finished() { [[ -f $1/metrics.jsonl ]] && grep -q '"final": true' "$1/metrics.jsonl"; }

if [[ ${TARGET:-} ]]; then
  STEPS=${1:-100}
  H=$($PY -c "from specblock.models import specblock_home; print(specblock_home())")
  FEAT=${FEAT:-$H/features/$TARGET}
  ROOT=$H/runs/$TARGET/ablations${TAG:-}
  mkdir -p "$ROOT"
  train_real() {  # NAME [flags]: one variant, the recipe of real_drafters.sh specblock with a step budget; the
    local name=$1 dir=$ROOT/$1  # extra flags come last, so they override the recipe's (argparse keeps the last)
    shift
    finished "$dir" && return 0
    # shellcheck disable=SC2086
    $PY -m specblock.training drafter --method specblock --target "$TARGET" --features "$FEAT" --draft-vocab 8192 \
        --vocab-corpus 0.5 --run-dir "$dir" --out "$dir/drafter" --layers 2 --shared-norm --intermediate 1024 \
        --lr 1e-3 --warmup 20 --window 257 --batch 4 --max-steps "$STEPS" --max-minutes 100000 --eval-every 50 \
        --ckpt-every 10 --seed "${SEED:-0}" --threads 1 ${FLAGS[$name]:-} ${TRAIN_FLAGS:-} "$@" 2>"$dir.log" \
      || { echo "$name failed: see $dir.log" >&2; return 1; }
  }
  pids=()
  for name in ${VARIANTS:-$ALL}; do
    train_real "$name" & pids+=($!)
    if (( ${#pids[@]} >= ${PARALLEL:-1} )); then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi
  done
  for p in "${pids[@]}"; do wait "$p"; done
  ALSO=()
  if [[ ${RANK_STEPS:-} ]] && finished "$ROOT/full"; then
    # The rank head reads the backbone detached, so it can go on alone; the same data and seed.
    train_real full-rank --init-from "$ROOT/full" --train-only rank-head --max-steps "$RANK_STEPS" \
        --threads "${THREADS:-2}" || exit 1
    ALSO+=(--also "full-rank=$ROOT/full-rank/drafter")
  fi
  [[ ${SKIP_TABLE:-} ]] || $PY experiments/ablation_table.py --target "$TARGET" --features "$FEAT" --root "$ROOT" \
      --windows "${EVAL_WINDOWS:-64}" "${ALSO[@]}" --also "shipped=specblock/assets/drafters/$TARGET/specblock" \
      --threads "${THREADS:-2}" --out "experiments/results/specblock_ablations_smollm2${TAG:-}"
  [[ ${SKIP_BENCH:-} ]] && exit 0
  # Served: each variant at the shipped SpecBlock's serving settings (its serving.json: M = 2, node budget
  # BUDGET, default 3; widths from the rank head, or WIDTHS= for all; the 100-step run's bench_smollm2_ablations.md
  # had BUDGET=2 WIDTHS=4,4,4,4) in packed-fp16, PROMPTS per domain (default 1), medians of 3 interleaved runs:
  # tau and Spd (a quiet machine for Spd). The full drafter also runs with fixed top-4 widths
  # (the paper's "fixed uniform top-k tree"), the serving-side ablation that needs no training.
  M=ar; SETS=()
  for name in $ALL full-rank; do
    finished "$ROOT/$name" || continue
    M+=",specblock@$name"
    SETS+=(--set "specblock@$name:drafter=$ROOT/$name/drafter" --set "specblock@$name:M=2"
           --set "specblock@$name:budget=${BUDGET:-3}" ${WIDTHS:+--set "specblock@$name:widths=$WIDTHS"})
  done
  if finished "$ROOT/full"; then
    M+=",specblock@full-topk4"
    SETS+=(--set "specblock@full-topk4:drafter=$ROOT/full/drafter" --set "specblock@full-topk4:M=2"
           --set "specblock@full-topk4:budget=${BUDGET:-3}" --set "specblock@full-topk4:widths=4,4,4,4")
  fi
  $PY -m specblock.runtime bench --target "$TARGET" --methods "$M" "${SETS[@]}" --dtype packed-fp16 \
      --prompts "${PROMPTS:-1}" --runs 3 --max-new-tokens 48 --threads 2 \
      --out "experiments/results/bench_smollm2_ablations${TAG:-}"
  exit 0
fi

STEPS=${1:-250}
DATA=${DATA:-runs/selfgen/lab_greedy.jsonl}
if [[ ! -f $DATA ]]; then
  $PY -m specblock.training.selfgen --target specblock/assets/target --out "$DATA" --n 768 --batch 32 --threads 1
fi
for name in ${VARIANTS:-$ALL}; do
  dir=runs/ablations/$name
  finished "$dir" && continue
  # shellcheck disable=SC2086
  $PY -m specblock.training drafter --method specblock --target specblock/assets/target --run-dir "$dir" \
      --out "$dir/drafter" --data "$DATA" --max-steps "$STEPS" --max-minutes 100000 --lr 1e-3 \
      --intermediate 1024 --shared-norm --eval-every 125 --seed 0 --threads "${THREADS:-1}" ${FLAGS[$name]} 2>"$dir.log" \
      || { echo "$name failed: see $dir.log" >&2; exit 1; }
done
$PY - <<'PYEOF'
import json
from pathlib import Path
rows = []
for name in ("full", "no-shift", "no-prefix-broadcast", "no-valid-prefix", "no-cross-block"):
    f = Path(f"runs/ablations/{name}/metrics.jsonl")
    fin = [r for r in map(json.loads, f.read_text().splitlines()) if r.get("final")] if f.is_file() else []
    if not fin:
        print(f"{name}: not finished, left out of the table")
        continue
    fin = fin[-1]
    acc = fin["block1_acc"]
    # block1_acc[k] is chain acceptance (positions 1..k+1 all top-1 right, the valid-prefix rule),
    # so their sum is the expected accepted length of block 1's top-1 chain: a tau proxy.
    rows.append({"variant": name, "steps": fin["step"], "train_s": fin["train_s"],
                 "block1_acc": acc, "block2_acc": fin.get("block2_acc"),
                 "rank_acc": fin.get("block1_rank_acc"), "acc_sum_block1": round(sum(acc), 4)})
out = Path("experiments/results/specblock_ablations")
out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
lines = ["| variant | steps | train s | block-1 top-1 acc by position | block-2 acc | rank acc | sum |",
         "|---|---|---|---|---|---|---|"]
for r in rows:
    lines.append(f"| {r['variant']} | {r['steps']} | {r['train_s']:.0f} | {' / '.join(f'{a:.3f}' for a in r['block1_acc'])} | "
                 f"{' / '.join(f'{a:.3f}' for a in r['block2_acc'] or [])} | {r['rank_acc']} | {r['acc_sum_block1']} |")
out.with_suffix(".md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PYEOF
