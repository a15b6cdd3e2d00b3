"""The fused attention op alone, against its own source at another git revision, in one process.

Why: a change to ``runtime/tree_attention.cpp`` is best judged on the op itself, at the real model's
shapes (9 query heads on 3 key/value heads of 64 dims, a 256-slot span, a context of ``--ctx``
committed slots and a chain of ``n`` tree rows), and the previous op is gone from the tree once the
change lands. So this builds the baseline's source from ``git show REV:specblock/runtime/tree_attention.cpp``
under another op namespace and times the two interleaved (medians of ``--reps`` calls, 30 calls a
forward as the real model's 30 layers make). It also checks that both give the same attention
(within 1e-5) on every shape it times. ``--prompts`` adds an eager prompt's shape: ``L`` causal rows
over an ``L``-slot span (what q4's int8 kernel sends the op, ``grouped_rows.EXACT_PROMPT``), timed
``--prompt-reps`` times.

    python experiments/attention_op.py --baseline-rev 3d5610a --sizes 1,4,8 --ctx 150,250 --threads 2 \
        --out experiments/results/attention_op
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

from specblock.compiled.target import span_of  # noqa: E402
from specblock.runtime import cext, tree_attention  # noqa: E402
from results_io import write_results  # noqa: E402

H, HKV, D, SPAN, LAYERS = 9, 3, 64, 256, 30


def inputs(n: int, ctx: int, g: torch.Generator, span: int | None = None):
    """A chain of ``n`` tree rows after ``ctx`` committed slots; the rest of the span hidden. The span:
    ``SPAN``, or from a context of ``SPAN`` on the compiled target's power of two (``span_of``)."""
    span = span or (SPAN if ctx < SPAN else span_of(ctx + n, 1 << 30))
    q = torch.randn(1, H, n, D, generator=g)
    k, v = torch.randn(2, 1, HKV, span + 64, D, generator=g)[:, :, :, :span]  # a longer cache read in place
    mask = torch.full((1, 1, n, span), torch.finfo(torch.float32).min)
    mask[..., :ctx] = 0
    for i in range(n):
        mask[0, 0, i, ctx: ctx + i + 1] = 0
    return q, k, v, mask


def prompt_inputs(n: int, span: int, g: torch.Generator):
    """A prompt of ``n`` tokens: ``n`` causal rows over a ``span``-slot span (``n`` for an eager
    prompt; the compiled prefill pads it to a power of two, ``compiled.target.span_of``)."""
    q = torch.randn(1, H, n, D, generator=g)
    k, v = torch.randn(2, 1, HKV, span, D, generator=g)
    mask = torch.full((n, span), torch.finfo(torch.float32).min).triu(1)[None, None].contiguous()
    return q, k, v, mask


def timed(ops: dict, layers: list[tuple], reps: int) -> dict[str, float]:
    """Median us a call of each op, interleaved, after a few untimed calls. With several ``layers``
    (each its own key/value tensors), a rep makes one call a layer in turn and counts their mean:
    a layer's keys and values are then no longer in cache when it comes round again, as in a
    forward, where the weights stream between layers."""
    times: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(min(20, reps)):
        for op in ops.values():
            op(*layers[0])
    for _ in range(reps):
        for name, op in ops.items():
            t0 = time.perf_counter()
            for args in layers:
                op(*args)
            times[name].append((time.perf_counter() - t0) / len(layers))
    return {name: 1e6 * statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline-rev", required=True, help="the git revision whose op is the baseline")
    ap.add_argument("--sizes", default="1,4,8", help="tree rows per call")
    ap.add_argument("--ctx", default="150,250", help="committed slots before the tree")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--prompts", default="", help="eager prompt lengths to time as well (causal rows = span)")
    ap.add_argument("--prompt-reps", type=int, default=5)
    ap.add_argument("--padded", action="store_true", help="each prompt also over the compiled prefill's padded span")
    ap.add_argument("--span", type=int, help="decoding shapes over this many slots (a compiled step's whole buffer: 8256)")
    ap.add_argument("--cold", action="store_true",
                    help="decoding shapes over 30 layers' own keys and values in turn (read from memory, not cache)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "attention_op")
    args = ap.parse_args(argv)
    if not tree_attention.load():
        print("error: the fused op cannot run here", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    base = cext.build_revision("specblock_attention", "specblock/runtime/tree_attention.cpp", args.baseline_rev)
    ops = {"baseline": base.tree_attention, "current": torch.ops.specblock_attention.tree_attention}
    g = torch.Generator().manual_seed(0)
    rows = []
    cases = [(ctx, n, inputs(n, ctx, g, args.span), args.reps) for ctx in (int(c) for c in args.ctx.split(","))
             for n in (int(s) for s in args.sizes.split(","))]
    for n in (int(s) for s in args.prompts.split(",") if s):
        spans = sorted({n, span_of(n, 1 << 30)}) if args.padded else [n]
        cases += [("prompt" if span == n else f"prompt, {span} slots", n, prompt_inputs(n, span, g), args.prompt_reps)
                  for span in spans]
    for ctx, n, (q, k, v, mask), reps in cases:
        outs = {name: op(q, k, v, mask, D**-0.5) for name, op in ops.items()}
        diff = float((outs["current"] - outs["baseline"]).abs().max())
        assert diff < 1e-5, (n, ctx, diff)
        layers = [(q, k, v, mask, D**-0.5)]
        if args.cold and not str(ctx).startswith("prompt"):
            layers += [(q, k2, v2, mask, D**-0.5) for k2, v2 in torch.randn(LAYERS - 1, 2, *k.shape, generator=g)]
        us = timed(ops, layers, reps)
        rows.append({"ctx": ctx, "n": n, "baseline_us": round(us["baseline"], 2), "current_us": round(us["current"], 2),
                     "max_abs_diff": diff})
    lines = [f"`python experiments/attention_op.py --baseline-rev {args.baseline_rev} --sizes {args.sizes} --ctx {args.ctx} "
             f"--reps {args.reps}" + (f" --prompts {args.prompts} --prompt-reps {args.prompt_reps}" if args.prompts else "")
             + (" --padded" if args.padded else "") + (" --cold" if args.cold else "")
             + (f" --span {args.span}" if args.span else "")
             + f" --threads {args.threads} --out {args.out}`: the fused attention op alone, "
             f"{H} query heads on {HKV} key/value heads of {D}, a {SPAN}-slot span (from a context of {SPAN}: the next power of two; context 'prompt': L causal rows "
             f"over L slots, or the padded span named); median us a call, interleaved; a forward makes {LAYERS} calls"
             + (f" (--cold: over {LAYERS} layers' own keys and values in turn)" if args.cold else ""), "",
             f"| context | rows | op at {args.baseline_rev} | op now | ratio | ms a forward then / now | max abs diff |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['ctx']} | {r['n']} | {r['baseline_us']:.1f} | {r['current_us']:.1f} | "
                     f"{r['current_us'] / r['baseline_us']:.2f} | {LAYERS * r['baseline_us'] / 1e3:.2f} / "
                     f"{LAYERS * r['current_us'] / 1e3:.2f} | {r['max_abs_diff']:.1e} |")
    write_results(args.out, args, rows, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
