"""Eager prefill time (one forward over the whole prompt) of the target at several ``--dtype``s.

Why: packed-q4-amx takes a call's rows 16 at a time and decodes the weights again for each pass, so a
long prompt pays that decoding once per 16 tokens; since it became ``auto``'s choice on AMX machines,
its time to the first token must not fall behind packed fp16's (fbgemm's GEMM reads its weights once).
Medians of ``--reps`` forwards after one warm-up, the dtypes one after another.

    python experiments/prefill_dtypes.py --dtypes packed-fp16,packed-q4-amx --lengths 128,512,1024 \\
        --out experiments/results/prefill_dtypes
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specblock.atomic import write_atomic  # noqa: E402
from specblock.models import resolve_target  # noqa: E402
from specblock.runtime.target import TargetModel  # noqa: E402


def prefill_ms(target: TargetModel, n: int, reps: int) -> float:
    ids = torch.randint(10, target.model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
    times = []
    with torch.no_grad():
        target.model(ids)  # warm-up
        for _ in range(reps):
            t0 = time.perf_counter()
            target.model(ids)
            times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", default="packed-fp16,packed-q4-amx")
    ap.add_argument("--lengths", default="128,512,1024")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_target(args.target)
    lengths = [int(n) for n in args.lengths.split(",")]
    rows = []
    for dtype in args.dtypes.split(","):
        target = TargetModel.load(path, dtype, "cpu")
        rows.append({"dtype": target.dtype_name, "ms": {n: round(prefill_ms(target, n, args.reps), 1) for n in lengths}})
        del target
    cmd = (f"python experiments/prefill_dtypes.py --target {args.target} --dtypes {args.dtypes} --lengths {args.lengths} "
           f"--reps {args.reps} --threads {args.threads} --out {args.out.as_posix()}")
    lines = [f"Eager prefill, one forward over the prompt, ms, medians of {args.reps} (`{cmd}`).", "",
             "| dtype | " + " | ".join(f"{n} tokens" for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
    lines += [f"| {r['dtype']} | " + " | ".join(f"{r['ms'][n]:.1f}" for n in lengths) + " |" for r in rows]
    write_atomic(args.out.with_suffix(".json"), json.dumps({"rows": rows, "threads": args.threads}, indent=1))
    write_atomic(args.out.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
