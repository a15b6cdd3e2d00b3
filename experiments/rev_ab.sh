#!/usr/bin/env bash
# One bench at two revisions, alternating (base, now, base, now, ...): for a change one process cannot switch (a C++
# kernel), on a machine whose speed drifts between runs. The base runs from a git worktree at $BASE (its own
# sources, its own kernel build), "now" from this checkout; each run's Spd is against plain decoding in that run.
# Writes experiments/results/${NAME}_{base,now}_{1..REPS}.* and prints each method's mean Spd per run.
#   BASE=fa62903 NAME=rev_ab_pad_s70 REPS=2 bash experiments/rev_ab.sh --methods ar,specblock --prompts 2 ...
# SUB=calibrate runs the simulator's calibration instead of the bench (the target's forward at each tree size)
# and prints T(n) per run at the first context length.
set -euo pipefail
: "${BASE:?set BASE to the git revision to compare against}" "${NAME:?set NAME for the result files}"
ROOT=$(pwd)
PY=${PY:-$ROOT/.venv/bin/python}
SPECBLOCK_DATA=${SPECBLOCK_DATA:-$("$PY" -c "from specblock.data import data_root; print(data_root())")}
export SPECBLOCK_DATA  # the worktree's own default (beside it) would not hold the data
WT=$(mktemp -d "${TMPDIR:-/tmp}/specblock-base-XXXXXX")
git worktree add -q --detach "$WT" "$BASE"
trap 'git worktree remove --force "$WT"' EXIT
for i in $(seq 1 "${REPS:-2}"); do
  for side in base now; do
    dir=$ROOT; [ "$side" = base ] && dir=$WT
    out=$ROOT/experiments/results/${NAME}_${side}_$i; [ "${SUB:-bench}" = calibrate ] && out=$out.json
    (cd "$dir" && "$PY" -m specblock.runtime "${SUB:-bench}" "$@" --out "$out") > /dev/null
  done
done
"$PY" - "$ROOT/experiments/results/$NAME" "${REPS:-2}" <<'PY'
import json, statistics, sys
stem, reps = sys.argv[1], int(sys.argv[2])
runs = {f"{side}_{i}": json.load(open(f"{stem}_{side}_{i}.json")) for i in range(1, reps + 1) for side in ("base", "now")}
if "target" in next(iter(runs.values())):  # calibrate: T(n) at the first context length, ms
    ns = next(iter(runs.values()))["target"]["n"]
    print("| n | " + " | ".join(runs) + " |\n" + "|---" * (len(runs) + 1) + "|")
    for j, n in enumerate(ns):
        print(f"| {n} | " + " | ".join(f"{res['target']['ms'][0][j]:.2f}" for res in runs.values()) + " |")
    sys.exit()
methods = list(dict.fromkeys(r["method"] for r in next(iter(runs.values()))["rows"]))
print("| method | " + " | ".join(runs) + " |\n|---" * 1 + "|---" * len(runs) + "|")
for m in methods:
    cells = [statistics.mean(r["speedup"] for r in res["rows"] if r["method"] == m) for res in runs.values()]
    print(f"| {m} | " + " | ".join(f"{c:.3f}x" for c in cells) + " |")
PY
