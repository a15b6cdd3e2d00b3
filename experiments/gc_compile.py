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
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

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
    times: dict[str, list[float]] = {"default": [], "raised": []}
    for _ in range(args.runs):
        for mode in times:
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
                p = subprocess.run([sys.executable, "-c", CHILD, mode, str(args.bucket)], env=env, capture_output=True,
                                   text=True, check=True)
            times[mode].append(round(json.loads(p.stdout.strip().splitlines()[-1])["compile_s"], 2))
            print(mode, times[mode][-1], flush=True)
    cmd = f"python experiments/gc_compile.py --runs {args.runs} --bucket {args.bucket} --out {args.out}"
    lines = [f"Cold compile of the real model's {args.bucket}-node bucket (packed-fp16), fresh processes with an empty "
             f"inductor cache, interleaved (`{cmd}`):", "", "| collector | compile s | median |", "|---|---|---|"]
    for mode, ts in times.items():
        lines.append(f"| {mode} | {', '.join(map(str, ts))} | {statistics.median(ts):.2f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"command": cmd, "compile_s": times}, indent=1))
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
