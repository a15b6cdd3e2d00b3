"""The fp16 kernel (``SPECBLOCK_FP16_KERNEL=ours``) against fbgemm on the real model's own packed
weights, one forward's linears in order as a compiled graph calls them (q/k/v and gate/up as one
fused call each, o, down, the head), interleaved in one process; median ms over reps.

Why: ``fp16_kernel_probe.py`` times bare unfused calls on random weights with a library of its own
(built at -O3), yet the compiled forward on the native library's kernel was slower at first
(``compiled_speed_fp16_kernel_s66.md``): this isolates the linears, as the graph calls them
(``fp16_kernel_forward_s66.md`` at -O2, ``fp16_kernel_forward_o3_s66.md`` at -O3).

    python experiments/fp16_kernel_forward.py --rows 1,4,8 --reps 12 --out experiments/results/fp16_kernel_forward_s66
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from specblock.compiled import native
from specblock.runtime.config import validate
from specblock.runtime.target import TargetModel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("experiments/results/fp16_kernel_forward"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not native.use_native_kernel():
        raise SystemExit("error: the C++ packed-linear library did not build")
    t = TargetModel.load(validate({"target": "smollm2-135m-instruct"}).target_dir, "packed-fp16", "cpu")
    calls = []
    for layer in t.model.model.layers:
        a, f = layer.self_attn, layer.mlp
        calls += [([a.q_proj._key, a.k_proj._key, a.v_proj._key], a.q_proj.in_features,
                   a.q_proj.out_features + a.k_proj.out_features + a.v_proj.out_features),
                  ([a.o_proj._key], a.o_proj.in_features, a.o_proj.out_features),
                  ([f.gate_proj._key, f.up_proj._key], f.gate_proj.in_features, 2 * f.gate_proj.out_features),
                  ([f.down_proj._key], f.down_proj.in_features, f.down_proj.out_features)]
    head = t.model.lm_head
    calls.append(([head._key], head.in_features, head.out_features))
    ops = torch.ops.specblock_native

    def forward(rows: int) -> float:
        xs = {k: torch.randn(rows, k) for k in {c[1] for c in calls}}
        t0 = time.perf_counter()
        for keys, k, n in calls:
            ops.packed_linear(xs[k], keys[0], n) if len(keys) == 1 else native.packed_linear_cat(xs[k], keys, n)
        return time.perf_counter() - t0

    results = {}
    for rows in (int(r) for r in args.rows.split(",")):
        ts: dict[str, list[float]] = {"fbgemm": [], "fp16 kernel": []}
        for rep in range(args.reps + 1):
            for label in ts:
                native.set_fp16_kernel(label == "fp16 kernel")
                dt = forward(rows)
                if rep:  # the first builds the kernel's weight copies
                    ts[label].append(dt)
        native.set_fp16_kernel(False)
        results[rows] = {k: round(1e3 * float(np.median(v)), 2) for k, v in ts.items()}
        print(rows, results[rows], flush=True)
    lines = [f"`python experiments/fp16_kernel_forward.py --rows {args.rows} --reps {args.reps} --threads {args.threads} "
             f"--out {args.out}`: the real model's packed weights, one forward's {len(calls)} linear calls in order "
             "(q/k/v and gate/up fused), median ms, interleaved.", "", "| rows | fbgemm | fp16 kernel |", "|---|---|---|"]
    lines += [f"| {r} | {v['fbgemm']:.2f} | {v['fp16 kernel']:.2f} |" for r, v in results.items()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"rows": results}, indent=1) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
