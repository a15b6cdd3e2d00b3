"""What trees a bench actually verified, per method, from its traces (``bench --trace-dir``).

Why: a method's budget caps its tree, but the policy decides what fills it. For SpecBlock the
question is how often the paper's later blocks add nodes at the served budget, and how often the
rank head ends the only branch at once (a root-only tree: the propose was paid, nothing drafted).
Per method (all domains of the traced run): iterations, the share whose tree holds a node of a
later drafter forward (``block >= 1``: SpecBlock's later block iterations, EAGLE-3's depth steps
after the first, whose index it logs there), the share of root-only trees, the mean tree size
(root included) and the tree sizes seen; where the traces log the rank head's bucket per drafted
position (SpecBlock), how often it predicted each of b0..b3 and how often the target's token truly
sat in each (its rank among the position's candidates; past the top-k counts as b3).

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
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))  # results_io beside it, however it is loaded

from results_io import write_results  # noqa: E402
from specblock.policies.tree import rank_to_bucket  # noqa: E402


def true_bucket(rank: int) -> int:
    """The target's 0-based rank among a position's candidates (-1: not among them, so past them) -> b0..b3."""
    return 3 if rank < 0 else int(rank_to_bucket(rank))


def shapes(files: list[Path]) -> dict:
    n = later = alone = 0
    sizes: Counter[int] = Counter()
    predicted: Counter[int] = Counter()
    truth: Counter[int] = Counter()
    for f in files:
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            n += 1
            later += any(b >= 1 for b in rec["nodes"]["block"])
            alone += rec["tree_size"] == 1
            sizes[rec["tree_size"]] += 1
            pos = rec.get("positions") or {}
            for b, r in zip(pos.get("bucket", []), pos.get("target_rank", [])):
                predicted[b] += 1
                truth[true_bucket(r)] += 1
    mean = sum(k * v for k, v in sizes.items()) / max(n, 1)
    return {"iterations": n, "later_block_share": later / max(n, 1), "root_only_share": alone / max(n, 1),
            "mean_tree_size": mean, "sizes": dict(sorted(sizes.items())),
            "buckets_predicted": [predicted[b] for b in range(4)], "buckets_true": [truth[b] for b in range(4)]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", help="a bench's --trace-dir (METHOD.DOMAIN.jsonl files)")
    ap.add_argument("--methods", default="specblock,specblock+lookup")
    ap.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "tree_shapes")
    args = ap.parse_args(argv)
    rows, lines = [], [f"Trees verified per method, from the traces in `{args.traces}` (all domains; root included).", "",
                       "| method | iterations | with a later forward's node | root only | mean size | sizes (count) "
                       "| rank head's b0 / b1 / b2 / b3 | true b0 / b1 / b2 / b3 |",
                       "|---|---|---|---|---|---|---|---|"]
    for m in args.methods.split(","):
        files = sorted(Path(args.traces).glob(f"{m}.*.jsonl"))
        if not files:
            print(f"error: no traces of {m} in {args.traces}", file=sys.stderr)
            return 2
        r = {"method": m, **shapes(files)}
        rows.append(r)
        sizes = ", ".join(f"{k}: {v}" for k, v in r["sizes"].items())
        pred, true = (" / ".join(map(str, r[k])) if sum(r[k]) else "-" for k in ("buckets_predicted", "buckets_true"))
        lines.append(f"| {m} | {r['iterations']} | {r['later_block_share']:.1%} | {r['root_only_share']:.1%} | "
                     f"{r['mean_tree_size']:.2f} | {sizes} | {pred} | {true} |")
    write_results(args.out, args, rows, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
