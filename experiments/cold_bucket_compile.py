"""Seconds to compile the compiled target's step for some tree buckets, in this process, one after
the other: run it on an empty inductor cache, once with several buckets and as several processes at
once with one each, to see whether a first start gains from compiling sizes side by side
(``compiled/warm_helpers.py``, docs/compiled.md).

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python experiments/cold_bucket_compile.py --buckets 3,4
    D=$(mktemp -d); for b in 3 4; do TORCHINDUCTOR_CACHE_DIR=$D python experiments/cold_bucket_compile.py --buckets $b & done; wait
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from specblock.compiled import compile_target
from specblock.models.registry import resolve_target
from specblock.policies.tree import DraftTree
from specblock.runtime.target import TargetModel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="q4", help="the default compiled server's")
    ap.add_argument("--buckets", default="3,4")
    ap.add_argument("--taps", default="2,15,27", help="the shipped drafters' (features on, as a server of them runs)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    target = compile_target(TargetModel.load(resolve_target(args.target), args.dtype, "cpu"))
    target.want_features, target.tap_layers = True, tuple(int(t) for t in args.taps.split(","))
    print(f"load {time.perf_counter() - t0:.1f} s", flush=True)
    for b in map(int, args.buckets.split(",")):
        start = time.perf_counter()
        target.prefill(np.zeros(1, dtype=np.int64))
        target.tree_forward(DraftTree.from_parents(np.zeros(b, dtype=np.int64), np.arange(-1, b - 1)))
        print(f"bucket {b}: {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
