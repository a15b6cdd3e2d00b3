"""q4's int8 kernel with its near (L1) and far (L2) software prefetch distances, in the real model's
compiled forward: calls interleaved in one process.

    SPECBLOCK_Q4_KERNEL=int8 python experiments/int8_prefetch.py --sizes 1,4,8 --settings 8:0,8:32 --reps 30 \
        --threads 2 --out experiments/results/int8_prefetch

Each setting is ``NEAR:FAR`` in groups of 32 inputs (``specblock_q4::set_prefetch8`` / ``set_far8``;
0 is off); both are process-wide, so each timed forward sets them first. ``--flush-mb N`` writes N MB
of other memory before each forward, so its weights come from DRAM rather than this machine's L3
(480 MB here, shared: a decode loop's weights may sit in it or not). Checks that every setting gives
the same logits (prefetching moves no arithmetic). A first call of each size compiles or loads its
graph and is not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from specblock.compiled.target import StaticTarget
from specblock.policies.tree import DraftTree
from specblock.runtime import q4_kernel
from specblock.runtime.config import validate
from specblock.runtime.target import TargetModel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--sizes", default="1,4,8")
    ap.add_argument("--settings", default="8:0,8:32", help="NEAR:FAR prefetch distances in groups (0: off)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--ctx", type=int, default=192)
    ap.add_argument("--flush-mb", type=int, default=0, help="MB written before each forward (0: none)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("experiments/results/int8_prefetch"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if os.environ.get("SPECBLOCK_Q4_KERNEL") != "int8":
        raise SystemExit("run with SPECBLOCK_Q4_KERNEL=int8: these distances are the int8 kernel's")
    settings = [tuple(int(v) for v in s.split(":")) for s in args.settings.split(",")]
    path = validate({"target": args.target}).target_dir
    target = StaticTarget.wrap(TargetModel.load(path, "q4"))
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, target.vocab_size, args.ctx)
    target.prefill(prompt)
    flush = torch.zeros(args.flush_mb * 2**18) if args.flush_mb else None

    def forward(setting: tuple[int, int], tree: DraftTree) -> tuple[float, torch.Tensor]:
        torch.ops.specblock_q4.set_prefetch8(setting[0])
        torch.ops.specblock_q4.set_far8(setting[1])
        if flush is not None:
            flush.add_(1.0)
        t0 = time.perf_counter()
        logits = target.tree_forward(tree).logits
        dt = time.perf_counter() - t0
        target.past_len = args.ctx
        return dt, logits

    name = lambda s: f"near {s[0]}, far {s[1]}"
    rows = {}
    try:
        for n in (int(x) for x in args.sizes.split(",")):
            tree = DraftTree.from_parents(rng.integers(3, target.vocab_size, n), np.arange(-1, n - 1))
            for s in settings:  # first calls compile or load
                forward(s, tree)
            ts: dict[tuple, list[float]] = {s: [] for s in settings}
            for _ in range(args.reps):
                for s in settings:
                    ts[s].append(forward(s, tree)[0])
            same = all(torch.equal(forward(settings[0], tree)[1], forward(s, tree)[1]) for s in settings)
            rows[n] = {name(s): round(1e3 * float(np.median(ts[s])), 2) for s in settings} | {"same_logits": same}
            print(n, rows[n], flush=True)
    finally:
        torch.ops.specblock_q4.set_prefetch8(q4_kernel.PREFETCH8)
        torch.ops.specblock_q4.set_far8(q4_kernel.FAR8)
    cols = [name(s) for s in settings]
    lines = [f"`SPECBLOCK_Q4_KERNEL=int8 python experiments/int8_prefetch.py --sizes {args.sizes} --settings {args.settings} "
             f"--reps {args.reps} --flush-mb {args.flush_mb} --threads {args.threads} --out {args.out}` ({args.target}, "
             f"compiled, --dtype q4 on the int8 kernel, context {args.ctx}; median ms of interleaved tree forwards; "
             f"distances in groups of 32 inputs, 0 off{'; weights evicted before each forward' if args.flush_mb else ''})",
             "", "| n | " + " | ".join(cols) + " | same logits |", "|---" * (len(cols) + 2) + "|"]
    lines += [f"| {n} | " + " | ".join(f"{r[c]:.2f}" for c in cols) + f" | {r['same_logits']} |" for n, r in rows.items()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"target": args.target, "ctx": args.ctx, "flush_mb": args.flush_mb,
                                                         "rows": rows}, indent=1) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
