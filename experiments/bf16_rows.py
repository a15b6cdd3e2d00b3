"""What a call's rows cost packed-q4's fp32 kernel and packed-q4-amx's kernel (AMX tiles where the CPU
has them, AVX512-BF16 dot products elsewhere), with every weight streamed from memory as in a forward:
the real model's 210 decoder linears (q, k, v, o, gate, up, down x 30 layers, separate weights, so
nothing stays in cache between passes) and its Q8_0 head, eager calls, one pass over all of them timed.

Why: tree verification pays each extra row in the linears; this says how much per row, per kernel,
on this CPU, and where the kernel meets its arithmetic floor (``--floor``: the multiply-add
instructions one row needs, for reading against the slope).

    python experiments/bf16_rows.py --rows 1,2,4,8,16 --reps 15 --threads 2 --out experiments/results/bf16_rows

``--baseline-rev REV`` adds packed-q4-amx's kernel as committed at REV (built from git), interleaved with
today's, and checks that both give the same bits for every call.

Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments.q4_rows import SHAPES, median_ms  # noqa: E402
from experiments.target_speed import cpu_model  # noqa: E402
from specblock.atomic import write_atomic  # noqa: E402
from specblock.q4file import quantize_q4_1, quantize_q8_0  # noqa: E402
from specblock.runtime import cext, q4_kernel  # noqa: E402

LAYERS = 30
HEAD = (49152, 576)


def weights(seed: int = 0) -> list[tuple[int, tuple, tuple]]:
    """(in_features, fp32 kernel weights, amx kernel weights) for every linear of a forward."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(LAYERS):
        for n, k in SHAPES:
            fp32 = q4_kernel.layout(*quantize_q4_1(torch.randn(n, k, generator=g) * 0.05))
            out.append((k, fp32, q4_kernel.layout_amx(*fp32)))
    fp32 = q4_kernel.layout_q8(*quantize_q8_0(torch.randn(*HEAD, generator=g) * 0.05))
    out.append((HEAD[1], fp32, q4_kernel.layout_amx(*fp32)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--baseline-rev", help="also packed-q4-amx's kernel at this git revision (same bits checked)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not (q4_kernel.cpu_supports() and q4_kernel.amx_supports()):
        raise SystemExit("bf16_rows: packed-q4-amx's kernel needs AVX512-BF16 (or AMX) and our q4 library; not on this CPU")
    ws = weights()
    kernel = "AMX tiles" if q4_kernel.amx_tiles() else "AVX512-BF16 dot products"
    rows = [int(r) for r in args.rows.split(",")]
    amx = {f"packed-q4-amx ({kernel})": q4_kernel.linear_amx}
    if args.baseline_rev:
        base = cext.build_revision("specblock_q4", "specblock/runtime/q4_kernel.cpp", args.baseline_rev)
        amx = {f"packed-q4-amx at {args.baseline_rev}": base.linear_amx} | amx
    table: dict[str, dict[int, float]] = {"packed-q4 (fp32 kernel)": {}} | {name: {} for name in amx}
    same_bits = True
    for r in rows:
        xs = {k: torch.randn(r, k) for k in {576, 1536}}
        calls = {"packed-q4 (fp32 kernel)": [lambda k=k, w=w: q4_kernel.linear(xs[k], *w, True) for k, w, _ in ws]}
        calls |= {name: [lambda k=k, w=w, f=f: f(xs[k], *w) for k, _, w in ws] for name, f in amx.items()}
        if args.baseline_rev:
            outs = [[f(xs[k], *w) for k, _, w in ws] for f in amx.values()]
            same_bits &= all(torch.equal(a, b) for a, b in zip(*outs))
        for _ in range(2):  # interleaved: each kernel twice, the lower median kept
            for name, fns in calls.items():
                ms = round(median_ms(fns, args.reps), 3)
                table[name][r] = min(ms, table[name].get(r, ms))
        print(f"{r} rows: " + ", ".join(f"{k} {v[r]} ms" for k, v in table.items()), flush=True)
    macs = LAYERS * sum(n * k for n, k in SHAPES) + HEAD[0] * HEAD[1]
    slope = {k: round((v[rows[-1]] - v[rows[0]]) / (rows[-1] - rows[0]), 3) for k, v in table.items()}
    cmd = (f"python experiments/bf16_rows.py --rows {args.rows} --reps {args.reps} --threads {args.threads} "
           f"--out {args.out}" + (f" --baseline-rev {args.baseline_rev}" if args.baseline_rev else ""))
    head = "| kernel | " + " | ".join(f"{r} rows" for r in rows) + " | ms per extra row |"
    lines = [f"The linears of one forward (30 layers x 7 Q4_1 weights and the Q8_0 head, {macs / 1e6:.0f}M multiply-adds "
             f"a row, streamed from memory), ms, median of {args.reps} passes, the kernels interleaved; {cpu_model()}, "
             f"{args.threads} threads (`{cmd}`).", "", head, "|---" * (len(rows) + 2) + "|"]
    for name, v in table.items():
        lines.append(f"| {name} | " + " | ".join(f"{v[r]:.2f}" for r in rows) + f" | {slope[name]:.3f} |")
    lines += ["", f"One row is {macs / 16 / 1e6:.1f}M fp32 FMAs (16 lanes) or {macs / 32 / 1e6:.1f}M VDPBF16PS "
              "(16 lanes x 2 products): the instruction counts the slopes read against."]
    if args.baseline_rev:
        lines += ["", f"Today's packed-q4-amx kernel and {args.baseline_rev}'s gave the same bits for every call: {same_bits}."]
    write_atomic(args.out.with_suffix(".md"), "\n".join(lines) + "\n")
    write_atomic(args.out.with_suffix(".json"), json.dumps({"rows": rows, "ms": table, "ms_per_row": slope,
                                                            "macs_per_row": macs, "kernel": kernel,
                                                            "same_bits_as_baseline": same_bits if args.baseline_rev else None,
                                                            "threads": args.threads, "command": cmd}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
