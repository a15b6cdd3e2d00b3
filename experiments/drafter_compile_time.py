"""What compiling SpecBlock's block forward (part of ``--compile``, ``specblock/compiled/drafter.py``)
adds to a start: the first proposal's time with an empty inductor cache (cold) and with the graph
a previous process saved (warm), against the eager drafter, each in a fresh process beside the
eager target.

    python experiments/drafter_compile_time.py [--target smollm2-135m-instruct] [--dtype packed-fp16]
        [--reps 2] [--out experiments/results/drafter_compile_time]

Why a script: issue 16 asks a first use under 2 minutes and later starts under 10 seconds; this
is the drafter's share of both. The C++ packed-linear kernel is built before timing (once per
machine, ``native_build_time.py``).
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

from specblock.atomic import write_atomic

#: One fresh process per start: what a user's second run meets.
CHILD = r"""
import sys, time
t0 = time.perf_counter()
import torch
from specblock.runtime.config import RunConfig
from specblock.runtime.cli import Session, maybe_compile_drafter
from specblock.runtime import chat
compiled = sys.argv[3] == "1"
torch.set_num_threads(2)
# eager_drafter: the session's own drafter stays eager (a serving.json may name drafter_compiled); compiled here below
s = Session.open(RunConfig(target=sys.argv[1], dtype=sys.argv[2], method="specblock", max_new_tokens=8, eager_drafter=True),
                 None)
if compiled:  # the drafter alone (the target stays eager): its share of a --compile start
    s.engine.drafter = maybe_compile_drafter(s.engine.drafter, s.target)
ids = chat.encode(s.tokenizer, chat.ChatRequest(prompt="Write a function that adds two numbers."))
t1 = time.perf_counter()
s.engine.generate(ids, 8)  # prefill, the first (unpadded) block, then padded compiled blocks
t2 = time.perf_counter()
print(round(t1 - t0, 2), round(t2 - t1, 2))
"""


def start(target: str, dtype: str, compiled: bool, cache: str) -> tuple[float, float]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
    out = subprocess.run([sys.executable, "-c", CHILD, target, dtype, "1" if compiled else "0"], env=env,
                         capture_output=True, text=True, check=True).stdout
    load, first = out.strip().splitlines()[-1].split()
    return float(load), float(first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="packed-fp16")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("experiments/results/drafter_compile_time"))
    a = ap.parse_args()
    from specblock.compiled.native import use_native_kernel

    use_native_kernel()  # built once per machine before anything is timed
    runs: dict[str, list[tuple[float, float]]] = {"eager drafter": [], "compiled, cold": [], "compiled, warm": []}
    for _ in range(a.reps):
        with tempfile.TemporaryDirectory(prefix="drafter_compile_") as cache:
            runs["eager drafter"].append(start(a.target, a.dtype, False, cache))
            runs["compiled, cold"].append(start(a.target, a.dtype, True, cache))
            runs["compiled, warm"].append(start(a.target, a.dtype, True, cache))
    rows = {k: {"load_s": statistics.median(x[0] for x in v), "first_generate_s": statistics.median(x[1] for x in v),
                "runs": v} for k, v in runs.items()}
    md = [f"Fresh processes, {a.target} at {a.dtype}, eager target, 2 threads; medians of {a.reps} (load: imports and "
          "models; first generate: 8 tokens, the drafter's graph compiled or loaded in it).", "",
          "| drafter | load s | first generate s |", "|---|---|---|"]
    md += [f"| {k} | {v['load_s']:.2f} | {v['first_generate_s']:.2f} |" for k, v in rows.items()]
    print("\n".join(md))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(a.out.with_suffix(".json"), json.dumps({"command": " ".join(["python", *sys.argv]), "rows": rows},
                                                        indent=1) + "\n")
    write_atomic(a.out.with_suffix(".md"), "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
