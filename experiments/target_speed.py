"""The target's forward time for n = 1..64 tree tokens: bf16 vs fp32 vs packed-fp16, sdpa vs eager, a few contexts.

The runtime's default dtype and tree budget follow from this: T(n)/T(1) says how much a bigger
tree costs to verify. Medians of ``--reps`` forwards with the KV cache holding ``ctx`` tokens.

    python experiments/target_speed.py [--target DIR] [--reps 15] [--threads 2] [--dtypes ...] [--attn sdpa,eager]

Writes experiments/results/target_speed.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from specblock.runtime.calibrate import N_GRID, time_target
from specblock.runtime.config import validate
from specblock.runtime.target import TargetModel, native_bf16


def cpu_model() -> str:
    """The CPU's name from /proc/cpuinfo (Linux), so a table says which machine it was measured on."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", help="a model name (see `models`) or directory; default: the real chat model")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--ctx", default="128,512")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", default="bfloat16,float32,packed-fp16")
    ap.add_argument("--attn", default="sdpa,eager")
    ap.add_argument("--out", type=Path, default=Path("experiments/results/target_speed"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = validate({"target": args.target}).target_dir
    ctxs = [int(c) for c in args.ctx.split(",")]
    rng = np.random.default_rng(0)
    rows = []
    for dtype in args.dtypes.split(","):
        for attn in args.attn.split(","):
            target = TargetModel.load(path, dtype, "cpu", attn)
            time_target(target, ctxs[0], 8, 3, rng)  # warm-up
            for ctx in ctxs:
                ms = [time_target(target, ctx, n, args.reps, rng)[0] for n in N_GRID]
                rows.append({"dtype": dtype, "attn": attn, "ctx": ctx, "n": N_GRID, "ms": [round(x, 3) for x in ms],
                             "ratio": [round(x / ms[0], 3) for x in ms]})
                print(json.dumps(rows[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    cpu = {"native_bf16": native_bf16(torch.device("cpu")), "model": cpu_model()}
    args.out.with_suffix(".json").write_text(json.dumps({"threads": args.threads, "cpu": cpu, "rows": rows}, indent=1))
    head = "| dtype | attn | ctx | T(1) ms | " + " | ".join(f"T({n})/T(1)" for n in N_GRID[1:]) + " |"
    lines = [f"{cpu['model']}, native bf16: {cpu['native_bf16']}, {args.threads} threads (`python experiments/target_speed.py "
             f"--dtypes {args.dtypes} --attn {args.attn} --ctx {args.ctx} --reps {args.reps} --threads {args.threads} "
             f"--out {args.out}`).", "", head, "|---" * (4 + len(N_GRID) - 1) + "|"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['attn']} | {r['ctx']} | {r['ms'][0]:.2f} | " + " | ".join(f"{x:.2f}" for x in r["ratio"][1:]) + " |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for r in rows:
        ax.plot(r["n"], r["ms"], marker="o", ms=3, label=f"{r['dtype']} {r['attn']} ctx {r['ctx']}")
    ax.set_xlabel("tree tokens per forward (n)")
    ax.set_ylabel("target forward (ms, median)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
