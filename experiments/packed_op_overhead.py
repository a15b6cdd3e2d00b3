"""What the op a compiled packed-fp16 graph calls costs over fbgemm's kernel itself, per call.

Why: a compiled packed-fp16 forward reaches each linear through ``specblock::packed_linear``
(``runtime/packed.py``), a Python-implemented op, 211 calls per forward of the real model. Its
registration decides the overhead: the ``torch.library.custom_op`` decorator wraps the function
in autograd and schema-checking layers; the plain ``torch.library.Library`` registration (what
the project uses) dispatches straight to it. This times, interleaved, on the real model's linear
shapes at one token:

- ``direct``: ``quantized::linear_dynamic_fp16`` on the packed weight (eager's call);
- ``library``: ``specblock::packed_linear`` as shipped;
- ``custom_op``: the same function behind ``torch.library.custom_op`` (the previous registration).

    python experiments/packed_op_overhead.py [--threads 2] [--reps 2000] [--out experiments/results/packed_op_overhead]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specblock.atomic import write_atomic  # noqa: E402
from specblock.runtime import packed  # noqa: E402

#: SmolLM2-135M's linears (in -> out): q/o, k/v, gate/up, down; calls per forward in brackets.
SHAPES = {"q_proj/o_proj": (576, 576, 60), "k_proj/v_proj": (576, 192, 60), "gate/up_proj": (576, 1536, 60),
          "down_proj": (1536, 576, 30)}


@torch.library.custom_op("specblock_bench::packed_linear_decorated", mutates_args=())
def _decorated(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return torch.ops.quantized.linear_dynamic_fp16(x, packed._PACKED[key])


@_decorated.register_fake
def _(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def time_calls(fn, reps: int) -> float:
    """Mean microseconds per call over ``reps`` back-to-back calls."""
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path, default=ROOT / "experiments/results/packed_op_overhead")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    with torch.no_grad():
        for name, (fin, fout, calls) in SHAPES.items():
            lin = packed.PackedLinear(torch.nn.Linear(fin, fout, bias=False).requires_grad_(False))
            x = torch.randn(1, fin)
            ways = {"direct": lambda: torch.ops.quantized.linear_dynamic_fp16(x, lin._packed),
                    "library": lambda: packed.packed_linear(x, lin._key, fout),
                    "custom_op": lambda: _decorated(x, lin._key, fout)}
            assert all(torch.equal(f(), ways["direct"]()) for f in ways.values())
            for f in ways.values():  # warm-up
                time_calls(f, args.reps // 10)
            us = {w: [] for w in ways}
            for _ in range(args.rounds):  # interleaved: a load change hits every way alike
                for w, f in ways.items():
                    us[w].append(time_calls(f, args.reps))
            med = {w: float(np.median(v)) for w, v in us.items()}
            rows.append({"linear": name, "in": fin, "out": fout, "calls_per_forward": calls, **{f"{w}_us": round(m, 2)
                         for w, m in med.items()}})
    per_fwd = {w: sum((r[f"{w}_us"] - r["direct_us"]) * r["calls_per_forward"] for r in rows) / 1e3
               for w in ("library", "custom_op")}
    result = {"threads": args.threads, "reps": args.reps, "rounds": args.rounds, "rows": rows,
              "overhead_ms_per_forward": {w: round(v, 2) for w, v in per_fwd.items()}}
    md = [f"Per-call cost of the packed fp16 GEMM at one token, {args.threads} threads, medians of {args.rounds} "
          f"interleaved rounds of {args.reps} calls (`python experiments/packed_op_overhead.py --threads {args.threads}`):",
          "", "| linear (in -> out) | calls / forward | direct us | library op us | custom_op us |", "|---|---|---|---|---|"]
    md += [f"| {r['linear']} ({r['in']} -> {r['out']}) | {r['calls_per_forward']} | {r['direct_us']:.1f} | "
           f"{r['library_us']:.1f} | {r['custom_op_us']:.1f} |" for r in rows]
    md += ["", f"Over the direct kernel, per forward of the real model's 210 decoder linears (the LM head not counted): "
           f"library op {per_fwd['library']:.2f} ms, custom_op {per_fwd['custom_op']:.2f} ms."]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out.with_suffix(".json"), json.dumps(result, indent=1) + "\n")
    write_atomic(args.out.with_suffix(".md"), "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
