"""Dynamo's guards on every compiled step, against differentiating guards only for shapes met
before (``StaticTarget(skip_guards=...)``): the same compiled target, calls interleaved.

    python experiments/guard_skip.py --dtype packed-fp16 --sizes 1,4 --reps 40 --threads 2 \
        --out experiments/results/guard_skip

Uses the saved graphs under ``$SPECBLOCK_HOME`` (a first run compiles each size). Writes OUT.json and
OUT.md; also checks that both ways give the same logits.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from specblock.compiled.target import StaticTarget
from specblock.policies.tree import DraftTree
from specblock.runtime.config import validate
from specblock.runtime.target import TargetModel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="packed-fp16")
    ap.add_argument("--sizes", default="1,4")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--ctx", type=int, default=150)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("experiments/results/guard_skip"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = StaticTarget.wrap(TargetModel.load(validate({"target": args.target}).target_dir, args.dtype))
    rng = np.random.default_rng(0)
    target.prefill(rng.integers(3, target.vocab_size, args.ctx))

    def forward(tree: DraftTree, skip: bool) -> tuple[float, torch.Tensor]:
        target.skip_guards = skip
        t0 = time.perf_counter()
        logits = target.tree_forward(tree).logits
        dt = time.perf_counter() - t0
        target.past_len = args.ctx
        return dt, logits

    rows = {}
    for n in (int(x) for x in args.sizes.split(",")):
        tree = DraftTree.from_parents(rng.integers(3, target.vocab_size, n), np.arange(-1, n - 1))
        for skip in (False, False, True):  # the first call of a size compiles or loads
            forward(tree, skip)
        ts: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.reps):
            for skip in (False, True):
                ts[skip].append(forward(tree, skip)[0])
        same = torch.equal(forward(tree, False)[1], forward(tree, True)[1])
        rows[n] = {"all_guards_ms": round(1e3 * float(np.median(ts[False])), 2),
                   "skip_ms": round(1e3 * float(np.median(ts[True])), 2), "same_logits": same}
        print(n, rows[n], flush=True)
    lines = [f"`python experiments/guard_skip.py --dtype {args.dtype} --sizes {args.sizes} --reps {args.reps} "
             f"--threads {args.threads} --out {args.out}` ({args.target}, compiled, median ms of interleaved calls)", "",
             "| n | all guards | differentiating guards only | same logits |", "|---|---|---|---|"]
    lines += [f"| {n} | {r['all_guards_ms']:.2f} | {r['skip_ms']:.2f} | {r['same_logits']} |" for n, r in rows.items()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"dtype": args.dtype, "rows": rows}, indent=1) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
