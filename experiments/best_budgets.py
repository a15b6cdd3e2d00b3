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
    ap.add_argument("--write-serving", type=Path, default=None, metavar="DRAFTERS_DIR",
                    help="also write each swept drafter's serving.json there (DIR/METHOD/serving.json): its best "
                         "budget, or a swept variant's settings where it won (specblock@m1@bN: M = 1, "
                         "specblock@topk4@bN: fixed top-4 widths)")
    args = ap.parse_args(argv)
    if not args.bench.is_file():
        print(f"error: no bench JSON at {args.bench}", file=sys.stderr)
        return 2
    bench = json.loads(args.bench.read_text())
    best, means = best_budgets(bench)
    if not best:
        print(f"error: no METHOD@bN rows in {args.bench}", file=sys.stderr)
        return 2
    aliases = set()
    for item in args.alias:
        new, _, fam = item.partition("=")
        aliases.add(new)
        if fam not in best:
            print(f"error: --alias {item}: {fam!r} was not swept", file=sys.stderr)
            return 2
        best[new] = best[fam]
    for k, d in means.items():
        print(f"{k}: " + ", ".join(f"b{b} {v:.3f}x" for b, v in d.items()) + f" -> {best[k]}", file=sys.stderr)
    # swept variants (METHOD@NAME) are settings of METHOD, not methods of the main bench: only
    # methods and aliases get a --set line
    print(" ".join(f"--set {k}:budget={b}" for k, b in best.items() if "@" not in k or k in aliases))
    if args.write_serving is not None:
        write_serving(args.write_serving, best, means, args.bench, bench.get("config", {}).get("method_options"))
    return 0


#: Swept variants of a drafter's serving settings (``METHOD@NAME@bN``): what each sets.
VARIANTS = {"m1": {"M": 1}, "topk4": {"widths": [4, 4, 4, 4]},
            "ea": {"policy": "specblock.policies.expected:ExpectedAcceptanceBranching"}}


def write_serving(drafters: Path, best: dict[str, int], means: dict[str, dict[int, float]], bench: Path,
                  options: dict | None = None) -> None:
    """serving.json beside each shipped drafter that was swept (the engine reads it when no flag is
    given): its best budget, or a swept variant's settings and budget where that variant did better.
    A variant's settings are what the sweep ran it with (``options``: the bench's per-method
    options), else :data:`VARIANTS`."""
    from specblock.atomic import write_atomic

    options = options or {}

    for method in sorted(m for m in means if "@" not in m and (drafters / m).is_dir()):
        cfg: dict = {"budget": best[method]}
        top = means[method][best[method]]
        where = f"{bench.with_suffix('.md').as_posix()}: the best mean Spd of node budgets {'/'.join(map(str, means[method]))}"
        tried = [v for v in VARIANTS if f"{method}@{v}" in means]
        for v in tried:
            d = means[f"{method}@{v}"]
            if max(d.values()) > top:
                b = best[f"{method}@{v}"]
                ran = {k: x for k, x in options.get(f"{method}@{v}@b{b}", {}).items() if k != "budget"}
                top, cfg = max(d.values()), {"budget": b, **(ran or VARIANTS[v])}
        if tried:
            where += " and of " + ", ".join(f"{v} ({VARIANTS[v]})" for v in tried)
        cfg["measured"] = where
        path = drafters / method / "serving.json"
        old = json.loads(path.read_text()) if path.is_file() else {}
        if isinstance(old, dict) and old.get("overrides"):  # settings measured on other targets stay
            cfg["overrides"] = old["overrides"]
        write_atomic(path, json.dumps(cfg, indent=1) + "\n")
        print(f"wrote {drafters / method / 'serving.json'}: {cfg}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
