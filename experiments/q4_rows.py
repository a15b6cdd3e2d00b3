"""What ``--dtype q4`` does with rows: (1) how much a token's logits move when it sits first in a
tree of n nodes instead of alone, per dtype (``q4:fp32`` / ``q4:bf16``: q4 on our kernel or on
torch's; the reason torch's is lossless only like bf16); (2) what the decoder's linears cost at r
rows on our q4 kernel, torch's int4 kernel and packed fp16 (the real model's seven shapes, times
its 30 layers, eager calls; ours also checked row-independent on these shapes).

    python experiments/q4_rows.py --dtypes packed-fp16,q4:fp32,q4:bf16,float32 --sizes 2,4,8,16 \
        --rows 1,2,4,8,16,32,64,128 --prompts 8 --threads 2 --out experiments/results/q4_rows_kernels

Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from specblock.policies.tree import DraftTree
from specblock.q4file import quantize_q4_1
from specblock.runtime import q4, q4_kernel
from specblock.runtime.config import validate
from specblock.runtime.packed import prepack
from specblock.runtime.target import TargetModel

#: The real model's decoder linears (out, in): q, k, v, o, gate, up, down.
SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]


def logit_moves(target: TargetModel, sizes: list[int], prompts: int) -> dict[int, list[float]]:
    """Per n, per random prompt: max |logit difference| of the first node of a chain of n nodes
    against the same token alone (the chain's other nodes cannot be seen by the first)."""
    out: dict[int, list[float]] = {n: [] for n in sizes}
    for seed in range(prompts):
        rng = np.random.default_rng(seed)
        prompt = rng.integers(3, target.vocab_size, int(rng.integers(20, 200)))

        def first_row(n: int) -> torch.Tensor:
            target.prefill(prompt)
            toks = rng.integers(3, target.vocab_size, n)
            toks[0] = 777
            return target.tree_forward(DraftTree.from_parents(toks, np.arange(-1, n - 1))).logits[0].float().clone()

        alone = first_row(1)
        for n in sizes:
            out[n].append(float((first_row(n) - alone).abs().max()))
    return out


def median_ms(fns, reps: int) -> float:
    """Median ms of one pass over ``fns`` (after one warm-up pass)."""
    for f in fns:
        f()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for f in fns:
            f()
        ts.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(ts))


def load(path: Path, name: str) -> TargetModel:
    """``q4:KERNEL`` loads q4 on that kernel; other names are dtypes."""
    dtype, _, kernel = name.partition(":")
    if not kernel:
        return TargetModel.load(path, dtype)
    default = q4.default_kernel
    q4.default_kernel = lambda: kernel
    try:
        return TargetModel.load(path, dtype)
    finally:
        q4.default_kernel = default


def linear_ms(rows: list[int], reps: int) -> tuple[dict[str, dict[int, float]], bool | None]:
    """Median ms of one layer's seven linears x 30: our q4 kernel (fp32 in and out, where it runs),
    torch's int4 kernel (bf16 in and out), packed fp16 (fp32); and whether ours gave each row the
    same result alone as in the call (None where it does not run)."""
    ours = q4_kernel.load()
    names = (["q4 fp32 kernel (ours)"] if ours else []) + ["q4 bf16 kernel (torch)", "packed-fp16 (fbgemm)"]
    out: dict[str, dict[int, float]] = {k: {} for k in names}
    row_independent = True if ours else None
    for r in rows:
        calls: dict[str, list] = {k: [] for k in names}
        for n, k in SHAPES:
            lin = torch.nn.Linear(k, n, bias=False)
            qs, d, m = quantize_q4_1(lin.weight.detach())
            x = torch.randn(r, k)
            if ours:
                qb, dm = q4_kernel.layout(qs, d, m)
                calls[names[0]].append(lambda x=x, qb=qb, dm=dm: q4_kernel.linear(x, qb, dm))
                together = q4_kernel.linear(x, qb, dm)
                row_independent &= all(torch.equal(q4_kernel.linear(x[i:i + 1], qb, dm)[0], together[i]) for i in range(r))
            packed4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
            scale_zero = torch.randn(k // 32, n, 2).bfloat16()
            calls["q4 bf16 kernel (torch)"].append(lambda x=x, p=packed4, s=scale_zero: torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.bfloat16(), p, 32, s).float())
            pk = prepack(lin)
            calls["packed-fp16 (fbgemm)"].append(lambda x=x, p=pk: torch.ops.quantized.linear_dynamic_fp16(x, p))
        for _ in range(2):  # interleaved: each kernel twice, the lower median kept
            for name, fns in calls.items():
                ms = round(30 * median_ms(fns, reps), 2)
                out[name][r] = min(ms, out[name].get(r, ms))
        print(f"{r} rows: " + ", ".join(f"{k} {v[r]} ms" for k, v in out.items()), flush=True)
    return out, row_independent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", default="packed-fp16,q4:fp32,q4:bf16,float32")
    ap.add_argument("--sizes", default="2,4,8,16")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--prompts", type=int, default=8, help="random prompts (20-200 tokens) for the logit moves")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("experiments/results/q4_rows"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = validate({"target": args.target}).target_dir
    sizes = [int(n) for n in args.sizes.split(",")]
    moves = {}
    for dtype in args.dtypes.split(","):
        moves[dtype] = logit_moves(load(path, dtype), sizes, args.prompts)
        print(dtype, moves[dtype], flush=True)
    rows = [int(r) for r in args.rows.split(",")]
    lin, row_independent = linear_ms(rows, args.reps)
    lines = [f"`python experiments/q4_rows.py --dtypes {args.dtypes} --sizes {args.sizes} --rows {args.rows} "
             f"--reps {args.reps} --prompts {args.prompts} --threads {args.threads} --out {args.out}` ({args.target}, eager)",
             "", f"Max |logit difference| of a token first in a chain of n nodes against the same token alone, over "
             f"{args.prompts} random prompts: largest, median, and prompts where it exceeded 0.01:", "",
             "| dtype | " + " | ".join(f"n = {n}" for n in sizes) + " |", "|---" * (len(sizes) + 1) + "|"]
    lines += [f"| {d} | " + " | ".join(f"{max(v[n]):.3g} / {float(np.median(v[n])):.3g} / {sum(x > 0.01 for x in v[n])}"
                                       for n in sizes) + " |" for d, v in moves.items()]
    lines += ["", f"The decoder's linears (seven shapes x 30 layers), median ms of {args.reps} (interleaved twice, the "
              f"lower kept); our kernel row-independent on these shapes: {row_independent}:", "",
              "| rows | " + " | ".join(str(r) for r in rows) + " |", "|---" * (len(rows) + 1) + "|"]
    lines += [f"| {k} | " + " | ".join(f"{v[r]:.1f}" for r in rows) + " |" for k, v in lin.items()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"logit_moves": moves, "linears_ms": lin, "row_independent": row_independent,
                                                         "threads": args.threads},
                                                        indent=1) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
