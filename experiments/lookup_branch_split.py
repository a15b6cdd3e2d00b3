"""Does the sim's model of the lookup branch hold on real traces? (``specblock/sim/lookup.py``)

The sim splits each ``METHOD+lookup`` iteration into the drafter's tree (``drafter_part``) and
lookup's chain (``chain_of``: its length and right prefix), accepts the longer of the two, and
draws the two parts independently. This reads a bench's ``*+lookup*.jsonl`` traces and reports,
per file:

* ``split == logged``: records whose accepted length, recomputed as ``max(drafter's, chain's)``,
  equals the logged one (the split loses nothing if all do);
* mean tau as logged, and with the parts paired at random: over all records, and within records
  whose chain took the same number of nodes (the drafter then had the same budget, as in the sim,
  which drafts at the budget the chain leaves). The gap is what the independence costs;
* median drafting ms of iterations where the drafter proposed nodes and where lookup's chain left
  it none (a budget no larger than the chain): whether a drafter with nothing to draft still pays
  for its first forward (it does; ``LookupBranchModel._drafted``).

    python experiments/lookup_branch_split.py runs/traces_smollm2_packed [--out experiments/results/lookup_branch_split]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from specblock.sim.lookup import Chains, drafter_part
from specblock.sim.traces import read_traces


def split(path: Path) -> dict:
    recs = read_traces(path)
    chains = Chains.from_records(recs)
    parts = [drafter_part(r) for r in recs]
    own = np.array([p.accepted for p in parts])
    logged = np.array([r.accepted for r in recs])
    draft_ms = np.array([1e3 * r.draft_s for r in recs])
    none = np.array([p.tree_size == 1 for p in parts])
    size, right = chains.size, chains.correct
    paired = float(np.maximum(own[:, None], right[None, :]).mean())
    by_size = []  # within one chain size: the drafter drafted at one budget
    for s in np.unique(size):
        at = size == s
        by_size.append(at.sum() * np.maximum(own[at][:, None], right[at][None, :]).mean())
    return {"file": path.name, "records": len(recs), "split_equals_logged": int((np.maximum(own, right) == logged).sum()),
            "tau_logged": round(1 + float(logged.mean()), 4), "tau_paired": round(1 + paired, 4),
            "tau_paired_same_size": round(1 + float(sum(by_size)) / len(recs), 4),
            "chain_share": round(float((size > 0).mean()), 3), "drafter_accepted": round(float(own.mean()), 4),
            "chain_right": round(float(right.mean()), 4),
            "draft_ms_drafted": round(float(np.median(draft_ms[~none])), 3) if (~none).any() else None,
            "draft_ms_no_node": round(float(np.median(draft_ms[none])), 3) if none.any() else None,
            "no_node_records": int(none.sum())}


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def markdown(rows: list[dict], cmd: str) -> str:
    out = [f"`{cmd}`", "",
           "| traces | records | split == logged | tau logged | paired at random | same chain size | chain share | "
           "draft ms: drafted / no node left (records) |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        err = lambda k: f"{r[k]:.3f} ({r[k] / r['tau_logged'] - 1:+.1%})"
        out.append(f"| {r['file']} | {r['records']} | {r['split_equals_logged']} | {r['tau_logged']:.3f} | "
                   f"{err('tau_paired')} | {err('tau_paired_same_size')} | {r['chain_share']:.2f} | "
                   f"{_ms(r['draft_ms_drafted'])} / {_ms(r['draft_ms_no_node'])} ({r['no_node_records']}) |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", type=Path, help="a bench's --trace-dir")
    ap.add_argument("--out", type=Path, default=None, help="also write OUT.json and OUT.md")
    a = ap.parse_args(argv)
    files = sorted(a.traces.glob("*+lookup*.jsonl"))
    if not files:
        print(f"error: no *+lookup*.jsonl traces in {a.traces}", file=sys.stderr)
        return 2
    rows = [split(f) for f in files]
    cmd = "python experiments/lookup_branch_split.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = markdown(rows, cmd)
    print(text, end="")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.with_suffix(".json").write_text(json.dumps({"command": cmd, "rows": rows}, indent=1))
        a.out.with_suffix(".md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
