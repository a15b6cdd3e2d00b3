"""SpecBlock's block call warm and cold: how much of a propose is the drafter's weights coming back
from memory after the target's forward.

Why: in the decode loop SpecBlock's compiled block call took 1.64 ms a propose at q4 on the Zen 5
(``propose_parts_zen5_q4_s74.md``), while the same call repeated back to back takes well under
that. Between two proposes the target streams its whole q4 model (more than this CPU's 32 MB L3),
so the drafter's int8 weights (about 14 MB) and the Python state around them come back from DRAM.
This script times one captured block call three ways, in one process:

- ``warm``: called again right after itself;
- ``flushed``: right after reading ``--flush-mb`` MB of other memory (the target's stream, without
  the target);
- ``in the loop``: the block calls of real decodes (the bench's engine), as ``propose_parts.py``;

and ``grow_block`` (the host's part of a propose) on one captured tree, repeated, against the loop's.

    python experiments/drafter_cold.py --dtype q4 --reps 200 --out experiments/results/drafter_cold_zen5_q4_s75

The call's inputs are one captured from a real decode (4 new positions), so every timed call does
the same work and writes the same buffer slots.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from specblock.models import resolve_target  # noqa: E402
from specblock.prompts import load_prompts  # noqa: E402
from specblock.runtime import chat  # noqa: E402
from specblock.runtime.bench import Targets, build_engine  # noqa: E402
from specblock.runtime.bench_config import method_options  # noqa: E402
from specblock.runtime.cli import load_tokenizer  # noqa: E402
from specblock.runtime.drafters import specblock as specblock_module  # noqa: E402
from specblock.runtime.target import TargetModel  # noqa: E402
from results_io import write_results  # noqa: E402


def served_bytes(net: torch.nn.Module) -> int:
    """Bytes a drafter forward reads as weights: an int8 linear's kernel layout (``_q4``), not the fp32
    ``weight`` it keeps for code that reads weights; other leaves' own parameters; no embedding."""
    total = 0
    for name, mod in net.named_modules():
        if name.startswith("embed") or next(mod.children(), None) is not None:
            continue
        kept = getattr(mod, "_q4", None)
        if kept is not None:
            total += sum(t.numel() * t.element_size() for t in kept)
        else:
            total += sum(p.numel() * p.element_size() for p in mod.parameters(recurse=False))
    return total


def median_ms(xs: list[float]) -> float:
    return round(1e3 * statistics.median(xs), 3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="q4")
    ap.add_argument("--domains", default="code,chat,math")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=200, help="timed calls per way, per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--flush-mb", type=int, default=128, help="other memory read before each 'flushed' call")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "drafter_cold")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = resolve_target(args.target)
    targets = Targets(TargetModel.load(path, args.dtype, "cpu"), "whole")
    tok = load_tokenizer(path, False)
    prompts = [chat.encode_prompt(tok, p) for d in args.domains.split(",") for p in load_prompts(d, 1)]
    sets = ["specblock:compiled=false", "specblock:drafter_compiled=true"]  # the compiled step beside the eager target
    eng = build_engine("specblock", targets, argparse.Namespace(set=sets, method_options=method_options(sets, ["specblock"]),
                                                                drafter_dir=None, compile=False, budget=None), frozenset())
    eng.warm_compiled()
    inner = getattr(eng.drafter, "inner", eng.drafter)
    if not hasattr(inner, "_run_block"):
        print("error: SpecBlock's drafter step is not the static one here", file=sys.stderr)
        return 2
    block, captured, loop, buckets = inner._run_block, {}, [], Counter()

    def run_block(rows, span, *a):
        t0 = time.perf_counter()
        out = block(rows, span, *a)
        loop.append(time.perf_counter() - t0)
        buckets[rows] += 1
        if rows == 4 and "call" not in captured:
            captured["call"] = (rows, span, a)
        return out

    inner._run_block = run_block
    grow, grown, grow_loop = specblock_module.grow_block, {}, []

    def grow_block(tree, *a, **k):
        if "call" not in grown:
            grown["call"] = (copy.deepcopy(tree), copy.deepcopy(a), copy.deepcopy(k))
        t0 = time.perf_counter()
        out = grow(tree, *a, **k)
        grow_loop.append(time.perf_counter() - t0)
        return out

    specblock_module.grow_block = grow_block
    with torch.no_grad():
        for ids in prompts:  # compiles or loads every shape met; the loop's figure is the second pass
            eng.generate(ids, args.tokens)
        loop.clear()
        buckets.clear()
        grow_loop.clear()
        for ids in prompts:
            eng.generate(ids, args.tokens)
        if "call" not in captured:
            print("error: no 4-row block call met; try more --tokens or other --domains", file=sys.stderr)
            return 2
        rows, span, a = captured["call"]
        other = torch.ones(args.flush_mb * (1 << 20) // 4)
        warm, flushed, flush = [], [], []
        for _ in range(args.rounds):
            for _ in range(args.reps):
                block(rows, span, *a)
                t0 = time.perf_counter()
                block(rows, span, *a)
                warm.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                other.sum()
                flush.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                block(rows, span, *a)
                flushed.append(time.perf_counter() - t0)
        tree, ga, gk = grown["call"]
        grow_warm = []
        for _ in range(args.rounds * args.reps):
            t = copy.deepcopy(tree)  # grow_block adds to the tree: a fresh copy each call, outside the timing
            t0 = time.perf_counter()
            grow(t, *ga, **gk)
            grow_warm.append(time.perf_counter() - t0)
    weights = served_bytes(inner.net)
    gbps = args.flush_mb * (1 << 20) / statistics.median(flush) / 1e9
    rows_out = [{"way": "warm (back to back)", "calls": len(warm), "median_ms": median_ms(warm)},
                {"way": f"flushed ({args.flush_mb} MB read first)", "calls": len(flushed), "median_ms": median_ms(flushed)},
                {"way": "in the decode loop", "calls": len(loop), "median_ms": median_ms(loop), "buckets": dict(buckets)},
                {"way": "grow_block, warm (one captured tree, repeated)", "calls": len(grow_warm), "median_ms": median_ms(grow_warm)},
                {"way": "grow_block, in the decode loop", "calls": len(grow_loop), "median_ms": median_ms(grow_loop)}]
    lines = [f"`python experiments/drafter_cold.py --dtype {args.dtype} --domains {args.domains} --tokens {args.tokens} "
             f"--reps {args.reps} --rounds {args.rounds} --flush-mb {args.flush_mb} --threads {args.threads} --out {args.out}`: "
             f"SpecBlock's compiled block call for 4 new positions, and the tree's growth after it, median ms. "
             f"The drafter's served weights (embedding excluded): {weights / 1e6:.1f} MB; the flush read {gbps:.1f} GB/s. The loop's calls by "
             f"row bucket: " + ", ".join(f"{b} rows {n}" for b, n in sorted(buckets.items())) + ".", "",
             "| way | calls | median ms |", "|---|---|---|"]
    lines += [f"| {r['way']} | {r['calls']} | {r['median_ms']:.3f} |" for r in rows_out]
    write_results(args.out, args, rows_out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
