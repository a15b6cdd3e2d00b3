#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {
#define SPECBLOCK_AVX512 __attribute__((target("avx512f,avx512dq,fma")))

bool cpu_ok() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                         __builtin_cpu_supports("fma");
  return ok;
}

// exp for x <= 0 (scores less their maximum): Cephes' expf, 16 lanes (about 1 ulp). Below -87 it
// returns about 1e-38 where the true value is smaller still: no weight that size moves a sum.
SPECBLOCK_AVX512 inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}

// One query row of one head: softmax(q k^T * scale + mask) v over the visible slots (mask above
// -1e30; the rest weigh exactly nothing, as the additive mask's finfo.min makes them in softmax).
// The same operations for a row whatever the call's other rows, and whatever slots its visible
// keys sit in, as long as they come in the same order (a tree's ancestors follow the committed
// tokens, parents before children). s, e, idx: scratch of span entries.
SPECBLOCK_AVX512 void one_row(const float* q, const float* k, int64_t ks, const float* v, int64_t vs,
                              const float* mask, int64_t span, int64_t D, float scale, float* out, float* s, float* e,
                              int32_t* idx) {
  const int64_t C = (D + 15) / 16;  // 16-lane chunks of a head, the last one masked where D % 16
  const __mmask16 last = D % 16 ? static_cast<__mmask16>((1u << (D % 16)) - 1u) : static_cast<__mmask16>(0xFFFF);
  __m512 qv[16];
  for (int64_t c = 0; c < C; ++c) qv[c] = _mm512_maskz_loadu_ps(c + 1 < C ? 0xFFFF : last, q + 16 * c);
  float mx = -INFINITY;
  for (int64_t j = 0; j < span; ++j) {
    if (!(mask[j] > -1e30f)) {
      s[j] = -INFINITY;
      continue;
    }
    const float* kj = k + j * ks;
    __m512 acc = _mm512_mul_ps(qv[0], _mm512_maskz_loadu_ps(C > 1 ? 0xFFFF : last, kj));
    for (int64_t c = 1; c < C; ++c)
      acc = _mm512_fmadd_ps(qv[c], _mm512_maskz_loadu_ps(c + 1 < C ? 0xFFFF : last, kj + 16 * c), acc);
    s[j] = _mm512_reduce_add_ps(acc) * scale + mask[j];
    mx = std::max(mx, s[j]);
  }
  // weights e_j = exp(s_j - max), 16 at a time, packed densely in slot order with their slots (masked
  // slots dropped): the sums below then meet the same terms in the same order wherever the visible
  // slots lie, so a row's result does not depend on the tree's layout.
  const __m512 m = _mm512_set1_ps(mx), ninf = _mm512_set1_ps(-INFINITY);
  const __m512i step = _mm512_set1_epi32(16);
  __m512i slot = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int64_t cnt = 0;
  for (int64_t j = 0; j < span; j += 16) {
    const __mmask16 in = span - j >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (span - j)) - 1u);
    const __m512 sj = _mm512_mask_loadu_ps(ninf, in, s + j);
    const __mmask16 live = _mm512_cmp_ps_mask(sj, ninf, _CMP_NEQ_OQ);
    _mm512_mask_compressstoreu_ps(e + cnt, live, exp_nonpositive(_mm512_sub_ps(sj, m)));
    _mm512_mask_compressstoreu_epi32(idx + cnt, live, slot);
    cnt += __builtin_popcount(static_cast<unsigned>(live));
    slot = _mm512_add_epi32(slot, step);
  }
  if (cnt == 0) {  // a row that sees nothing: softmax over finfo.min everywhere weighs every slot alike
    for (int64_t j = 0; j < span; ++j) {
      e[j] = 1.0f;
      idx[j] = static_cast<int32_t>(j);
    }
    cnt = span;
  }
  __m512 zsum = _mm512_setzero_ps();
  for (int64_t t = 0; t < cnt; t += 16) {
    const __mmask16 in = cnt - t >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (cnt - t)) - 1u);
    zsum = _mm512_add_ps(zsum, _mm512_maskz_loadu_ps(in, e + t));
  }
  const float inv = 1.0f / _mm512_reduce_add_ps(zsum);
  __m512 acc[16];
  for (int64_t c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < cnt; ++t) {
    const __m512 w = _mm512_set1_ps(e[t]);
    const float* vj = v + idx[t] * vs;
    for (int64_t c = 0; c < C; ++c)
      acc[c] = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(c + 1 < C ? 0xFFFF : last, vj + 16 * c), acc[c]);
  }
  for (int64_t c = 0; c < C; ++c)
    _mm512_mask_storeu_ps(out + 16 * c, c + 1 < C ? 0xFFFF : last, _mm512_mul_ps(acc[c], _mm512_set1_ps(inv)));
}

// q [1, H, n, D], k and v [1, Hkv, span, D] (rows strided, the last dim contiguous; the static
// cache read in place), mask [1, 1, n, span] additive fp32 -> [1, n, H, D]: HF's attention output
// layout. Query head h reads key/value head h / (H / Hkv).
at::Tensor tree_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                          double scale) {
  TORCH_CHECK(cpu_ok(), "specblock_attention::tree_attention needs AVX512F/DQ and FMA");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && mask.dim() == 4 && q.size(0) == 1,
              "specblock_attention::tree_attention: q, k, v, mask must be 4-D with one batch row");
  for (const auto* t : {&q, &k, &v, &mask})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->stride(3) == 1, "specblock_attention::tree_attention: float32, last dim contiguous");
  const int64_t H = q.size(1), n = q.size(2), D = q.size(3), Hkv = k.size(1), span = k.size(2);
  TORCH_CHECK(D <= 256 && H % Hkv == 0 && v.size(1) == Hkv && v.size(2) == span && v.size(3) == D &&
              k.size(3) == D && mask.size(2) == n && mask.size(3) == span,
              "specblock_attention::tree_attention: shapes do not match (head dims up to 256)");
  const at::Tensor qc = q.contiguous(), mc = mask.contiguous();
  at::Tensor out = at::empty({1, n, H, D}, q.options());
  const int64_t g = H / Hkv;
  const float* qp = qc.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* mp = mc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, H * n, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> s(span), e(span);
    std::vector<int32_t> idx(span);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t h = t / n, i = t % n, kvh = h / g;
      one_row(qp + (h * n + i) * D, kp + kvh * k.stride(1), k.stride(2), vp + kvh * v.stride(1), v.stride(2),
              mp + i * span, span, D, static_cast<float>(scale), op + (i * H + h) * D, s.data(), e.data(), idx.data());
    }
  });
  return out;
}
}  // namespace

TORCH_LIBRARY(specblock_attention, m) {
  m.def("tree_attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(specblock_attention, CPU, m) {
  m.impl("tree_attention", tree_attention);
}
