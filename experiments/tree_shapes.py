"""What trees a bench actually verified, per method, from its traces (``bench --trace-dir``).

Why: a method's budget caps its tree, but the policy decides what fills it. For SpecBlock the
question is how often the paper's later blocks add nodes at the served budget, and how often the
rank head ends the only branch at once (a root-only tree: the propose was paid, nothing drafted).
Per method (all domains of the traced run): iterations, the share whose tree holds a node of a
later drafter forward (``block >= 1``: SpecBlock's later block iterations, EAGLE-3's depth steps
after the first, whose index it logs there), the share of root-only trees, the mean tree size
(root included) and the tree sizes seen.

    python experiments/tree_shapes.py runs/traces_smollm2_s52 --methods specblock,specblock+lookup \
        --out experiments/results/tree_shapes_s52
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))  # results_io beside it, however it is loaded

from results_io import write_results  # noqa: E402


def shapes(files: list[Path]) -> dict:
    n = later = alone = 0
    sizes: Counter[int] = Counter()
    for f in files:
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            n += 1
            later += any(b >= 1 for b in rec["nodes"]["block"])
            alone += rec["tree_size"] == 1
            sizes[rec["tree_size"]] += 1
    mean = sum(k * v for k, v in sizes.items()) / max(n, 1)
    return {"iterations": n, "later_block_share": later / max(n, 1), "root_only_share": alone / max(n, 1),
            "mean_tree_size": mean, "sizes": dict(sorted(sizes.items()))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", help="a bench's --trace-dir (METHOD.DOMAIN.jsonl files)")
    ap.add_argument("--methods", default="specblock,specblock+lookup")
    ap.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "tree_shapes")
    args = ap.parse_args(argv)
    rows, lines = [], [f"Trees verified per method, from the traces in `{args.traces}` (all domains; root included).", "",
                       "| method | iterations | with a later forward's node | root only | mean size | sizes (count) |",
                       "|---|---|---|---|---|---|"]
    for m in args.methods.split(","):
        files = sorted(Path(args.traces).glob(f"{m}.*.jsonl"))
        if not files:
            print(f"error: no traces of {m} in {args.traces}", file=sys.stderr)
            return 2
        r = {"method": m, **shapes(files)}
        rows.append(r)
        sizes = ", ".join(f"{k}: {v}" for k, v in r["sizes"].items())
        lines.append(f"| {m} | {r['iterations']} | {r['later_block_share']:.1%} | {r['root_only_share']:.1%} | "
                     f"{r['mean_tree_size']:.2f} | {sizes} |")
    write_results(args.out, args, rows, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
