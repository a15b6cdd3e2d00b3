"""Would an fp16 kernel of our own, built like q4's (row-independent passes, the next block prefetched),
beat fbgemm's packed fp16 on a forward's linears? A probe, not a runtime kernel.

    python experiments/fp16_kernel_probe.py --rows 1,4,8 --reps 15 --threads 2 --out experiments/results/fp16_kernel_probe

Why: ``linear_streams.md`` found packed-fp16's fbgemm linears 1.56x slower streaming a forward's weights than
cache-hot, where q4's prefetch had cut that stall. This builds a small C++ fp16 kernel here (fp16 weights
widened exactly to fp32, fp32 sums; the same pass structure as ``runtime/q4_kernel.py``'s, up to 4 rows a pass)
and times one forward's linears of the real model's shapes (random weights) against fbgemm's, interleaved. It
also checks that each row equals its own single-row call and that both kernels agree to fp32 rounding.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import numpy as np
import torch

from linear_streams import SHAPES, H, I, fbgemm_linears, random_weights  # the same forward's linears
from specblock.runtime import packed

SOURCE = r"""
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>

namespace {
constexpr int NB = 4;
#define AVX512 __attribute__((target("avx512f,avx512bw,fma")))

// R rows against a block's 4 features: per group of 32 inputs, each feature's 32 fp16 weights widened
// exactly, two fmas per row and feature, one horizontal sum at the end (the same ops whatever R).
template <int R>
AVX512 void block_rows(const float* x, int64_t K, const uint16_t* w, float* y, int64_t N) {
  const int64_t G = K / 32;
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 wl[NB], wh[NB];
    const uint16_t* q = w + g * 32 * NB;
    for (int j = 0; j < NB; ++j) {
      wl[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * j)));
      wh[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * j + 16)));
    }
    for (int r = 0; r < R; ++r) {
      const __m512 xl = _mm512_loadu_ps(x + r * K + g * 32), xh = _mm512_loadu_ps(x + r * K + g * 32 + 16);
      for (int j = 0; j < NB; ++j) {
        acc[r][j] = _mm512_fmadd_ps(wl[j], xl, acc[r][j]);
        acc[r][j] = _mm512_fmadd_ps(wh[j], xh, acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) y[r * N + j] = _mm512_reduce_add_ps(acc[r][j]);
}
using Fn = void (*)(const float*, int64_t, const uint16_t*, float*, int64_t);
const Fn ROWS[5] = {nullptr, block_rows<1>, block_rows<2>, block_rows<3>, block_rows<4>};

// x [M, K] fp32, w fp16 [N/4, K/32, 4, 32] -> [M, N] fp32; prefetch: blocks ahead (0 off).
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, int64_t prefetch) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0) * NB, G = K / 32;
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  float* yp = y.data_ptr<float>();
  const int64_t bytes = G * 32 * NB * 2;
  at::parallel_for(0, N / NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint16_t* q = wp + b * G * 32 * NB;
      if (prefetch > 0 && b + prefetch < b1) {
        const char* p = reinterpret_cast<const char*>(q) + prefetch * bytes;
        for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
      }
      for (int64_t r = 0; r < M; r += 4)
        ROWS[std::min<int64_t>(4, M - r)](xp + r * K, K, q, yp + r * N + b * NB, N);
    }
  });
  return y;
}
}  // namespace

TORCH_LIBRARY(specblock_fp16_probe, m) { m.def("linear(Tensor x, Tensor w, int prefetch) -> Tensor"); }
TORCH_LIBRARY_IMPL(specblock_fp16_probe, CPU, m) { m.impl("linear", linear); }
"""


def build() -> None:
    from torch.utils.cpp_extension import load_inline

    from specblock.models.registry import specblock_home

    name = "specblock_fp16_probe_" + hashlib.sha256((SOURCE + torch.__version__).encode()).hexdigest()[:12]
    where = specblock_home() / "extensions" / name
    where.mkdir(parents=True, exist_ok=True)
    load_inline(name, cpp_sources=[SOURCE], is_python_module=False, build_directory=str(where),
                extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False, no_implicit_headers=True)


def layout(w: torch.Tensor) -> torch.Tensor:
    """fp32 ``[N, K]`` -> fp16 ``[N/4, K/32, 4, 32]``: a block's features interleaved per group of 32 inputs."""
    n, k = w.shape
    return w.half().reshape(n // 4, 4, k // 32, 32).transpose(1, 2).contiguous()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("experiments/results/fp16_kernel_probe"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if "avx512f" not in Path("/proc/cpuinfo").read_text() or not packed.available():
        raise SystemExit("needs AVX512F and fbgemm")
    build()
    op = torch.ops.specblock_fp16_probe.linear
    g = torch.Generator().manual_seed(0)
    shapes = SHAPES
    ws = random_weights(g)
    fbgemm, ours = fbgemm_linears(ws), [layout(w) for w in ws]
    x8 = torch.randn(8, H, generator=g)
    one = op(x8, ours[4], 1)
    alone = torch.cat([op(x8[i:i + 1], ours[4], 1) for i in range(8)])
    want = (x8.double() @ ws[4].half().double().t()).float()
    checks = {"rows_independent": bool(torch.equal(one, alone)),
              "max_abs_vs_fp64": float((one - want).abs().max()),
              "max_abs_vs_fbgemm": float((one - fbgemm[4](x8)).abs().max())}
    print(checks, flush=True)
    settings = ["fbgemm packed fp16", "ours, prefetch 0", "ours, prefetch 1"]

    def forward(setting: str, x: dict[int, torch.Tensor]) -> float:
        t0 = time.perf_counter()
        for i, (n, k) in enumerate(shapes):
            if setting.startswith("fbgemm"):  # the op itself, as ours: no module call around either
                torch.ops.quantized.linear_dynamic_fp16(x[k], fbgemm[i]._packed)
            else:
                op(x[k], ours[i], int(setting[-1]))
        return time.perf_counter() - t0

    rows = {}
    for m in (int(r) for r in args.rows.split(",")):
        x = {k: torch.randn(m, k, generator=g) for k in (H, I)}
        ts: dict[str, list[float]] = {s: [] for s in settings}
        for rep in range(args.reps + 1):
            for s in settings:
                dt = forward(s, x)
                if rep:
                    ts[s].append(dt)
        rows[m] = {s: round(1e3 * float(np.median(v)), 2) for s, v in ts.items()}
        print(m, rows[m], flush=True)
    lines = [f"`python experiments/fp16_kernel_probe.py --rows {args.rows} --reps {args.reps} --threads {args.threads} "
             f"--out {args.out}` (the real model's linear shapes with random weights, each weight once in order, eager; "
             f"median ms of one forward's linears; checks: {checks})", "",
             "| rows | " + " | ".join(settings) + " |", "|---" * (len(settings) + 1) + "|"]
    lines += [f"| {m} | " + " | ".join(f"{r[s]:.2f}" for s in settings) + " |" for m, r in rows.items()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"checks": checks, "rows": rows}, indent=1) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
