"""A cold compile of one tree bucket of the real model's compiled target, with the garbage collector
at its default thresholds and at ``specblock/gcstart.py``'s, interleaved, each in a fresh process
with an empty inductor cache (the C++ libraries already built): what the raised thresholds are
worth to a first start's compiles (the server's share and each warm helper's).

    python experiments/gc_compile.py --runs 2 --bucket 5 --out experiments/results/gc_compile
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from results_io import interleaved, timing_table, write_results

CHILD = r"""
import gc, json, sys, time
if sys.argv[1] == "raised":
    from specblock import gcstart
    gcstart.begin()
import torch
from specblock.compiled import compile_target
from specblock.models.registry import resolve_target
from specblock.runtime.target import TargetModel
torch.set_num_threads(2)
target = compile_target(TargetModel.load(resolve_target("smollm2-135m-instruct"), "packed-fp16", "cpu"))
t0 = time.perf_counter()
target._warm_bucket(int(sys.argv[2]))
print(json.dumps({"compile_s": time.perf_counter() - t0}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--bucket", type=int, default=5, help="a tree size no default server warms")
    ap.add_argument("--out", type=Path, default=Path("experiments/results/gc_compile"))
    args = ap.parse_args()
    def one(mode: str) -> float:
        with tempfile.TemporaryDirectory() as cache:
            p = subprocess.run([sys.executable, "-c", CHILD, mode, str(args.bucket)], capture_output=True, text=True,
                               check=True, env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache})
        return json.loads(p.stdout.strip().splitlines()[-1])["compile_s"]

    times = interleaved(["default", "raised"], args.runs, one)
    cmd = f"python experiments/gc_compile.py --runs {args.runs} --bucket {args.bucket} --out {args.out}"
    table, rows = timing_table(times, "compile s", "collector", key="compile_s")
    lines = [f"Cold compile of the real model's {args.bucket}-node bucket (packed-fp16), fresh processes with an empty "
             f"inductor cache, interleaved (`{cmd}`):", "", *table]
    write_results(args.out, args, rows, lines)


if __name__ == "__main__":
    main()
