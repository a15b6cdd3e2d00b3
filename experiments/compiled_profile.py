"""Where a compiled tree forward's time goes, per tree size: inductor's kernel profile (each
generated C++ kernel and each extern call timed) for the real model's compiled step at n = 1 and
the sizes speculative methods verify. Answers why T(4) / T(1) is about 1.35 on the compiled path
while the linears alone add about 10% (``packed_rows.md``).

    python experiments/compiled_profile.py --dtype packed-fp16 --sizes 1,4 --reps 20 --threads 2 \
        --out experiments/results/compiled_profile

Compiles into a temporary inductor cache (the kernel profile changes the generated code). Writes
OUT.json and OUT.md: the top entries by time per size, and each entry's growth from the first size.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from specblock.policies.tree import DraftTree
from specblock.runtime.config import validate
from specblock.runtime.target import TargetModel


def chain(rng: np.random.Generator, n: int, vocab: int) -> DraftTree:
    return DraftTree.from_parents(rng.integers(3, vocab, n), np.arange(-1, n - 1))


def profile(target, n: int, reps: int, ctx: int) -> dict[str, float]:
    """Microseconds per forward by profiler entry (self CPU time), the mean over ``reps`` forwards."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    rng = np.random.default_rng(0)
    prompt = rng.integers(3, target.vocab_size, ctx)
    target.prefill(prompt)
    for _ in range(3):  # compile / warm
        target.tree_forward(chain(rng, n, target.vocab_size))
        target.past_len = ctx
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            target.tree_forward(chain(rng, n, target.vocab_size))
            target.past_len = ctx
    out: dict[str, float] = {}
    for e in prof.key_averages():
        out[e.key] = e.self_cpu_time_total / reps
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="packed-fp16")
    ap.add_argument("--sizes", default="1,4")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--ctx", type=int, default=192)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("experiments/results/compiled_profile"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor_profile_")
    torch._inductor.config.cpp.enable_kernel_profile = True
    from specblock.compiled.target import StaticTarget

    path = validate({"target": args.target}).target_dir
    target = StaticTarget.wrap(TargetModel.load(path, args.dtype), saved=False)
    sizes = [int(n) for n in args.sizes.split(",")]
    prof = {n: profile(target, n, args.reps, args.ctx) for n in sizes}
    first = prof[sizes[0]]
    keys = sorted(set().union(*prof.values()), key=lambda k: -max(p.get(k, 0.0) for p in prof.values()))[: args.top]
    lines = [f"`python experiments/compiled_profile.py --dtype {args.dtype} --sizes {args.sizes} --reps {args.reps} "
             f"--threads {args.threads} --out {args.out}` ({args.target}, compiled, inductor kernel profile; "
             "self CPU microseconds per forward; the kernel profile itself adds time per kernel)", "",
             "| entry | " + " | ".join(f"n = {n}" for n in sizes) + " | growth |", "|---" * (len(sizes) + 2) + "|"]
    lines += [f"| `{k[:70]}` | " + " | ".join(f"{prof[n].get(k, 0.0):.0f}" for n in sizes)
              + f" | {prof[sizes[-1]].get(k, 0.0) - first.get(k, 0.0):+.0f} |" for k in keys]
    lines += ["", "| total | " + " | ".join(f"{sum(prof[n].values()):.0f}" for n in sizes)
              + f" | {sum(prof[sizes[-1]].values()) - sum(first.values()):+.0f} |"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({str(n): p for n, p in prof.items()}, indent=1) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
