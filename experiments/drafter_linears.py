"""What a drafter's linears cost per forward on each CPU kernel, at the rows a drafter step runs.

Why: beside a q4 target on the int8 kernel, drafters' linears run on that kernel too, from their own
weights rounded to Q8_0 (``drafters.pack_drafter(int8=True)``); before, they were packed fp16
(fbgemm). This times the linears of each shipped drafter of the real model, summed over one forward,
for three kernels: packed fp16, the int8 kernel (Q8_0 weights, int8 rows), and the fp32 q4 kernel
on the same Q8_0 weights. Medians of ``--reps`` calls per linear, kernels interleaved. Linears
that do not fit the q4 kernels (a bias, or widths off their blocks) stay packed fp16 and are left
out of all three sums.

    python experiments/drafter_linears.py --rows 1,4,12 --reps 200 --threads 2 \
        --out experiments/results/drafter_linears
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specblock.models import resolve_target  # noqa: E402
from specblock.q4file import quantize_q8_0  # noqa: E402
from specblock.runtime import drafters, q4, q4_kernel  # noqa: E402
from specblock.runtime.packed import PackedLinear  # noqa: E402
from specblock.runtime.target import TargetModel  # noqa: E402

KERNELS = ("packed-fp16", "int8", "fp32-q8")


def time_call(fn, reps: int) -> float:
    """Median microseconds of one call."""
    for _ in range(10):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(ts)


def drafter_row(name: str, target: TargetModel, rows: list[int], reps: int) -> dict:
    d = drafters.build(name, target, {})  # beside a packed-fp16 target: every linear packed
    net = getattr(d, "net", None) or getattr(d, "model")
    lins = [(n, m) for n, m in net.named_modules() if isinstance(m, PackedLinear)]
    fit = [(n, m) for n, m in lins if m.bias is None and q4.fits(m.out_features, m.in_features)]
    out = {"method": name, "linears": len(lins), "timed": len(fit),
           "params_timed": sum(m.in_features * m.out_features for _, m in fit), "us": {}}
    weights = {n: quantize_q8_0(m.weight) for n, m in fit}
    w8 = {n: q4_kernel.layout8_q8(*weights[n]) for n, _ in fit}
    wf = {n: q4_kernel.layout_q8(*weights[n]) for n, _ in fit}
    for r in rows:
        sums = dict.fromkeys(KERNELS, 0.0)
        for n, m in fit:
            x = torch.randn(r, m.in_features)
            calls = {"packed-fp16": lambda: m(x), "int8": lambda: q4_kernel.linear8(x, w8[n]),
                     "fp32-q8": lambda: q4_kernel.linear(x, *wf[n])}
            for k in KERNELS:
                sums[k] += time_call(calls[k], reps)
        out["us"][r] = {k: round(v, 1) for k, v in sums.items()}
    return out


def markdown(res: list[dict], meta: dict) -> str:
    lines = [f"`python experiments/drafter_linears.py --rows {meta['rows']} --reps {meta['reps']} --threads {meta['threads']}"
             f" --out {meta['out']}`: microseconds per forward, summed over each drafter's linears that fit the q4 "
             "kernels (median of each linear's calls); the real model's shipped drafters.", "",
             "| drafter | linears timed (of all) | params timed | rows | packed-fp16 | int8 | fp32 on Q8_0 | packed / int8 |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res:
        for rows, us in r["us"].items():
            lines.append(f"| {r['method']} | {r['timed']} ({r['linears']}) | {r['params_timed'] / 1e6:.1f} M | {rows} | "
                         f"{us['packed-fp16']:.0f} | {us['int8']:.0f} | {us['fp32-q8']:.0f} | "
                         f"{us['packed-fp16'] / us['int8']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--methods", default="specblock,eagle3,medusa,parallelspec,falcon,sps")
    ap.add_argument("--rows", default="1,4,12")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "drafter_linears")
    args = ap.parse_args(argv)
    if not (q4_kernel.load() and q4_kernel.vnni_supports()):
        print("error: the int8 kernel needs our q4 kernels and AVX512-VNNI", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    target = TargetModel.load(resolve_target(args.target), "packed-fp16", "cpu")
    with torch.no_grad():
        res = [drafter_row(m.strip(), target, rows, args.reps) for m in args.methods.split(",") if m.strip()]
    meta = {"rows": args.rows, "reps": args.reps, "threads": torch.get_num_threads(), "out": str(args.out),
            "target": args.target}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": res}, indent=1))
    md = markdown(res, meta)
    args.out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
