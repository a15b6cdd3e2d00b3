"""Record a target's fastest method from its main bench table, for ``--method auto``.

The highest mean Spd over the bench's domains among the methods the CLI can run by name (no
``@`` variants, no HF peers), written as ``best.json`` beside the target's shipped drafters:

    python experiments/best_method.py experiments/results/bench_smollm2_main.json \
        --write specblock/assets/drafters/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from specblock.atomic import write_atomic
from specblock.runtime.drafters import METHODS


def fastest(bench: dict) -> tuple[str, dict[str, float]]:
    spd: dict[str, list[float]] = defaultdict(list)
    for r in bench["rows"]:
        if r["method"] in METHODS:
            spd[r["method"]].append(r["speedup"])
    means = {m: float(np.mean(v)) for m, v in spd.items()}
    return max(means, key=means.get), means


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench", type=Path, help="a main-table bench JSON")
    ap.add_argument("--write", type=Path, required=True, metavar="DRAFTERS_DIR")
    args = ap.parse_args(argv)
    bench = json.loads(args.bench.read_text())
    best, means = fastest(bench)
    rec = {"method": best, "mean_speedup": round(means[best], 3), "dtype": bench["config"]["dtype"],
           "measured": f"{args.bench.with_suffix('.md').as_posix()}: the highest mean Spd of "
                       + ", ".join(f"{m} {v:.2f}x" for m, v in sorted(means.items(), key=lambda kv: -kv[1]))}
    write_atomic(args.write / "best.json", json.dumps(rec, indent=1) + "\n")
    print(json.dumps(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
