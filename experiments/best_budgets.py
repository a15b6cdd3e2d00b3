"""Pick each tree method's best node budget from a budget-sweep bench, as ``--set`` arguments.

The sweep names its variants ``METHOD@bN`` with ``--set METHOD@bN:budget=N`` (see
``experiments/lab_pipeline.sh measure``); the best N per METHOD is the one with the highest mean
Spd over the bench's domains (decode-loop Spd when the bench has it: prefill does not depend on
the budget). Prints ``--set METHOD:budget=N`` per method on one line, for the main bench, and the
table behind the choice on stderr.

    python experiments/best_budgets.py experiments/results/bench_budgets.json
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np


def best_budgets(bench: dict) -> tuple[dict[str, int], dict[str, dict[int, float]]]:
    spd: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in bench["rows"]:
        m = re.fullmatch(r"(.+)@b(\d+)", r["method"])
        if m:
            v = r.get("speedup_decode") or r["speedup"]
            spd[m.group(1)][int(m.group(2))].append(v)
    means = {k: {b: float(np.mean(v)) for b, v in sorted(d.items())} for k, d in spd.items()}
    return {k: max(d, key=d.get) for k, d in means.items()}, means


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_file():
        print("usage: best_budgets.py BENCH.json (a bench with METHOD@bN variants)", file=sys.stderr)
        return 2
    best, means = best_budgets(json.loads(Path(argv[0]).read_text()))
    if not best:
        print(f"error: no METHOD@bN rows in {argv[0]}", file=sys.stderr)
        return 2
    for k, d in means.items():
        print(f"{k}: " + ", ".join(f"b{b} {v:.3f}x" for b, v in d.items()) + f" -> {best[k]}", file=sys.stderr)
    print(" ".join(f"--set {k}:budget={b}" for k, b in best.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
