"""Where a compiled tree bucket's first compile goes (issue 16's first start): dynamo's own phase
times and each C++ build inductor runs, for one bucket of the real model on an empty inductor cache.

    python experiments/bucket_compile_parts.py --bucket 4 --out experiments/results/bucket_compile_parts_s64

The builds are timed by wrapping inductor's ``cpp_builder._run_compile_cmd`` (torch is pinned);
precompiled headers go where ``use_disk_cache`` puts them (under ``$SPECBLOCK_HOME``), so run it
on an empty home to see them built too. Inductor's vector-ISA check builds at load, before the
compile (``use_disk_cache``): listed apart, outside the total.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_io import write_results  # noqa: E402


def what(cmd: str) -> str:
    """A build's kind from its command line: the wrapper, the kernels, a header, an ISA test."""
    if "c++-header" in cmd:
        return "precompiled header"
    if ".main.cpp" in cmd:
        return "C++ wrapper (" + next(f for f in cmd.split() if re.fullmatch(r"-O\d|-Os", f)) + ")"
    if ".optimized.cpp" in cmd:
        return "kernels (-O3)"
    if "header.hpp" in cmd:
        return "header preprocessing"
    if ".main.o" in cmd:
        return "link"
    return "vector-ISA test build"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="packed-fp16")
    ap.add_argument("--bucket", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("experiments/results/bucket_compile_parts"))
    args = ap.parse_args()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bucket_parts_")
    import torch._inductor.cpp_builder as cb
    from torch._dynamo.utils import compile_times

    from specblock.compiled import compile_target
    from specblock.models.registry import resolve_target
    from specblock.policies.tree import DraftTree
    from specblock.runtime.target import TargetModel

    builds: list[tuple[str, float, bool]] = []  # (kind, seconds, inside the bucket's compile)
    run = cb._run_compile_cmd
    t0: float | None = None

    def timed(cmd_line: str, cwd: str) -> None:
        t = time.perf_counter()
        run(cmd_line, cwd)
        builds.append((what(cmd_line), time.perf_counter() - t, t0 is not None))

    cb._run_compile_cmd = timed
    torch.set_num_threads(args.threads)
    target = compile_target(TargetModel.load(resolve_target(args.target), args.dtype, "cpu"))
    target.want_features, target.tap_layers = True, (2, 15, 27)  # as a server of the shipped drafters runs
    target.prefill(np.zeros(1, dtype=np.int64))
    t0 = time.perf_counter()
    b = args.bucket
    target.tree_forward(DraftTree.from_parents(np.zeros(b, dtype=np.int64), np.arange(-1, b - 1)))
    total = time.perf_counter() - t0
    names, values = compile_times(repr="csv", aggregate=True)
    phases = dict(zip(names, values))
    keep = ("bytecode_tracing", "create_aot_dispatcher_function", "GraphLowering.codegen",
            "PyCodeCache.load_by_key_path", "compile_file")
    rows = [{"part": k, "s": round(float(phases[k]), 2)} for k in keep if k in phases]
    kinds: dict[str, list[float]] = {}
    for kind, s, inside in builds:  # builds at load (compile_target's vector-ISA check) are not in the total
        kinds.setdefault(f"g++: {kind}" + ("" if inside else " (at load, before the compile)"), []).append(s)
    rows += [{"part": f"{k} x{len(v)}", "s": round(sum(v), 2)} for k, v in kinds.items()]
    cmd = f"python experiments/bucket_compile_parts.py --bucket {b} --out {args.out}"
    lines = [f"The first compile of bucket {b}, {args.target} at {args.dtype}, {args.threads} threads, on an empty "
             f"inductor cache (`{cmd}`): {total:.1f} s in all. Dynamo's phase times (`compile_times`, nested: "
             "inductor's parts are inside AOT's) and inductor's C++ builds, summed by kind; builds marked at load ran "
             "before the compile and are not in its total.", "",
             "| part | s |", "|---|---|"] + [f"| {r['part']} | {r['s']} |" for r in rows]
    write_results(args.out, args, [{"part": "total", "s": round(total, 2)}] + rows, lines)


if __name__ == "__main__":
    main()
