"""One forward's linears, eagerly, in sequence (each weight read once, as a forward reads them) against
the same calls on one layer's weights (cache-hot): how much a kernel waits on its weights' stream.

    python experiments/linear_streams.py --rows 1,4,8 --reps 15 --threads 2 --out experiments/results/linear_streams

The real model's shapes (SmolLM2-135M: 30 layers of q/k/v/o, gate/up/down, and the 49152 x 576 head) with random
weights, for fbgemm's packed fp16 (``--dtype packed-fp16``), our fp32 q4 kernel with and without its prefetch
and, where the CPU has AVX512-VNNI, our int8 q4 kernel (``--dtype q4``: Q4_1 layers, Q8_0 head). Why: q4's
prefetch took its compiled T(4) from 24 to 15 ms on a Xeon (``q4_prefetch.md``); this says whether
packed-fp16's linears stall the same way, before anyone writes a kernel for them. Settings interleaved;
medians.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from specblock.q4file import quantize_q4_1, quantize_q8_0
from specblock.runtime import packed, q4_kernel

H, I, KV, LAYERS, VOCAB = 576, 1536, 192, 30, 49152
LAYER = [(H, H), (KV, H), (KV, H), (H, H), (I, H), (I, H), (H, I)]  # (out, in): q, k, v, o, gate, up, down
SHAPES = LAYER * LAYERS + [(VOCAB, H)]  # one forward's linears in order, the head last


def random_weights(g: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(n, k, generator=g) * 0.05 for n, k in SHAPES]


def fbgemm_linears(ws: list[torch.Tensor]) -> list[packed.PackedLinear]:
    """Each weight as packed-fp16 serves it (fbgemm's packed fp16)."""
    out = []
    for w in ws:
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False).requires_grad_(False)
        lin.weight.copy_(w)
        out.append(packed.PackedLinear(lin))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("experiments/results/linear_streams"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not (packed.available() and q4_kernel.load()):
        raise SystemExit("needs fbgemm and our q4 kernel (AVX512F/BW)")
    g = torch.Generator().manual_seed(0)
    shapes = SHAPES
    ws = random_weights(g)
    fp16 = fbgemm_linears(ws)
    quant = [quantize_q4_1(w) for w in ws[:-1]]
    q4 = [q4_kernel.layout(*q) for q in quant] + [q4_kernel.layout_q8(*quantize_q8_0(ws[-1]))]
    vnni = q4_kernel.vnni_supports()
    q8 = [q4_kernel.layout8(*q) for q in quant] + [q4_kernel.layout8_q8(*quantize_q8_0(ws[-1]))] if vnni else []
    nbytes = {"packed-fp16": sum(2 * w.numel() for w in ws),
              "q4": sum(t.numel() * t.element_size() for pair in q4 for t in pair),
              "q4 int8": sum(t.numel() for t in q8)}
    one_layer = list(range(len(LAYER)))
    hot = one_layer * LAYERS + [len(shapes) - 1]  # the same number of calls, on the first layer's weights (and the head)

    def run(kind: str, order: list[int], x: dict[int, torch.Tensor]) -> float:
        t0 = time.perf_counter()
        for i in order:
            if kind == "packed-fp16":
                fp16[i](x[shapes[i][1]])
            elif kind == "q4":
                q4_kernel.linear(x[shapes[i][1]], *q4[i])
            else:
                q4_kernel.linear8(x[shapes[i][1]], q8[i])
        return time.perf_counter() - t0

    settings = [("packed-fp16", None), ("q4", 0), ("q4", 1)] + ([("q4 int8", 8)] if vnni else [])
    rows = {}
    try:
        for m in (int(r) for r in args.rows.split(",")):
            x = {k: torch.randn(m, k, generator=g) for k in (H, I)}
            ts: dict[tuple, list[float]] = {}
            for rep in range(args.reps + 1):
                for kind, pf in settings:
                    if kind == "q4":
                        torch.ops.specblock_q4.set_prefetch(pf)
                    for name, order in (("stream", list(range(len(shapes)))), ("hot", hot)):
                        dt = run(kind, order, x)
                        if rep:  # the first round warms up
                            ts.setdefault((kind, pf, name), []).append(dt)
            for (kind, pf, name), v in ts.items():
                label = {"packed-fp16": kind, "q4": f"q4, prefetch {pf}", "q4 int8": "q4 int8 kernel"}[kind]
                ms = 1e3 * float(np.median(v))
                rows.setdefault(m, {}).setdefault(label, {})[name] = round(ms, 2)
                if name == "stream":
                    rows[m][label]["stream_gbs"] = round(nbytes[kind] / ms / 1e6, 1)
            print(m, rows[m], flush=True)
    finally:
        torch.ops.specblock_q4.set_prefetch(1)
    lines = [f"`python experiments/linear_streams.py --rows {args.rows} --reps {args.reps} --threads {args.threads} "
             f"--out {args.out}` (the real model's linear shapes, random weights, eager; median ms of one forward's "
             f"calls: each weight once in order (stream), or the same calls on one layer's weights (hot); "
             f"{nbytes['packed-fp16'] / 1e6:.1f} MB packed-fp16, {nbytes['q4'] / 1e6:.1f} MB q4, "
             f"{nbytes['q4 int8'] / 1e6:.1f} MB q4 on the int8 kernel)", "",
             "| rows | kernel | stream ms | hot ms | stream / hot | stream GB/s |", "|---|---|---|---|---|---|"]
    for m, r in rows.items():
        for label, v in r.items():
            lines.append(f"| {m} | {label} | {v['stream']:.2f} | {v['hot']:.2f} | {v['stream'] / v['hot']:.2f} | {v['stream_gbs']} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"bytes": nbytes, "rows": rows}, indent=1) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
