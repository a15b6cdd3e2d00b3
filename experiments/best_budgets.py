"""Pick each tree method's best node budget from a budget-sweep bench, as ``--set`` arguments.

The sweep names its variants ``METHOD@bN`` with ``--set METHOD@bN:budget=N`` (see
``experiments/lab_pipeline.sh measure``); the best N per METHOD is the one with the highest mean
Spd over the bench's domains (decode-loop Spd when the bench has it: prefill does not depend on
the budget). Prints ``--set METHOD:budget=N`` per method on one line, for the main bench, and the
table behind the choice on stderr.

    python experiments/best_budgets.py experiments/results/bench_budgets.json [--alias NEW=METHOD ...]

``--alias specblock+adapt=specblock`` also prints ``--set specblock+adapt:budget=N`` with
specblock's best N: a variant that was not swept runs at its family's budget.
"""

from __future__ import annotations

import argparse
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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench", type=Path, help="a bench JSON with METHOD@bN variants")
    ap.add_argument("--alias", action="append", default=[], metavar="NEW=METHOD")
    args = ap.parse_args(argv)
    if not args.bench.is_file():
        print(f"error: no bench JSON at {args.bench}", file=sys.stderr)
        return 2
    best, means = best_budgets(json.loads(args.bench.read_text()))
    if not best:
        print(f"error: no METHOD@bN rows in {args.bench}", file=sys.stderr)
        return 2
    for item in args.alias:
        new, _, fam = item.partition("=")
        if fam not in best:
            print(f"error: --alias {item}: {fam!r} was not swept", file=sys.stderr)
            return 2
        best[new] = best[fam]
    for k, d in means.items():
        print(f"{k}: " + ", ".join(f"b{b} {v:.3f}x" for b, v in d.items()) + f" -> {best[k]}", file=sys.stderr)
    print(" ".join(f"--set {k}:budget={b}" for k, b in best.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
