"""The compiled SpecBlock drafter's block step with its attention in the fused op against SDPA.

Why: beside a CPU target in fp32 (packed-fp16, q4) the static SpecBlock drafter (``compiled/drafter.py``)
attends in the target's fused op (``runtime/tree_attention.py``); ``USE_FUSED = False`` keeps SDPA.
A decode loop's propose time is too noisy on this machine to show a few hundred microseconds, so
this times the compiled block call alone: two drafters on the same net, one per setting, each
prefilled with the same prompt, called in turn with the same padded rows (``--rows`` new positions
after a ``--ctx``-token context), medians of ``--reps`` calls. It checks that both give the same
candidates.

    SPECBLOCK_Q4_KERNEL=int8 python experiments/drafter_attention.py --dtype q4 --rows 4,8 --ctx 150 \
        --reps 300 --threads 2 --out experiments/results/drafter_attention
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

from specblock.compiled import drafter as static  # noqa: E402
from specblock.compiled.target import span_of  # noqa: E402
from specblock.models import resolve_target  # noqa: E402
from specblock.runtime import drafters  # noqa: E402
from specblock.runtime.q4 import default_kernel  # noqa: E402
from specblock.runtime.target import TargetModel  # noqa: E402
from results_io import write_results  # noqa: E402


def make(target: TargetModel, fused: bool) -> static.StaticSpecBlockDrafter:
    static.USE_FUSED = fused
    try:
        d = static.StaticSpecBlockDrafter(drafters.build("specblock", target, {}), capacity=target.max_context)
    finally:
        static.USE_FUSED = True
    assert d.fused_attention == fused
    return d


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="q4")
    ap.add_argument("--rows", default="4,8", help="padded new positions a step (the row buckets)")
    ap.add_argument("--ctx", type=int, default=150)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "drafter_attention")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = TargetModel.load(resolve_target(args.target), args.dtype, "cpu")
    pair = {"fused op": make(target, True), "sdpa": make(target, False)}
    first = next(iter(pair.values()))
    width = len(first.net.cfg.tap_layers) * first.net.cfg.hidden_size
    g = torch.Generator().manual_seed(0)
    rows_out = []
    with torch.no_grad():
        for rows in (int(r) for r in args.rows.split(",")):
            taps = torch.randn(rows, width, generator=g)
            toks = torch.randint(0, first.net.cfg.vocab_size, (rows,), generator=g)
            span = span_of(args.ctx + rows + first.net.cfg.K, first.capacity)
            call_args = (taps, toks, torch.tensor(rows), torch.tensor(args.ctx), span)
            outs = {}
            for name, d in pair.items():  # a context: the same random taps in both buffers
                ctx = torch.randn(args.ctx, width, generator=torch.Generator().manual_seed(1))
                d._step(ctx, torch.zeros(args.ctx, dtype=torch.long), torch.tensor(args.ctx), torch.tensor(0),
                        span_of(args.ctx, first.capacity))
                outs[name] = d._run_block(rows, span, *call_args)[1]
            same = bool(torch.equal(outs["fused op"][..., 10:], outs["sdpa"][..., 10:]))
            times = {name: [] for name in pair}
            for _ in range(args.reps):
                for name, d in pair.items():
                    t0 = time.perf_counter()
                    d._run_block(rows, span, *call_args)
                    times[name].append(time.perf_counter() - t0)
            ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
            rows_out.append({"rows": rows, "span": span, **{f"{k}_ms": round(v, 3) for k, v in ms.items()},
                             "same_candidates": same,
                             "max_logp_diff": float((outs["fused op"][..., :10] - outs["sdpa"][..., :10]).abs().max())})
    kernel = f" ({default_kernel()} kernel)" if args.dtype == "q4" else ""
    lines = [f"`python experiments/drafter_attention.py --dtype {args.dtype} --rows {args.rows} --ctx {args.ctx} --reps "
             f"{args.reps} --threads {args.threads} --out {args.out}`{kernel}: the compiled SpecBlock block step "
             f"of the shipped drafter ({args.target}), median ms a call, the two settings in turn", "",
             "| new rows | span | fused op | SDPA | fused / SDPA | same candidates | max log-prob diff |", "|---|---|---|---|---|---|---|"]
    for r in rows_out:
        lines.append(f"| {r['rows']} | {r['span']} | {r['fused op_ms']:.3f} | {r['sdpa_ms']:.3f} | "
                     f"{r['fused op_ms'] / r['sdpa_ms']:.3f} | {r['same_candidates']} | {r['max_logp_diff']:.1e} |")
    write_results(args.out, args, rows_out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
