"""Does dropping dynamo guards make a later start load a saved graph faster? (issue 16's starts)

A later start spends seconds on the first call of each saved graph it loads, and a saved graph of
the real model carries about 8.8k guards, most of them on modules. This times that first call
(bucket 1 of the compiled target, a fresh process each time, interleaved) with the default guards
and with ``hooks_free``: the guards that a module has no hooks and no instance attribute shadowing
its class dropped (about 40% of a graph's guards; those on tensors, types and constants, such as
the key a packed linear finds its weights by, kept). Dropping every module guard
(``torch.compiler.skip_guard_on_all_nn_modules_unsafe``) is not an option here: two packed models
of one architecture would share a saved graph, and the first one's weights.

Each mode's first process compiles and saves its graph (a tag of its own); the medians are over
the later ones, which load it.

    python experiments/guard_filter_load.py --runs 3 --out experiments/results/guard_filter_load
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

DROPPED = ("EMPTY_NN_MODULE_HOOKS_DICT", "NOT_PRESENT_IN_GENERIC_DICT")


def hooks_free(entries: list) -> list[bool]:
    """Keep every guard but the non-global ones of the ``DROPPED`` types."""
    return [not (e.guard_type in DROPPED and not e.is_global) for e in entries]


def child(mode: str) -> None:
    import numpy as np
    import torch

    import specblock.compiled.precompile as precompile
    import specblock.compiled.target as target
    from specblock.models.registry import resolve_target
    from specblock.policies.tree import DraftTree
    from specblock.runtime.target import TargetModel

    torch.set_num_threads(2)
    if mode == "hooks_free":
        target.CPU_OPTIONS = {**target.CPU_OPTIONS, "guard_filter_fn": hooks_free}
        tag = precompile.tag  # the filter by name in the tag: its repr holds an address, new in every process
        precompile.tag = lambda model, opts: tag(model, {**opts, "guard_filter_fn": "hooks_free"})
    t = target.StaticTarget.wrap(TargetModel.load(resolve_target("smollm2-135m-instruct"), "packed-fp16", "auto"))
    t.prefill(np.arange(100) % 1000)
    t0 = time.perf_counter()
    t.tree_forward(DraftTree.from_parents(np.array([5]), np.array([-1])))
    print(json.dumps({"mode": mode, "first_call_s": round(time.perf_counter() - t0, 3)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="loading processes per mode, after one that may compile")
    ap.add_argument("--out", type=Path, default=Path("experiments/results/guard_filter_load"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.child)
    modes = ("default", "hooks_free")
    times: dict[str, list[float]] = {m: [] for m in modes}
    first: dict[str, float] = {}
    for r in range(a.runs + 1):
        for m in modes:
            out = subprocess.run([sys.executable, __file__, "--child", m], capture_output=True, text=True, check=True)
            s = json.loads(out.stdout.strip().splitlines()[-1])["first_call_s"]
            (first.__setitem__(m, s) if r == 0 else times[m].append(s))
            print(m, s, flush=True)
    med = {m: round(statistics.median(v), 2) for m, v in times.items()}
    lines = [f"First call of the real model's saved bucket-1 graph in a fresh process, s (`python "
             f"experiments/guard_filter_load.py --runs {a.runs} --out {a.out}`; the first process of each mode "
             f"may compile: {first}):", "", "| guards | loads | median |", "|---|---|---|"]
    lines += [f"| {m} | {', '.join(map(str, times[m]))} | {med[m]} |" for m in modes]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    a.out.with_suffix(".json").write_text(json.dumps({"first": first, "loads": times, "median": med}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
