"""Why T(1) sits above the bandwidth floor even compiled: the one-token forward is a row of
matrix-vector products (GEMVs), and at these thin shapes the CPU's GEMV kernels read weights far
slower than a streaming sum does. Times ``F.linear`` on one token for every weight shape of the
target, in bf16 and fp32, as eager torch (oneDNN/MKL) runs them; sums them over the model's
layers into a GEMV-only T(1) to set beside the measured T(1) (compiled_speed.py).

    python experiments/gemv_floor.py --targets lab,smollm2-135m-instruct [--threads 1]

Writes experiments/results/gemv_floor.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specblock.atomic import write_atomic
from specblock.runtime.config import validate
from specblock.runtime.target import TargetModel


def linear_shapes(model: torch.nn.Module) -> Counter:
    """(out, in) of every Linear the forward runs once per token, with how often it runs."""
    shapes = Counter()
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            shapes[tuple(m.weight.shape)] += 1
    return shapes


def time_linear(out_f: int, in_f: int, dtype: torch.dtype, reps: int) -> float:
    x = torch.randn(1, in_f, dtype=dtype)
    w = torch.randn(out_f, in_f, dtype=dtype)
    for _ in range(3):
        F.linear(x, w)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        F.linear(x, w)
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def run(name: str, reps: int) -> dict:
    path = validate({"target": name}).target_dir
    model = TargetModel.load(path, "bfloat16", "cpu").model
    rows, total = [], {"bfloat16": 0.0, "float32": 0.0}
    for (o, i), count in sorted(linear_shapes(model).items()):
        row = {"shape": [o, i], "per_token": count}
        for dt in (torch.bfloat16, torch.float32):
            s = time_linear(o, i, dt, reps)
            key = str(dt).removeprefix("torch.")
            row[f"{key}_us"] = round(1e6 * s, 1)
            row[f"{key}_gbs"] = round(o * i * dt.itemsize / s / 1e9, 1)
            total[key] += count * s
        rows.append(row)
        print(name, row, flush=True)
    return {"target": name, "rows": rows, "gemv_T1_ms": {k: round(1e3 * v, 2) for k, v in total.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default="lab")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", type=Path, default=Path("experiments/results/gemv_floor"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = [run(t.strip(), args.reps) for t in args.targets.split(",") if t.strip()]
    md = [f"One-token `F.linear` per weight shape, {args.threads} thread(s), median of {args.reps} "
          f"(`python experiments/gemv_floor.py --targets {args.targets} --threads {args.threads}`):", ""]
    for r in results:
        md += [f"## {r['target']}: GEMVs alone take {r['gemv_T1_ms']['bfloat16']:.2f} ms per token in bf16, "
               f"{r['gemv_T1_ms']['float32']:.2f} ms in fp32", "",
               "| weight (out, in) | per token | bf16 us | bf16 GB/s | fp32 us | fp32 GB/s |", "|---|---|---|---|---|---|"]
        md += [f"| {tuple(x['shape'])} | {x['per_token']} | {x['bfloat16_us']} | {x['bfloat16_gbs']} | "
               f"{x['float32_us']} | {x['float32_gbs']} |" for x in r["rows"]]
        md.append("")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for suffix, text in ((".json", json.dumps({"threads": args.threads, "results": results}, indent=1) + "\n"),
                         (".md", "\n".join(md))):
        write_atomic(args.out.with_name(args.out.name + suffix), text)
    print("\n".join(md))


if __name__ == "__main__":
    main()
