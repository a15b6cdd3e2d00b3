"""The eager target loaded with a load-time switch off and on, tree forwards timed interleaved.

Why: ``SPECBLOCK_EXACT_PARTS`` (stop 62: HF's RMSNorm and rotary as one op each) and
``SPECBLOCK_SHARED_INPUT`` (q/k/v as one GEMM, ``runtime/shared_input.py``) change how the
packed-fp16 target computes, not what: this times what each gives, and how far the logits move
(last bits), on two models loaded side by side at the same context. ``SPECBLOCK_ROTARY_OP`` (stop 63):
rotary's application as one op (``exact_parts.use_rotary_op``).

    python experiments/eager_switch_ab.py --switch SPECBLOCK_SHARED_INPUT [--sizes 1,5,8] [--ctx 200] [--reps 25]

Writes ``--out``.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specblock.models import resolve_target  # noqa: E402
from specblock.policies.tree import DraftTree  # noqa: E402
from specblock.runtime.calibrate import rewind  # noqa: E402
from specblock.runtime.target import TargetModel  # noqa: E402

SWITCHES = ("SPECBLOCK_EXACT_PARTS", "SPECBLOCK_SHARED_INPUT", "SPECBLOCK_ROTARY_OP")


def chain(root: int, n: int, rng: np.random.Generator, vocab: int) -> DraftTree:
    return DraftTree.from_parents(np.concatenate([[root], rng.integers(0, vocab, n - 1)]), np.arange(-1, n - 1))


def time_pair(pair: list[TargetModel], sizes: list[int], ctx: int, reps: int) -> list[dict]:
    """Tree forwards of each size on two targets at the same context (random tokens, seeded),
    interleaved after two untimed rounds, the order alternating between reps: per size the two
    medians in ms, their ratio (second / first), the largest logit difference and whether every
    argmax agrees."""
    rng = np.random.default_rng(0)
    vocab = pair[0].vocab_size
    prompt = rng.integers(0, vocab, ctx + 1)
    trees = {n: chain(int(prompt[-1]), n, rng, vocab) for n in sizes}
    for t in pair:
        t.prefill(prompt[:-1])
    ms = {(i, n): [] for i in range(2) for n in sizes}
    logits = {}
    for rep in range(reps + 2):
        for n in sizes:
            for i in ((0, 1) if rep % 2 == 0 else (1, 0)):  # each side first in half the reps (the second ran faster)
                t = pair[i]
                start = time.perf_counter()
                logits[i, n] = t.tree_forward(trees[n]).logits
                if rep >= 2:
                    ms[i, n].append(1e3 * (time.perf_counter() - start))
                rewind(t, ctx)
    rows = []
    for n in sizes:
        a, b = statistics.median(ms[0, n]), statistics.median(ms[1, n])
        rows.append({"n": n, "ms": (round(a, 2), round(b, 2)), "ratio": round(b / a, 3),
                     "max_logit_diff": (logits[0, n] - logits[1, n]).abs().max().item(),
                     "argmax_same": bool((logits[0, n].argmax(-1) == logits[1, n].argmax(-1)).all())})
    return rows


def load_with(path: str, dtype: str, switch: str, value: str) -> TargetModel:
    """The target loaded with the environment switch ``switch`` set to ``value`` (restored after)."""
    with mock.patch.dict(os.environ, {switch: value}):
        return TargetModel.load(path, dtype, "cpu")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--switch", choices=SWITCHES, required=True)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="packed-fp16")
    ap.add_argument("--sizes", default="1,5,8")
    ap.add_argument("--ctx", type=int, default=200)
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--load-order", default="off,on", help="which side loads first (the first-loaded model may run slower)")
    ap.add_argument("--null", action="store_true", help="both sides with the switch on: the A/B's own bias, to compare with")
    ap.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "eager_switch_ab")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = resolve_target(args.target)
    values = {"off": "on" if args.null else "off", "on": "on"}  # --null: the same setting on both sides
    order = args.load_order.split(",")
    if sorted(order) != ["off", "on"]:
        raise SystemExit(f"--load-order {args.load_order!r}: name off and on, in the order to load them")
    models = {side: load_with(path, args.dtype, args.switch, values[side]) for side in order}
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = time_pair([models["off"], models["on"]], sizes, args.ctx, args.reps)
    cmd = "python experiments/eager_switch_ab.py " + " ".join(argv if argv is not None else sys.argv[1:])
    what = f"{args.switch}=on on both sides (a null A/B), loaded {args.load_order}" if args.null else \
        f"{args.switch}=off against on, loaded {args.load_order}"
    write_pair(args, cmd, rows, ("off", "on"), what, {"switch": args.switch, "null": args.null, "load_order": args.load_order})
    return 0


def write_pair(args: argparse.Namespace, cmd: str, rows: list[dict], labels: tuple[str, str], what: str,
               meta: dict) -> None:
    """``time_pair``'s rows to ``args.out``.{json,md} (and stdout), the two columns named ``labels``."""
    rows = [{"n": r["n"], f"{labels[0]}_ms": r["ms"][0], f"{labels[1]}_ms": r["ms"][1]}
            | {k: r[k] for k in ("ratio", "max_logit_diff", "argmax_same")} for r in rows]
    res = {"command": cmd, "target": args.target, "dtype": args.dtype, "ctx": args.ctx, "reps": args.reps,
           "threads": args.threads, **meta, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    lines = [f"`{cmd}` ({args.target}, {args.dtype}, context {args.ctx}, {args.threads} threads; medians of {args.reps} "
             f"interleaved tree forwards, {what})", "",
             f"| tree tokens | {labels[0]} ms | {labels[1]} ms | ratio | max logit diff | argmax same |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['n']} | {r[labels[0] + '_ms']:.2f} | {r[labels[1] + '_ms']:.2f} | {r['ratio']:.3f} | "
              f"{r['max_logit_diff']:.2e} | {r['argmax_same']} |" for r in rows]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

if __name__ == "__main__":
    raise SystemExit(main())
