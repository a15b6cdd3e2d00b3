"""The eager target with q4's exact parts (one C++ RMSNorm, rotary from a table) against HF's parts.

Why: beyond its linears, the eager target's forward is ~1,300 small ops (stop 61's profile: the
211 fp16 linears were 14.7 of 33 ms at one row). HF's RMSNorm is 8 ops, 61 times a forward;
``runtime/exact_parts.py`` replaces it with one op a call: first on q4's int8 kernel, where its
fixed summation order is needed for exactness, and since stop 62 on every packed-fp16 target by
default. This measures what the swap gives the eager packed-fp16 (or fp32) target in speed against
HF's parts (``SPECBLOCK_EXACT_PARTS=off``), and how far its logits move (last bits: it is a different
summation order, not a different formula). Two models loaded side by side, tree forwards of n
tokens timed interleaved at the same context.

    python experiments/exact_parts_eager.py [--dtype packed-fp16] [--sizes 1,5] [--ctx 200] [--reps 25]

Writes experiments/results/exact_parts_eager.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specblock.models import resolve_target  # noqa: E402
from specblock.runtime.exact_parts import RowRMSNorm, TableRotary, use_exact_parts  # noqa: E402

sys.path.insert(0, str(ROOT / "experiments"))
from eager_switch_ab import load_with, time_pair, write_pair  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="packed-fp16", help="packed-fp16 or float32 (the parts need fp32 norms)")
    ap.add_argument("--sizes", default="1,5")
    ap.add_argument("--ctx", type=int, default=200)
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "exact_parts_eager")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = resolve_target(args.target)
    hf = load_with(path, args.dtype, "SPECBLOCK_EXACT_PARTS", "off")  # packed-fp16 takes the parts since stop 62
    exact = load_with(path, args.dtype, "SPECBLOCK_EXACT_PARTS", "on")
    swapped = any(isinstance(m, RowRMSNorm) for m in exact.model.modules())
    if not swapped and use_exact_parts(exact.model, prompts=False) == (0, 0):  # fp32 keeps HF's parts by default
        print("error: the exact parts do not apply here (no AVX512F, the C++ op could not be built, or no fp32 norms)")
        return 2
    norms = sum(isinstance(m, RowRMSNorm) for m in exact.model.modules())
    rotaries = sum(isinstance(m, TableRotary) for m in exact.model.modules())
    if any(isinstance(m, RowRMSNorm) for m in hf.model.modules()):
        print("error: SPECBLOCK_EXACT_PARTS=off did not keep HF's parts")
        return 2
    rows = time_pair([hf, exact], [int(s) for s in args.sizes.split(",")], args.ctx, args.reps)
    cmd = "python experiments/exact_parts_eager.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write_pair(args, cmd, rows, ("hf", "exact"), f"HF's parts against exact parts; {norms} norms and {rotaries} rotary "
               "module swapped", {"norms_swapped": norms, "rotary_swapped": rotaries})
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
