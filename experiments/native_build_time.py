"""Wall time of building the C++ packed-linear extension (``specblock/compiled/native.py``), with and
without ``load_inline``'s implicit ``#include <torch/extension.h>``, each in a fresh build folder.

    python experiments/native_build_time.py [--reps 1] [--out experiments/results/native_build_time.json]

Why a script: a fresh machine pays this once, on top of the first compile (issue 16's "first use
under 2 minutes"), and the header choice is most of it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

#: One fresh process per build: an extension loaded once cannot be loaded again under its name.
CHILD = r"""
import sys, time, torch
from torch.utils.cpp_extension import load_inline
from specblock.compiled.native import SOURCE
implicit, where = sys.argv[1] == "1", sys.argv[2]
t = time.perf_counter()
load_inline("specblock_native_probe", cpp_sources=[SOURCE], is_python_module=False, build_directory=where,
            extra_cflags=["-O2"], verbose=False, no_implicit_headers=not implicit)
took = time.perf_counter() - t
assert torch.ops.specblock_native.size() == (0, 0)
print(took)
"""


def build_s(implicit: bool) -> float:
    with tempfile.TemporaryDirectory(prefix="native_build_") as where:
        out = subprocess.run([sys.executable, "-c", CHILD, "1" if implicit else "0", where],
                             capture_output=True, text=True, check=True).stdout
    return float(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("experiments/results/native_build_time.json"))
    args = ap.parse_args()
    runs: dict[str, list[float]] = {"only the headers it uses (shipped)": [], "with torch/extension.h": []}
    for _ in range(args.reps):  # interleaved, so a busy spell hits both
        runs["only the headers it uses (shipped)"].append(build_s(implicit=False))
        runs["with torch/extension.h"].append(build_s(implicit=True))
    res = {k: {"median_s": round(statistics.median(v), 1), "runs_s": [round(x, 1) for x in v]} for k, v in runs.items()}
    for k, v in res.items():
        print(f"{k}: {v['median_s']} s (runs {v['runs_s']})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": " ".join(["python", *sys.argv]), "builds": res}, indent=1) + "\n")


if __name__ == "__main__":
    main()
