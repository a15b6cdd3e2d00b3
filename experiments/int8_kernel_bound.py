"""What bounds q4's int8 kernel: its time per group-block with the weights in cache, on 1 and 2 threads.

Why: at 8 rows one forward's int8 linears take about 10 ms streaming (``linear_streams_int8.md``),
about 3x what a count of the kernel's vector instructions on two ports would allow. This times
``linear8`` on single linears small enough to stay in L1/L2 (the real model's widths), many calls
in a row, and reports nanoseconds per group-block (16 output features x 32 inputs): compute alone,
per thread count. Random Q4_1 weights; medians of ``--reps`` calls.

    python experiments/int8_kernel_bound.py --rows 1,8 --threads 1,2 --reps 2000 --out experiments/results/int8_kernel_bound

``--baseline-rev REV`` also builds the kernel of ``git show REV:specblock/runtime/q4_kernel.cpp`` under
another op namespace and times both, call for call interleaved, checking that they give the same bits.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))  # results_io beside it, however it is loaded

from specblock.q4file import quantize_q4_1  # noqa: E402
from specblock.runtime import cext, q4_kernel  # noqa: E402
from results_io import write_results  # noqa: E402

SHAPES = ((576, 576), (1536, 576), (576, 1536))  # (out, in): q/o, gate/up, down of the real model
GROUP_BLOCK = 16 * 32


def median_us(fns: dict, x: torch.Tensor, lay: torch.Tensor, reps: int) -> dict[str, float]:
    """Median microseconds a call of each kernel, the kernels taking turns call by call."""
    for _ in range(200):
        for fn in fns.values():
            fn(x, lay)
    ts: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn(x, lay)
            ts[name].append(time.perf_counter() - t0)
    return {name: 1e6 * statistics.median(t) for name, t in ts.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "int8_kernel_bound")
    ap.add_argument("--baseline-rev", default=None, help="also time the kernel at this git revision")
    args = ap.parse_args(argv)
    if not (q4_kernel.load() and q4_kernel.vnni_supports()):
        print("error: the int8 kernel needs our q4 kernels and AVX512-VNNI", file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(0)
    lays = {s: q4_kernel.layout8(*quantize_q4_1(torch.randn(*s, generator=g) * 0.05)) for s in SHAPES}
    fns = {"now": q4_kernel.linear8}
    if args.baseline_rev:
        base = cext.build_revision("specblock_q4", "specblock/runtime/q4_kernel.cpp", args.baseline_rev)
        fns = {"baseline": base.linear8} | fns
    rows_out = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for (n, k), lay in lays.items():
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k, generator=g)
                us = median_us(fns, x, lay, args.reps)
                row = {"threads": threads, "out": n, "in": k, "rows": m, "us": round(us["now"], 2),
                       "ns_per_group_block": round(1e3 * us["now"] / (n * k / GROUP_BLOCK), 2)}
                if args.baseline_rev:
                    row |= {"baseline_us": round(us["baseline"], 2), "same_bits": bool(torch.equal(fns["baseline"](x, lay), fns["now"](x, lay)))}
                rows_out.append(row)
    cmd = (f"`python experiments/int8_kernel_bound.py --rows {args.rows} --threads {args.threads} --reps {args.reps}"
           + (f" --baseline-rev {args.baseline_rev}" if args.baseline_rev else "") + f" --out {args.out}`")
    lines = [f"{cmd}: one linear8 call on Q4_1 weights that stay in cache, median us; ns per group-block "
             "(16 features x 32 inputs)" + (f"; the kernel at {args.baseline_rev} timed call for call interleaved" if args.baseline_rev else ""), ""]
    if args.baseline_rev:
        lines += [f"| threads | out x in | rows | us at {args.baseline_rev} | us now | ratio | ns per group-block now | same bits |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['threads']} | {r['out']} x {r['in']} | {r['rows']} | {r['baseline_us']:.1f} | {r['us']:.1f} | "
                  f"{r['us'] / r['baseline_us']:.2f} | {r['ns_per_group_block']:.1f} | {r['same_bits']} |" for r in rows_out]
    else:
        lines += ["| threads | out x in | rows | us a call | ns per group-block |", "|---|---|---|---|---|"]
        lines += [f"| {r['threads']} | {r['out']} x {r['in']} | {r['rows']} | {r['us']:.1f} | {r['ns_per_group_block']:.1f} |"
                  for r in rows_out]
    write_results(args.out, args, rows_out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
