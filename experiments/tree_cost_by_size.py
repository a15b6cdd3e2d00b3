"""Median verify ms by tree size, from a bench's run-1 traces: how a tree's cost grows with its size
in the decode loop itself (docs/real_model.md's eager-against-compiled comparison uses prompt lookup, whose
trees are 1 node when nothing matches and up to its chain plus one when something does).

    python experiments/tree_cost_by_size.py runs/traces_smollm2_packed/lookup.*.jsonl
    python experiments/tree_cost_by_size.py runs/traces_smollm2_compiled/lookup@c.*.jsonl

Prints size, iterations and median ``verify_s`` in ms for every size met at least ``--min`` times,
and each size's median over the 1-node trees' (the last ``--prompts`` generations of each file,
as ``sim_fidelity.py`` reads them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_fidelity import read_generations  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--prompts", type=int, default=3, help="generations per file the bench ran (its --prompts)")
    ap.add_argument("--min", type=int, default=4, help="fewest iterations a size needs to be shown")
    a = ap.parse_args()
    by: dict[int, list[float]] = {}
    for path in a.traces:
        for line in read_generations(path, a.prompts)[0]:
            r = json.loads(line)
            by.setdefault(int(r["tree_size"]), []).append(1e3 * r["verify_s"])
    one = statistics.median(by[1]) if 1 in by else None
    print("| tree size | iterations | median verify ms | / 1-node |")
    print("|---|---|---|---|")
    for n in sorted(by):
        if len(by[n]) >= a.min:
            m = statistics.median(by[n])
            print(f"| {n} | {len(by[n])} | {m:.2f} | {'-' if one is None else f'{m / one:.2f}x'} |")


if __name__ == "__main__":
    main()
