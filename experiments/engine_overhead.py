"""Engine bookkeeping per iteration, outside model forwards, next to one target forward.

Times, for trees of 8, 32 and 64 draft nodes: building the tree with the shared policy code
(grow_block under RankBucketBranching, M=2 blocks), the 4D mask and position ids, greedy
verification on the tree's logits, and KV pruning to a random accepted path. Medians of
``--reps`` repetitions. The target defaults to a randomly initialised model of the lab's shape
(6 layers, hidden 384, vocab 8192), or pass --target DIR.

    python experiments/engine_overhead.py [--target DIR] [--ctx 256] [--reps 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from specblock.models import resolve_target
from specblock.policies.branching import RankBucketBranching, grow_block
from specblock.policies.tree import DraftTree
from specblock.runtime.target import TargetModel
from specblock.runtime.verify import GreedyVerifier

LAB_SHAPE = dict(vocab_size=8192, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                 num_attention_heads=6, num_key_value_heads=6, max_position_embeddings=1024)


def lab_target(dtype: torch.dtype) -> TargetModel:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**LAB_SHAPE), attn_implementation="sdpa", dtype=dtype)
    return TargetModel(model)


def build_tree(rng: np.random.Generator, budget: int) -> DraftTree:
    """Two blocks of K=4 under RankBucketBranching, seeds = block-1 spine ends (the SpecBlock shape)."""
    tree = DraftTree.root_only(1)
    policy = RankBucketBranching((2, 4, 10, 0))
    for block, seeds in enumerate((np.array([0]), None)):
        if seeds is None:
            seeds = tree.meta["block_nodes"][:2]
        s = len(seeds)
        ct = rng.integers(0, 8192, (s, 4, 10))
        cl = -np.sort(rng.random((s, 4, 10)) * 4, axis=-1)
        grow_block(tree, seeds, ct, cl, rng.integers(0, 3, (s, 4)), policy, budget, block)
    return tree


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", help="a model name (see `models`) or directory; default: the lab model")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--out", type=Path, default=Path("experiments/results/engine_overhead.json"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    target = (TargetModel.load(resolve_target(args.target), args.dtype, "cpu") if args.target
              else lab_target(getattr(torch, args.dtype)))
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, target.vocab_size, args.ctx)
    verifier = GreedyVerifier()
    rows = []
    for budget in (8, 32, 64):
        trees = [build_tree(rng, budget) for _ in range(8)]
        tree = max(trees, key=lambda t: t.size)
        target.prefill(prompt[:-1])
        logits = target.tree_forward(tree).logits
        path = tree.path_to(int(np.argmax(tree.depth)))

        def fresh_cache():
            target.prefill(prompt[:-1])

        def forward_then_commit():
            target.past_len = args.ctx - 1
            for layer in target.cache.layers:  # drop the previous tree's entries, keep the prompt
                layer.keys, layer.values = layer.keys[..., : args.ctx - 1, :], layer.values[..., : args.ctx - 1, :]
            target.tree_forward(tree)
            t = time.perf_counter()
            target.commit(path)
            return time.perf_counter() - t

        fresh_cache()
        commit = [forward_then_commit() for _ in range(max(20, args.reps // 10))]

        def tree_build():
            build_tree(rng, budget).ancestor_mask

        def inputs():
            tree._invalidate()  # rebuild the cached ancestor mask too
            target.past_len = args.ctx - 1
            target.tree_inputs(tree)

        def forward():
            target.past_len = args.ctx - 1
            for layer in target.cache.layers:
                layer.keys, layer.values = layer.keys[..., : args.ctx - 1, :], layer.values[..., : args.ctx - 1, :]
            target.tree_forward(tree)

        row = {
            "budget": budget,
            "tree_nodes": tree.size,
            "build_ms": median_ms(tree_build, args.reps),
            "mask_ms": median_ms(inputs, args.reps),
            "verify_ms": median_ms(lambda: verifier.verify(tree, logits), args.reps),
            "commit_ms": 1e3 * statistics.median(commit),
            "target_forward_ms": median_ms(forward, max(20, args.reps // 10)),
        }
        row["overhead_ms"] = row["build_ms"] + row["mask_ms"] + row["verify_ms"] + row["commit_ms"]
        rows.append({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
        print(json.dumps(rows[-1]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"ctx": args.ctx, "dtype": args.dtype, "threads": 2, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
