"""T(n) of the real model's tree forward with HF's SDPA attention against grouped rows
(``runtime/grouped_rows.py``: no ``repeat_kv`` copy), interleaved in one process on the same model.

    python experiments/tree_attention.py [--dtype packed-fp16] [--sizes 1,2,4,8,16] [--ctx 64,256]
        [--reps 15] [--runs 3] [--threads 2] [--impls hf,rows] [--out experiments/results/tree_attention]

``--impls`` may add ``rows_per_layer``: grouped rows with the mask tiled in every layer, as before
the tiled mask was shared across a forward's layers; and ``rows_sdpa``: grouped rows without the fused
op (``runtime/tree_attention.py``) that fp32 forwards take since, i.e. SDPA on the folded heads.

Each run times every size under both functions in turn (medians of ``--reps`` forwards, then the
median over ``--runs``); the logits of one tree per size are compared between the two.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specblock.atomic import write_atomic  # noqa: E402
from specblock.models import resolve_target  # noqa: E402
from specblock.runtime.calibrate import _random_tree, time_target  # noqa: E402
from specblock.runtime import grouped_rows  # noqa: E402
from specblock.runtime.grouped_rows import use_grouped_rows, use_hf_sdpa  # noqa: E402
from specblock.runtime.target import TargetModel  # noqa: E402

IMPLS = ("hf", "rows", "rows_per_layer", "rows_sdpa")
SHARED_TILE = grouped_rows.tiled_mask


def switch(target: TargetModel, impl: str) -> None:
    grouped_rows.tiled_mask = SHARED_TILE if impl != "rows_per_layer" else grouped_rows._tile
    grouped_rows.USE_FUSED = impl == "rows"
    if impl.startswith("rows"):
        assert use_grouped_rows(target.model), "grouped rows need an SDPA CPU model with grouped key/value heads"
    else:
        use_hf_sdpa(target.model)


def max_logit_gap(target: TargetModel, ctx: int, n: int, impls: tuple[str, ...]) -> float:
    """Largest |logit difference| between the functions on one random tree."""
    rng = np.random.default_rng(n)
    prompt, tree = rng.integers(0, target.vocab_size, ctx), _random_tree(rng, n, target.vocab_size)
    out = {}
    for impl in impls:
        switch(target, impl)
        target.prefill(prompt)
        out[impl] = target.tree_forward(tree).logits.float()
    first = out[impls[0]]
    return max(float((first - o).abs().max()) for o in out.values())


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="packed-fp16")
    ap.add_argument("--sizes", default="1,2,4,8,16")
    ap.add_argument("--ctx", default="64,256")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--impls", default="hf,rows", help=f"any of {','.join(IMPLS)}")
    ap.add_argument("--out", type=Path, default=Path("experiments/results/tree_attention"))
    a = ap.parse_args(argv)
    impls = tuple(a.impls.split(","))
    if not impls or any(i not in IMPLS for i in impls):
        ap.error(f"--impls takes names from {','.join(IMPLS)}")
    torch.set_num_threads(a.threads)
    sizes = [int(x) for x in a.sizes.split(",")]
    ctxs = [int(x) for x in a.ctx.split(",")]
    target = TargetModel.load(resolve_target(a.target), a.dtype, "cpu")
    rng = np.random.default_rng(0)
    ms: dict[tuple, list[float]] = {}
    for run in range(a.runs):
        for impl in (impls if run % 2 == 0 else impls[::-1]):
            switch(target, impl)
            for ctx in ctxs:
                for n in sizes:
                    ms.setdefault((impl, ctx, n), []).append(time_target(target, ctx, n, a.reps, rng)[0])
    gaps = {n: max_logit_gap(target, ctxs[0], n, impls) for n in sizes}
    rows = [{"impl": impl, "ctx": ctx, "n": n, "ms": round(statistics.median(ms[impl, ctx, n]), 3)}
            for impl in impls for ctx in ctxs for n in sizes]
    cmd = "python experiments/tree_attention.py " + " ".join(argv)
    md = [f"T(n) in ms, {a.dtype}, {a.threads} threads, medians of {a.reps} forwards, median of {a.runs} interleaved "
          f"runs (`{cmd.strip()}`). hf: HF's SDPA function (`repeat_kv` under a tree mask); rows: grouped rows (fp32: "
          "the fused op); rows_per_layer: grouped rows, the mask tiled in every layer; rows_sdpa: grouped rows "
          "without the fused op.", "",
          "| ctx | attention | " + " | ".join(f"T({n})" for n in sizes) + " |",
          "|---|---|" + "---|" * len(sizes)]
    for ctx in ctxs:
        for impl in impls:
            md.append(f"| {ctx} | {impl} | " + " | ".join(f"{statistics.median(ms[impl, ctx, n]):.2f}" for n in sizes) + " |")
    md += ["", "Largest |logit difference| from the first of them on one random tree per size (context "
           f"{ctxs[0]}): " + ", ".join(f"n={n}: {g:.2e}" for n, g in gaps.items())]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(a.out.with_suffix(".json"), json.dumps({"config": vars(a) | {"out": str(a.out)}, "rows": rows,
                                                         "max_logit_gap": gaps}, indent=1) + "\n")
    write_atomic(a.out.with_suffix(".md"), "\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
