"""The compiled target's grouped attention kernels side by side (``StaticTarget(gqa_kernel=...)``,
``compiled/gqa.py``): one model copy per kernel, calls interleaved with the order alternating,
medians and the median of paired ratios (each call against the other kernel's call on the same
tree, a few ms apart: the fair figure on a machine whose speed drifts between runs).

    python experiments/attention_kernels.py --dtype packed-fp16 --sizes 1,4,6,8 --reps 60 --threads 2 \
        --out experiments/results/attention_kernels

Uses the saved graphs under ``$SPECBLOCK_HOME`` (a first run compiles each size). Writes OUT.json
and OUT.md; also reports the largest logit difference between the kernels.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from compiled_speed import random_tree, rewind  # the same random trees and rewind as T(n) there

from specblock.compiled.gqa import KERNELS
from specblock.compiled.target import StaticTarget
from specblock.runtime.config import validate
from specblock.runtime.target import TargetModel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="packed-fp16")
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--sizes", default="1,4,6,8")
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--ctx", type=int, default=192)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("experiments/results/attention_kernels"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernels, sizes = args.kernels.split(","), [int(s) for s in args.sizes.split(",")]
    path = validate({"target": args.target}).target_dir
    targets = {k: StaticTarget.wrap(TargetModel.load(path, args.dtype), gqa_kernel=k) for k in kernels}
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, next(iter(targets.values())).vocab_size, args.ctx)
    vocab = next(iter(targets.values())).vocab_size
    diff = {}
    for n in sizes:  # first calls compile or load; their logits are compared
        tree = random_tree(rng, n, vocab)
        logits = {}
        for k, t in targets.items():
            t.prefill(prompt)
            logits[k] = t.tree_forward(tree).logits
            t.reset()
        diff[n] = max(float((logits[k] - logits[kernels[0]]).abs().max()) for k in kernels)
    for t in targets.values():
        t.prefill(prompt)
    ms = {k: {n: [] for n in sizes} for k in kernels}
    for rep in range(args.reps):
        for n in sizes:
            tree = random_tree(rng, n, vocab)
            for k in kernels if rep % 2 == 0 else kernels[::-1]:
                t = targets[k]
                t0 = time.perf_counter()
                t.tree_forward(tree)
                ms[k][n].append(1e3 * (time.perf_counter() - t0))
                rewind(t, args.ctx)
    base = kernels[0]
    rows = {n: {k: round(float(np.median(ms[k][n])), 2) for k in kernels} for n in sizes}
    ratio = {n: {k: round(float(np.median(np.array(ms[k][n]) / np.array(ms[base][n]))), 3) for k in kernels} for n in sizes}
    out = {"args": vars(args) | {"out": str(args.out)}, "median_ms": rows, "paired_ratio_to_" + base: ratio,
           "max_logit_diff": diff}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(out, indent=1))
    lines = [f"Compiled target, grouped attention kernels, {args.dtype}, {args.threads} threads, context {args.ctx}, "
             f"{args.reps} interleaved calls per size (`python experiments/attention_kernels.py --dtype {args.dtype} "
             f"--kernels {args.kernels} --sizes {args.sizes} --reps {args.reps} --threads {args.threads} --out {args.out}`).", "",
             "| n | " + " | ".join(f"{k} ms" for k in kernels) + " | " + " | ".join(f"{k} / {base} (paired)" for k in kernels[1:])
             + " | max logit diff |", "|---" * (2 * len(kernels) + 1) + "|"]
    for n in sizes:
        lines.append(f"| {n} | " + " | ".join(f"{rows[n][k]:.2f}" for k in kernels) + " | "
                     + " | ".join(f"{ratio[n][k]:.3f}" for k in kernels[1:]) + f" | {diff[n]:.2e} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
