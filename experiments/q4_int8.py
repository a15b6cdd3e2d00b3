"""q4's int8 kernel (activations rounded to int8 per row and group of 32, AVX512-VNNI) against its fp32
kernel on the real model: compiled tree forwards interleaved in one process, and how often the two
models pick the same next token.

    python experiments/q4_int8.py --sizes 1,2,4,8,16 --reps 30 --threads 2 --out experiments/results/q4_int8

Why: at one row both kernels read the same 4-bit weights and wait on memory, but from a few rows on the
fp32 kernel is bound by fp32 multiply-adds (16 a cycle-port), while VNNI's integer multiply-adds do 64,
so tree verification (T(n) for n > 1) is where the int8 kernel should gain. Its activations are
rounded, so it is another model (ggml's own Q4_1 x Q8_1 arithmetic, what llama.cpp runs); the
agreement table says how close: teacher-forced over the fp32 model's greedy answers to the bench's
chat prompts, the share of positions where both models' argmax agree, and the mean absolute logit
difference. Both kernels' rows are independent, but the int8 rounding turns tiny fp32 differences
elsewhere into whole steps; when this was written that made the int8 model lossless only like bf16
(``experiments/q4_partings.py``) and opt-in (``SPECBLOCK_Q4_KERNEL=int8``). ``runtime/exact_parts.py``
has since made it lossless like fp32, and q4's default where the CPU has VNNI (``SPECBLOCK_Q4_KERNEL=fp32``
picks the other kernel).
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
from specblock.runtime import q4, q4_kernel
from specblock.runtime.cli import load_tokenizer
from specblock.runtime.config import validate
from specblock.runtime.target import TargetModel


def load(path: Path, kernel: str) -> TargetModel:
    old = os.environ.get("SPECBLOCK_Q4_KERNEL")
    os.environ["SPECBLOCK_Q4_KERNEL"] = kernel
    try:
        return TargetModel.load(path, "q4")
    finally:
        if old is None:
            del os.environ["SPECBLOCK_Q4_KERNEL"]
        else:
            os.environ["SPECBLOCK_Q4_KERNEL"] = old


def agreement(models: dict[str, TargetModel], tok, prompts: int, tokens: int) -> dict:
    """Teacher-forced over the fp32 model's greedy answers: top-1 agreement and logit differences."""
    from specblock.prompts import load_prompts
    from specblock.runtime.chat import encode_prompt

    ref, other = models["fp32"], models["int8"]
    same = total = 0
    diffs = []
    for p in load_prompts("chat", prompts):
        ids = encode_prompt(tok, p)
        seq = torch.tensor([ids])
        with torch.no_grad():
            out = ref.model.generate(seq, max_new_tokens=tokens, do_sample=False, pad_token_id=tok.eos_token_id)
            a = ref.model(out).logits[0, len(ids) - 1:-1]
            b = other.model(out).logits[0, len(ids) - 1:-1]
        same += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += a.shape[0]
        diffs.append((a - b).abs().mean().item())
    return {"positions": total, "top1_agreement": round(same / total, 4), "mean_abs_logit_diff": round(float(np.mean(diffs)), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--sizes", default="1,2,4,8,16")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--ctx", type=int, default=192)
    ap.add_argument("--prompts", type=int, default=8, help="chat prompts for the agreement table")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens a prompt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("experiments/results/q4_int8"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not (q4_kernel.load() and q4_kernel.vnni_supports()):
        raise SystemExit("the int8 q4 kernel needs AVX512-VNNI (and our kernels AVX512F/BW)")
    path = validate({"target": args.target}).target_dir
    kernels = ("int8", "fp32")
    models = {k: load(path, k) for k in kernels}
    assert all(m.kernel == k for k in kernels for m in models[k].model.modules() if isinstance(m, q4.Int4Linear))
    agree = agreement(models, load_tokenizer(path, False), args.prompts, args.tokens)
    print(agree, flush=True)
    targets = {k: StaticTarget.wrap(models[k]) for k in kernels}
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, targets["fp32"].vocab_size, args.ctx)
    for t in targets.values():
        t.prefill(prompt)

    def forward(k: str, tree: DraftTree) -> float:
        t = targets[k]
        t0 = time.perf_counter()
        t.tree_forward(tree)
        dt = time.perf_counter() - t0
        t.past_len = args.ctx
        return dt

    rows = {}
    for n in (int(x) for x in args.sizes.split(",")):
        tree = DraftTree.from_parents(rng.integers(3, targets["fp32"].vocab_size, n), np.arange(-1, n - 1))
        for k in kernels:  # first calls compile or load
            forward(k, tree)
        ts: dict[str, list[float]] = {k: [] for k in kernels}
        for _ in range(args.reps):
            for k in kernels:
                ts[k].append(forward(k, tree))
        rows[n] = {k: round(1e3 * float(np.median(v)), 2) for k, v in ts.items()}
        print(n, rows[n], flush=True)
    t1 = rows.get(1)
    lines = [f"`python experiments/q4_int8.py --sizes {args.sizes} --reps {args.reps} --prompts {args.prompts} "
             f"--tokens {args.tokens} --threads {args.threads} --out {args.out}` ({args.target}, compiled, --dtype q4, "
             f"context {args.ctx}; median ms of interleaved tree forwards)", "",
             "| n | int8 kernel | fp32 kernel | fp32 / int8 |" + (" int8 T(n)/T(1) | fp32 T(n)/T(1) |" if t1 else ""),
             "|---|---|---|---|" + ("---|---|" if t1 else "")]
    for n, r in rows.items():
        line = f"| {n} | {r['int8']:.2f} | {r['fp32']:.2f} | {r['fp32'] / r['int8']:.2f} |"
        if t1:
            line += f" {r['int8'] / t1['int8']:.2f} | {r['fp32'] / t1['fp32']:.2f} |"
        lines.append(line)
    lines += ["", f"Agreement over {agree['positions']} positions ({args.prompts} held-out chat prompts, the fp32 model's "
              f"{args.tokens} greedy tokens each): top-1 {100 * agree['top1_agreement']:.2f}%, mean |logit difference| "
              f"{agree['mean_abs_logit_diff']}."]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"target": args.target, "ctx": args.ctx, "rows": rows,
                                                         "agreement": agree}, indent=1) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
