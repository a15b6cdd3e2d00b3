#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <tuple>

namespace {
#define SPECBLOCK_AVX512 __attribute__((target("avx512f,fma")))

bool cpu_ok() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
  return ok;
}

// One row: the sum of squares in 16 lanes over the row's 16-wide chunks in order (a masked last
// one), one horizontal sum, then y = w * (x * (1 / sqrt(sum / H + eps))), HF's RMSNorm in fp32.
// The same operations whatever the row's neighbours, so a row's bits depend on its values alone.
SPECBLOCK_AVX512 void norm_row(const float* x, const float* w, float* y, int64_t H, float eps) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < H; i += 16) {
    const __mmask16 m = H - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (H - i)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(m, x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  const float mean = _mm512_reduce_add_ps(acc) / static_cast<float>(H);
  const __m512 r = _mm512_set1_ps(1.0f / std::sqrt(mean + eps));
  for (int64_t i = 0; i < H; i += 16) {
    const __mmask16 m = H - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (H - i)) - 1);
    const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), r);
    _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, w + i), v));
  }
}

// x [..., H] fp32, w [H] fp32 -> [..., H]: every row normed on its own.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(cpu_ok(), "specblock_norm::rms_norm needs AVX512F and FMA");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && x.dim() >= 1 && w.dim() == 1 &&
              x.size(-1) == w.size(0) && x.device().is_cpu() && w.device().is_cpu(),
              "specblock_norm::rms_norm: x [..., H] and w [H] must be float32 on the CPU");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t H = x.size(-1), rows = H == 0 ? 0 : xc.numel() / H;
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_row(xp + r * H, wp, yp + r * H, H, e);
  });
  return y;
}

// @include rotary.cpp
}  // namespace

TORCH_LIBRARY(specblock_norm, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("rotary(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(specblock_norm, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("rotary", rotary);
}
