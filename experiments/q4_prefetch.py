"""q4's kernel with and without its software prefetch, and the Q8_0 head against a packed fp16 one:
the real model's compiled q4 target, calls interleaved in one process.

    python experiments/q4_prefetch.py --sizes 1,4,8 --reps 30 --threads 2 --out experiments/results/q4_prefetch

Three targets share one process: compiled q4 (its Q8_0 head), and a second compiled copy whose head is
packed fp16 over the same values (the head q4 had before). The kernel's prefetch distance
(``specblock_q4::set_prefetch``, in blocks of 4 output features) is a process-wide setting, so each
timed forward sets it first. A first call of each size compiles or loads its graph and is not timed.
Also checks that every setting gives the same logits (prefetching moves no arithmetic). It measures
the fp32 kernel (``SPECBLOCK_Q4_KERNEL=fp32``, set here): the int8 kernel's prefetch is its own.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from compiled_speed import packed_fp16_head  # the head q4 had before its Q8_0 one, as compiled_speed's baseline
from specblock.compiled.target import StaticTarget
from specblock.policies.tree import DraftTree
from specblock.runtime import q4_kernel
from specblock.runtime.config import validate
from specblock.runtime.target import TargetModel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--sizes", default="1,4,8")
    ap.add_argument("--prefetch", default="0,1,2", help="prefetch distances in blocks (0: off)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--ctx", type=int, default=192)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("experiments/results/q4_prefetch"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["SPECBLOCK_Q4_KERNEL"] = "fp32"  # set_prefetch is this kernel's
    if not q4_kernel.load():
        raise SystemExit("our q4 kernel cannot run on this CPU (AVX512F/BW needed)")
    path = validate({"target": args.target}).target_dir
    q8 = StaticTarget.wrap(TargetModel.load(path, "q4"))
    fp16 = TargetModel.load(path, "q4")
    packed_fp16_head(fp16.model)
    fp16 = StaticTarget.wrap(fp16)
    dists = [int(x) for x in args.prefetch.split(",")]
    setups = [(head, d) for head in ("q8_0", "fp16") for d in dists]
    targets = {"q8_0": q8, "fp16": fp16}
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, q8.vocab_size, args.ctx)
    for t in targets.values():
        t.prefill(prompt)

    def forward(head: str, dist: int, tree: DraftTree) -> tuple[float, torch.Tensor]:
        torch.ops.specblock_q4.set_prefetch(dist)
        t = targets[head]
        t0 = time.perf_counter()
        logits = t.tree_forward(tree).logits
        dt = time.perf_counter() - t0
        t.past_len = args.ctx
        return dt, logits

    rows = {}
    try:
        for n in (int(x) for x in args.sizes.split(",")):
            tree = DraftTree.from_parents(rng.integers(3, q8.vocab_size, n), np.arange(-1, n - 1))
            for s in setups:  # first calls compile or load
                forward(*s, tree)
            ts: dict[tuple, list[float]] = {s: [] for s in setups}
            for _ in range(args.reps):
                for s in setups:
                    ts[s].append(forward(*s, tree)[0])
            same = all(torch.equal(forward(h, dists[0], tree)[1], forward(h, d, tree)[1]) for h, d in setups)
            rows[n] = {f"{h} head, prefetch {d}": round(1e3 * float(np.median(ts[(h, d)])), 2) for h, d in setups}
            rows[n]["same_logits"] = same
            print(n, rows[n], flush=True)
    finally:
        torch.ops.specblock_q4.set_prefetch(1)
    cols = [f"{h} head, prefetch {d}" for h, d in setups]
    lines = [f"`python experiments/q4_prefetch.py --sizes {args.sizes} --prefetch {args.prefetch} --reps {args.reps} "
             f"--threads {args.threads} --out {args.out}` ({args.target}, compiled, --dtype q4, context {args.ctx}; "
             "median ms of interleaved tree forwards; prefetch in blocks of 4 output features, 0 off)", "",
             "| n | " + " | ".join(cols) + " | same logits per head |", "|---" * (len(cols) + 2) + "|"]
    lines += [f"| {n} | " + " | ".join(f"{r[c]:.2f}" for c in cols) + f" | {r['same_logits']} |" for n, r in rows.items()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"target": args.target, "ctx": args.ctx, "rows": rows}, indent=1) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
