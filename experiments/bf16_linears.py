"""Would oneDNN's bf16 GEMM beat fbgemm's packed fp16 for the real model's linears on a CPU with
native bf16 (AVX512-BF16)? Why asked: past 8 tree rows the compiled packed-fp16 target is bound by
fp32 multiply-adds (T(16) about 2.2x T(1)), and AVX512-BF16's dot products do twice as many per
instruction. Two measurements:

1. Each linear shape of the real model alone, with weights cold (enough copies to stream from
   memory, as a forward does): fbgemm's packed fp16 (what ``--dtype packed-fp16`` runs), oneDNN's
   bf16 on a prepacked weight (``mkldnn._linear_pointwise``, what inductor's freezing emits) and
   plain bf16 ``F.linear``.
2. ``--in-model``: the compiled real model at packed-fp16 with its MLP and head linears moved to
   the prepacked bf16 GEMM (inputs rounded to bf16, outputs back to fp32) against the same model
   all packed-fp16, both calling their GEMM through a Python-kernel op (the same per-call cost),
   T(n) interleaved.

    python experiments/bf16_linears.py [--in-model] --out experiments/results/bf16_linears
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

SHAPES = {"q/o": (576, 576), "k/v": (576, 192), "gate/up": (576, 1536), "down": (1536, 576), "head": (576, 49152)}
_WEIGHTS: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
_KEYS = itertools.count()


def cold_us(call, copies: int, reps: int = 5) -> float:
    """Microseconds a call, each call on the next of ``copies`` weights (cycled: none stays in cache)."""
    for i in range(copies):
        call(i)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for i in range(copies):
            call(i)
        ts.append((time.perf_counter() - t0) / copies)
    return 1e6 * float(np.median(ts))


def per_linear(rows: list[int], budget_mb: int = 256) -> dict:
    warnings.filterwarnings("ignore", message=".*fbgemm.*deprecated")
    out = {}
    for name, (i, o) in SHAPES.items():
        copies = max(2, budget_mb * 2**20 // (i * o * 2))
        ws = [torch.randn(o, i) * 0.02 for _ in range(copies)]
        fp16 = [torch.ops.quantized.linear_prepack_fp16(w, None) for w in ws]
        bf16 = [w.bfloat16() for w in ws]
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w) for w in bf16]
        res = {}
        for m in rows:
            x = torch.randn(m, i)
            xb = x.bfloat16()
            res[m] = {
                "packed fp16 (fbgemm)": cold_us(lambda k: torch.ops.quantized.linear_dynamic_fp16(x, fp16[k]), copies),
                "bf16 prepacked (oneDNN)": cold_us(
                    lambda k: torch.ops.mkldnn._linear_pointwise(xb, onednn[k], None, "none", [], ""), copies),
                "bf16 F.linear": cold_us(lambda k: torch.nn.functional.linear(xb, bf16[k]), copies),
            }
            print(name, m, {k: round(v, 1) for k, v in res[m].items()}, flush=True)
        out[name] = {"in_out": [i, o], "copies": copies, "us": res}
        del ws, fp16, bf16, onednn
    return out


# --- in-model: the MLP and head linears on oneDNN's bf16 GEMM ------------------------------------------
_LIB = torch.library.Library("bf16_linears_exp", "DEF")
_LIB.define("linear(Tensor x, int key, int out_features) -> Tensor")
_LIB.impl("linear", lambda x, key, out: torch.ops.mkldnn._linear_pointwise(x, *_WEIGHTS[key], "none", [], ""), "CPU")
torch.library.register_fake("bf16_linears_exp::linear", lambda x, key, out: x.new_empty((*x.shape[:-1], out)), lib=_LIB)


class OnednnBf16Linear(nn.Module):
    """A linear on oneDNN's prepacked bf16 weight; fp32 around it (the casts fuse into inductor's kernels)."""

    def __init__(self, lin: nn.Module) -> None:
        super().__init__()
        self.out_features = lin.out_features
        self.key = next(_KEYS)
        bias = None if lin.bias is None else lin.bias.detach().bfloat16()
        _WEIGHTS[self.key] = (torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach().bfloat16().contiguous()), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.bf16_linears_exp.linear(x.to(torch.bfloat16), self.key, self.out_features).to(x.dtype)


def in_model(sizes: list[int], reps: int, names: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj", "lm_head")) -> dict:
    from compiled_speed import time_trees

    from specblock.compiled.target import StaticTarget
    from specblock.runtime.config import validate
    from specblock.runtime.packed import PackedLinear
    from specblock.runtime.target import TargetModel

    path = validate({"target": "smollm2-135m-instruct"}).target_dir
    mixed = TargetModel.load(path, "packed-fp16", "cpu")
    swap = [(m, n, c) for m in list(mixed.model.modules()) for n, c in m.named_children()
            if isinstance(c, PackedLinear) and n in names]
    for m, n, c in swap:
        setattr(m, n, OnednnBf16Linear(c))
    targets = {  # Python-kernel ops on both sides; neither saved (a pinned op does not pickle into saved guards)
        "packed-fp16": StaticTarget.wrap(TargetModel.load(path, "packed-fp16", "cpu"), compile=True, native=False,
                                         fuse=False, saved=False),
        "MLP and head on bf16": StaticTarget.wrap(mixed, compile=True, native=False, fuse=False, saved=False),
    }
    return {"swapped": len(swap), "names": list(names), "n": sizes, "T_ms": time_trees(targets, 192, sizes, reps)}


def markdown(res: dict, cmd: str) -> str:
    lines = [f"oneDNN bf16 against fbgemm packed fp16 for the real model's linears, this CPU (`{cmd}`).", ""]
    for name, r in res["per_linear"].items():
        rows = list(r["us"])
        kinds = list(r["us"][rows[0]])
        lines += [f"**{name}** {r['in_out'][0]} -> {r['in_out'][1]}, us a call, weights cold ({r['copies']} copies cycled):", "",
                  "| rows | " + " | ".join(kinds) + " |", "|---" * (len(kinds) + 1) + "|"]
        lines += [f"| {m} | " + " | ".join(f"{r['us'][m][k]:.1f}" for k in kinds) + " |" for m in rows]
        lines.append("")
    if res.get("in_model"):
        im = res["in_model"]
        lines += [f"Compiled real model, T(n) in ms, median of interleaved forwards ({im['swapped']} linears moved: "
                  f"{', '.join(im['names'])}):", "", "| target | " + " | ".join(str(n) for n in im["n"]) + " |",
                  "|---" * (len(im["n"]) + 1) + "|"]
        lines += [f"| {k} | " + " | ".join(f"{x:.2f}" for x in v) + " |" for k, v in im["T_ms"].items()]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--in-model", action="store_true")
    ap.add_argument("--sizes", default="1,8,16")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("experiments/results/bf16_linears"))
    args = ap.parse_args()
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        raise SystemExit("this CPU has no native bf16 for oneDNN; nothing to compare")
    torch.set_num_threads(args.threads)
    res = {"threads": args.threads, "per_linear": per_linear([int(r) for r in args.rows.split(",")])}
    if args.in_model:
        res["in_model"] = in_model([int(n) for n in args.sizes.split(",")], args.reps)
    cmd = (f"python experiments/bf16_linears.py --rows {args.rows}{' --in-model --sizes ' + args.sizes if args.in_model else ''}"
           f" --reps {args.reps} --threads {args.threads} --out {args.out}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(res, indent=1, default=str))
    args.out.with_suffix(".md").write_text(markdown(res, cmd))
    print(markdown(res, cmd))


if __name__ == "__main__":
    main()
