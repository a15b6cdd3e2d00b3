#!/usr/bin/env bash
# Trained ablations of the SpecBlock drafter (issue 4), each with the same budget: the same
# selfgen data, seed, fresh init, number of steps and the shipped recipe (--shared-norm); the LR
# schedule follows steps (the minute cap is set out of reach), then held-out per-position
# acceptance from each run's final eval.
# Acceptance is not a timing, so the figures hold on a busy machine; only the wall time does not.
#
#   bash experiments/specblock_ablations.sh [STEPS]        # default 250 steps per variant
#   VARIANTS="no-cross-block" THREADS=1 bash experiments/specblock_ablations.sh   # some only
#
# Resumable: a variant whose run already ended (a "final" line in its metrics) is skipped, and
# an interrupted one resumes from its checkpoint. Writes experiments/results/specblock_ablations.{json,md}.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
STEPS=${1:-250}
DATA=${DATA:-runs/selfgen/lab_greedy.jsonl}
if [[ ! -f $DATA ]]; then
  $PY -m specblock.training.selfgen --target specblock/assets/target --out "$DATA" --n 768 --batch 32 --threads 1
fi
declare -A FLAGS=([full]="" [no-shift]="--no-shift" [no-prefix-broadcast]="--no-prefix-broadcast"
                  [no-valid-prefix]="--no-valid-prefix" [no-cross-block]="--no-cross-block")
for name in ${VARIANTS:-full no-shift no-prefix-broadcast no-valid-prefix no-cross-block}; do
  dir=runs/ablations/$name
  if [[ -f $dir/metrics.jsonl ]] && grep -q '"final": true' "$dir/metrics.jsonl"; then continue; fi
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
