"""An eager prompt's attention: the fused op (``grouped_rows.EXACT_PROMPT``, what q4's int8 kernel
needs to be lossless across eager and compiled) against SDPA (HF's causal flag, the default
elsewhere). Times ``TargetModel.prefill`` of random prompts of each length on the real model, the
two taking turns; reports the best of ``--reps`` each.

    python experiments/prompt_attention.py --dtype packed-fp16 --lengths 128,512,1500 --reps 2 \
        --out experiments/results/prompt_attention
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))  # results_io beside it, however it is loaded

from specblock.models import resolve_target  # noqa: E402
from specblock.runtime.grouped_rows import mark_exact_prompts  # noqa: E402
from specblock.runtime.target import TargetModel  # noqa: E402
from results_io import write_results  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="packed-fp16")
    ap.add_argument("--lengths", default="128,512,1500")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "prompt_attention")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = TargetModel.load(resolve_target("smollm2-135m-instruct"), args.dtype, "cpu")
    rng = np.random.default_rng(0)
    rows = []
    for n in (int(x) for x in args.lengths.split(",")):
        prompt = rng.integers(3, target.vocab_size, n)
        best = {"op": float("inf"), "sdpa": float("inf")}
        for _ in range(args.reps):
            for name in best:
                mark_exact_prompts(target.model, name == "op")
                t0 = time.perf_counter()
                target.prefill(prompt)
                best[name] = min(best[name], time.perf_counter() - t0)
        rows.append({"tokens": n, "op_ms": round(1e3 * best["op"], 1), "sdpa_ms": round(1e3 * best["sdpa"], 1)})
        print(rows[-1], flush=True)
    cmd = (f"`python experiments/prompt_attention.py --dtype {args.dtype} --lengths {args.lengths} --reps {args.reps} "
           f"--threads {args.threads} --out {args.out}`")
    lines = [f"{cmd}: one eager prefill of a random prompt on the real model, best of {args.reps}, the two taking turns", "",
             "| prompt tokens | fused op ms | SDPA ms | op / SDPA |", "|---|---|---|---|"]
    lines += [f"| {r['tokens']} | {r['op_ms']} | {r['sdpa_ms']} | {r['op_ms'] / r['sdpa_ms']:.2f} |" for r in rows]
    write_results(args.out, args, rows, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
