"""What one more tree row costs in the compiled packed-fp16 target's linears alone.

Why: speculation pays only if verifying n tree rows costs little more than one, T(n) / T(1) near 1.
Compiled, the real model's T(4) / T(1) came out near 1.3 (compiled_speed_native.md), enough
to cancel a tau of 1.3-1.5. This times every linear of one forward, exactly as the compiled graph
calls them (the C++ kernel, q/k/v and gate/up stacked as the fusion pass stacks them), at n rows,
interleaved, so the linears' share of that slope can be read beside the measured T(n).

    python experiments/packed_rows.py --target smollm2-135m-instruct --rows 1,2,3,4,6,8 [--threads 2]

Writes experiments/results/packed_rows.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from specblock.atomic import write_atomic
from specblock.compiled.native import use_native_kernel
from specblock.runtime.config import validate
from specblock.runtime.packed import PackedLinear
from specblock.runtime.target import TargetModel

#: Linears that read their parent's one input (Llama-style layers): the pass stacks them.
SHARED_INPUT = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})


def forward_calls(model: torch.nn.Module) -> list[tuple[list[int], int, int]]:
    """One forward's linear calls as the fused graph makes them: (keys, in_features, out_features),
    the siblings that read the same input (q/k/v, gate/up) stacked, every other linear alone."""
    calls = []
    for parent in model.modules():
        shared = [m for n, m in parent.named_children() if n in SHARED_INPUT and isinstance(m, PackedLinear)]
        alone = [m for n, m in parent.named_children() if n not in SHARED_INPUT and isinstance(m, PackedLinear)]
        for ms in ([shared] if shared else []) + [[m] for m in alone]:
            calls.append(([m._key for m in ms], ms[0].in_features, sum(m.out_features for m in ms)))
    return calls


def time_rows(calls, rows: list[int], reps: int) -> dict[int, float]:
    ops = torch.ops.specblock_native
    xs = {(n, fin): torch.randn(n, fin) for n in rows for fin in {c[1] for c in calls}}

    def once(n: int) -> float:
        t0 = time.perf_counter()
        for keys, fin, fout in calls:
            x = xs[(n, fin)]
            if len(keys) == 1:
                ops.packed_linear(x, keys[0], fout)
            else:
                ops.packed_linear_cat(x, keys, fout)
        return time.perf_counter() - t0

    for n in rows:  # warm-up: builds the stacked weights
        once(n)
    ts: dict[int, list[float]] = {n: [] for n in rows}
    for _ in range(reps):
        for n in rows:
            ts[n].append(once(n))
    return {n: round(1e3 * float(np.median(v)), 3) for n, v in ts.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--rows", default="1,2,3,4,6,8")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("experiments/results/packed_rows"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not use_native_kernel():
        raise SystemExit("the C++ packed-linear kernel could not be built here; see the warning above")
    model = TargetModel.load(validate({"target": args.target}).target_dir, "packed-fp16", "cpu").model
    calls = forward_calls(model)
    rows = [int(r) for r in args.rows.split(",")]
    ms = time_rows(calls, rows, args.reps)
    res = {"target": args.target, "threads": args.threads, "calls": len(calls), "ms": ms,
           "ratio": {n: round(v / ms[rows[0]], 3) for n, v in ms.items()}}
    lines = [f"Linears of one forward at n rows, {args.target}, packed-fp16, C++ kernel, stacked as the fusion pass "
             f"stacks them ({len(calls)} calls), {args.threads} threads, median of {args.reps} interleaved repetitions "
             f"(`python experiments/packed_rows.py --target {args.target} --rows {args.rows} --reps {args.reps} "
             f"--threads {args.threads} --out {args.out}`).", "",
             "| n | " + " | ".join(map(str, rows)) + " |", "|---" * (len(rows) + 1) + "|",
             "| linears ms | " + " | ".join(f"{ms[n]:.2f}" for n in rows) + " |",
             f"| / n = {rows[0]} | " + " | ".join(f"{res['ratio'][n]:.2f}x" for n in rows) + " |", ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out.with_suffix(".json"), json.dumps(res, indent=1) + "\n")
    write_atomic(args.out.with_suffix(".md"), "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
