"""Compiled drafters' static shapes, two variants in one run. ``--ab rows`` (the default): the new
committed positions of a step padded to 8 rows always (``row_buckets = (8,)``, the first form)
against 4 or 8 (``(4, 8)``, ``compiled/drafter.py``'s ``ROW_BUCKETS``). ``--ab span``: attention
over power-of-two spans of the buffer against the whole buffer (``one_span``). ``--ab attention``:
SDPA over power-of-two spans (EAGLE-3's compiled steps until stop 66) against the fused op over the
whole buffer. Two
engines per method on the one compiled target, the same prompts, calls interleaved with the order
alternating (each engine's first pass over the prompts compiles the shapes they meet, untimed); the
median per-iteration drafting ms and tokens/s, and whether the two variants' outputs agree.

    python experiments/drafter_rows.py --methods specblock+lookup,eagle3 --domains code,chat,math \
        --prompts 2 --runs 3 --out experiments/results/drafter_rows

Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from specblock.models import resolve_target
from specblock.prompts import load_prompts
from specblock.runtime import chat
from specblock.runtime.bench import Targets, build_engine
from specblock.runtime.bench_config import method_options
from specblock.runtime.cli import load_tokenizer
from specblock.runtime.target import TargetModel

#: per ``--ab``: variant label -> the drafter's attributes and their values
AB = {"rows": {"rows 8": {"row_buckets": (8,)}, "rows 4/8": {"row_buckets": (4, 8)}},
      "span": {"spans": {"one_span": False}, "one span": {"one_span": True}},
      "attention": {"SDPA, spans": {"fused_attention": False, "one_span": False},
                    "fused op, one span": {"fused_attention": True, "one_span": True}}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="packed-fp16")
    ap.add_argument("--methods", default="specblock+lookup,eagle3")
    ap.add_argument("--domains", default="code,chat,math")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ab", choices=sorted(AB), default="rows")
    ap.add_argument("--out", type=Path, default=Path("experiments/results/drafter_rows"))
    args = ap.parse_args(argv)
    variants = AB[args.ab]
    first, second = variants
    torch.set_num_threads(args.threads)
    path = resolve_target(args.target)
    targets = Targets(TargetModel.load(path, args.dtype, "cpu"), "whole")
    tok = load_tokenizer(path, False)
    prompts = [chat.encode_prompt(tok, p) for d in args.domains.split(",") for p in load_prompts(d, args.prompts)]
    results = {}
    for m in args.methods.split(","):
        sets = [f"{m}:compiled=true"]
        ns = argparse.Namespace(set=sets, method_options=method_options(sets, [m]), drafter_dir=None, compile=False,
                                budget=None)
        engines = {}
        for label, attrs in variants.items():
            eng = build_engine(m, targets, ns, frozenset())
            drafter = getattr(eng.drafter, "inner", eng.drafter)
            for attr, value in attrs.items():
                if not hasattr(drafter, attr):
                    raise SystemExit(f"error: {m}'s compiled drafter has no {attr!r}: --ab {args.ab} does not apply to it")
                setattr(drafter, attr, value)
            for ids in prompts:  # first use compiles every shape these prompts meet
                eng.generate(ids, args.tokens)
            engines[label] = eng
        draft = {k: [] for k in variants}
        tps = {k: [] for k in variants}
        outs: dict[str, list] = {k: [] for k in variants}
        for run in range(args.runs):
            for i, ids in enumerate(prompts):
                order = list(variants) if (run + i) % 2 == 0 else list(variants)[::-1]
                for label in order:
                    t0 = time.perf_counter()
                    res = engines[label].generate(ids, args.tokens)
                    wall = time.perf_counter() - t0
                    st = res.stats
                    draft[label].append(1e3 * st.draft_s / st.iterations)
                    tps[label].append(len(res.token_ids) / wall)
                    if run == 0:
                        outs[label].append(res.token_ids)
        same = outs[first] == outs[second]
        results[m] = {label: {"draft_ms": round(statistics.median(draft[label]), 3),
                              "tokens_per_s": round(statistics.median(tps[label]), 2)} for label in variants}
        results[m]["same_outputs"] = same
        print(m, results[m], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "results": results},
                                                        indent=1))
    what = {"rows": "padded rows", "span": "attention spans", "attention": "attention (op and spans)"}[args.ab]
    lines = [f"Compiled drafters' {what}, compiled target, {args.dtype}, {args.threads} threads, {args.prompts} prompts x "
             f"{args.domains}, {args.tokens} new tokens, {args.runs} interleaved runs, medians over calls (`python "
             f"experiments/drafter_rows.py --ab {args.ab} --methods {args.methods} --domains {args.domains} --prompts {args.prompts} "
             f"--tokens {args.tokens} --runs {args.runs} --out {args.out}`).", "",
             f"| method | drafting ms / iteration, {first} | {second} | tokens/s, {first} | {second} | same outputs |",
             "|---|---|---|---|---|---|"]
    for m, r in results.items():
        lines.append(f"| {m} | {r[first]['draft_ms']:.2f} | {r[second]['draft_ms']:.2f} | "
                     f"{r[first]['tokens_per_s']:.1f} | {r[second]['tokens_per_s']:.1f} | {r['same_outputs']} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
