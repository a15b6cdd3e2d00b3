"""A prototype, not the runtime's kernel: an fp32 int4 linear for Q4_1 weights in AVX512, against
fbgemm's packed fp16 GEMM (what packed-fp16 runs), on the real model's seven linear shapes x 30 layers.

Why: ``--dtype q4`` uses torch's int4 kernel, which rounds its input and output to bf16, so q4 is
lossless only like bf16 (``q4_rows.md``). A kernel that keeps fp32 activations, reads the exact Q4_1
weights (``d * q + m``) and computes each output with the same operations whatever the row count
would make a 4-bit target lossless like fp32. This measures whether such a kernel can beat fbgemm
here: four output features per pass (independent accumulators), rows one at a time.

    python experiments/q4_fp32_kernel.py --rows 1,2,4,8 --threads 2 --out experiments/results/q4_fp32_kernel

Needs AVX512 and a C++ compiler; checks the error against the dequantized weights and that a row's
result does not depend on the other rows. Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import torch

from specblock.models.registry import specblock_home
from specblock.q4file import dequantize_q4_1, quantize_q4_1
from specblock.runtime.packed import prepack

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: q4_rows is a sibling
from q4_rows import SHAPES, median_ms  # noqa: E402

SOURCE = r"""
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <cstdint>
namespace {
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m) {
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0), G = K / 32;
  at::Tensor xe = at::empty({M, K}, x.options());
  at::Tensor xsum = at::empty({M, G}, x.options());
  const float* xp = x.data_ptr<float>(); float* ep = xe.data_ptr<float>(); float* sp = xsum.data_ptr<float>();
  for (int64_t r = 0; r < M; ++r) for (int64_t g = 0; g < G; ++g) {
    const float* src = xp + r * K + g * 32; float* dst = ep + r * K + g * 32; float s = 0.f;
    for (int j = 0; j < 16; ++j) { dst[j] = src[2 * j]; dst[16 + j] = src[2 * j + 1]; }
    for (int j = 0; j < 32; ++j) s += src[j];
    sp[r * G + g] = s;
  }
  at::Tensor y = at::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>(); const uint8_t* qp = qs.data_ptr<uint8_t>();
  const float* dp = d.data_ptr<float>(); const float* mp = m.data_ptr<float>();
  // four output features at a time (independent accumulators), one row at a time
  at::parallel_for(0, N / 4, 8, [&](int64_t b0, int64_t b1) {
    const __m512i mask = _mm512_set1_epi32(15);
    for (int64_t nb = b0; nb < b1; ++nb) {
      const int64_t n = nb * 4;
      for (int64_t r = 0; r < M; ++r) {
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
        const float* xr = ep + r * K;
        for (int64_t g = 0; g < G; ++g) {
          const __m512 xe_ = _mm512_loadu_ps(xr + g * 32), xo_ = _mm512_loadu_ps(xr + g * 32 + 16);
#define Q4STEP(j, acc) { \
            __m512i bb = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(qp + (n + j) * (K / 2) + g * 16))); \
            __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(bb, mask)), xe_); \
            t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bb, 4)), xo_, t); \
            acc = _mm512_fmadd_ps(_mm512_set1_ps(dp[(n + j) * G + g]), t, acc); }
          Q4STEP(0, a0) Q4STEP(1, a1) Q4STEP(2, a2) Q4STEP(3, a3)
        }
        const float* sr = sp + r * G;
        __m512 accs[4] = {a0, a1, a2, a3};
        for (int j = 0; j < 4; ++j) {
          float mt = 0.f;
          for (int64_t g = 0; g < G; ++g) mt += mp[(n + j) * G + g] * sr[g];
          yp[r * N + n + j] = _mm512_reduce_add_ps(accs[j]) + mt;
        }
      }
    }
  });
  return y;
}
}
TORCH_LIBRARY(specblock_q4_probe, m) { m.def("q4_linear(Tensor x, Tensor qs, Tensor d, Tensor m) -> Tensor"); }
TORCH_LIBRARY_IMPL(specblock_q4_probe, CPU, m) { m.impl("q4_linear", q4_linear); }
"""


def build() -> None:
    from torch.utils.cpp_extension import load_inline

    name = "q4_probe_" + hashlib.sha256((SOURCE + torch.__version__).encode()).hexdigest()[:10]
    where = specblock_home() / "extensions" / name
    where.mkdir(parents=True, exist_ok=True)
    load_inline(name, cpp_sources=[SOURCE], is_python_module=False, build_directory=str(where),
                extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mfma", "-fopenmp"], verbose=False,
                no_implicit_headers=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("experiments/results/q4_fp32_kernel"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if "avx512f" not in Path("/proc/cpuinfo").read_text():
        raise SystemExit("this prototype needs AVX512")
    build()
    op = torch.ops.specblock_q4_probe.q4_linear
    torch.manual_seed(0)
    qs, d, m = quantize_q4_1(torch.randn(96, 64))
    x = torch.randn(9, 64)
    got = op(x, qs, d.float(), m.float())
    err = float((got - x @ dequantize_q4_1(qs, d, m).t()).abs().max())
    row_independent = all(torch.equal(op(x[:i].contiguous(), qs, d.float(), m.float()), got[:i]) for i in range(1, 10))
    rows = [int(r) for r in args.rows.split(",")]
    out = {"fp32 int4 prototype": {}, "packed fp16 (fbgemm)": {}}
    for r in rows:
        mine, theirs = [], []
        for n, k in SHAPES:
            qs, d, m = quantize_q4_1(torch.randn(n, k))
            d, m = d.float().contiguous(), m.float().contiguous()
            xr = torch.randn(r, k)
            pk = prepack(torch.nn.Linear(k, n, bias=False))
            mine.append(lambda xr=xr, qs=qs, d=d, m=m: op(xr, qs, d, m))
            theirs.append(lambda xr=xr, pk=pk: torch.ops.quantized.linear_dynamic_fp16(xr, pk))
        for _ in range(2):  # interleaved
            out["fp32 int4 prototype"].setdefault(r, []).append(30 * median_ms(mine, args.reps))
            out["packed fp16 (fbgemm)"].setdefault(r, []).append(30 * median_ms(theirs, args.reps))
    table = {k: {r: round(float(np.median(v)), 2) for r, v in d_.items()} for k, d_ in out.items()}
    lines = [f"`python experiments/q4_fp32_kernel.py --rows {args.rows} --reps {args.reps} --threads {args.threads} "
             f"--out {args.out}`: the decoder's linears (seven shapes x 30 layers), ms; max error against the "
             f"dequantized weights {err:.2g}; row-independent: {row_independent}", "",
             "| kernel | " + " | ".join(f"{r} rows" for r in rows) + " |", "|---" * (len(rows) + 1) + "|"]
    lines += [f"| {k} | " + " | ".join(f"{v[r]:.1f}" for r in rows) + " |" for k, v in table.items()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"ms": table, "max_error": err, "row_independent": row_independent},
                                                        indent=1) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
