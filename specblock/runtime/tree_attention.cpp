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

// Sixteen vectors' lane sums in one vector: lane sums of a[0..15], key k in lane SUM16_LANE[k]. Every
// sum is the same tree whatever vector it comes from (lane l plus l + 8, then those 4 apart, 2
// apart, 1 apart), so a key's score does not depend on where in a block of 16 it sits. Four
// shuffle levels for 16 sums instead of one horizontal reduction per key.
SPECBLOCK_AVX512 inline __m512 sum16(const __m512* a) {
  __m512 t[8], u[4];
  for (int j = 0; j < 8; ++j)  // 128-bit lanes: 0, 1 key j; 2, 3 key j + 8
    t[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[j], a[j + 8], 0x44), _mm512_shuffle_f32x4(a[j], a[j + 8], 0xEE));
  for (int j = 0; j < 4; ++j)  // one key a 128-bit lane: j, j + 8, j + 4, j + 12
    u[j] = _mm512_add_ps(_mm512_shuffle_f32x4(t[j], t[j + 4], 0x88), _mm512_shuffle_f32x4(t[j], t[j + 4], 0xDD));
  __m512 w[2];
  for (int j = 0; j < 2; ++j)
    w[j] = _mm512_add_ps(_mm512_unpacklo_ps(u[j], u[j + 2]), _mm512_unpackhi_ps(u[j], u[j + 2]));
  const __m512d w0 = _mm512_castps_pd(w[0]), w1 = _mm512_castps_pd(w[1]);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(w0, w1)), _mm512_castpd_ps(_mm512_unpackhi_pd(w0, w1)));
}

// The lanes sum16 leaves keys 0..15 in, as the index vector that puts them back in order: found once
// by summing vectors of their own key number (exact), not written out by hand.
SPECBLOCK_AVX512 __m512i sum16_order() {
  __m512 a[16];
  for (int j = 0; j < 16; ++j) a[j] = _mm512_set1_ps(static_cast<float>(j));
  alignas(64) float got[16];
  _mm512_store_ps(got, sum16(a));
  alignas(64) int32_t idx[16];
  for (int lane = 0; lane < 16; ++lane) idx[static_cast<int>(got[lane]) / 16] = lane;
  return _mm512_load_si512(idx);
}

// Scores of one query against slots [j0, j1) (j1 - j0 a multiple of 16 or the span's tail), into s:
// each visible slot's dot product (invisible slots are not read: a tree's stale slots may hold
// anything), 16 lane sums at once, then * scale + mask; -inf where the slot is invisible.
template <int CT>
SPECBLOCK_AVX512 void scores(const __m512* qv, int64_t C_, __mmask16 last, const float* k, int64_t ks,
                             const float* mask, int64_t j0, int64_t j1, float scale, float* s) {
  static const __m512i order = sum16_order();
  const int64_t C = CT ? CT : C_;
  const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY), floor = _mm512_set1_ps(-1e30f);
  for (int64_t j = j0; j < j1; j += 16) {
    const __mmask16 in = j1 - j >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (j1 - j)) - 1u);
    const __m512 mj = _mm512_maskz_loadu_ps(in, mask + j);
    const __mmask16 vis = _mm512_mask_cmp_ps_mask(in, mj, floor, _CMP_GT_OQ);
    if (vis == 0) {
      _mm512_mask_storeu_ps(s + j, in, ninf);
      continue;
    }
    __m512 acc[16];
    for (int t = 0; t < 16; ++t) {
      if (!((vis >> t) & 1u)) {
        acc[t] = _mm512_setzero_ps();
        continue;
      }
      const float* kj = k + (j + t) * ks;
      __m512 a = _mm512_mul_ps(qv[0], _mm512_maskz_loadu_ps(C > 1 ? 0xFFFF : last, kj));
      for (int64_t c = 1; c < C; ++c)
        a = _mm512_fmadd_ps(qv[c], _mm512_maskz_loadu_ps(c + 1 < C ? 0xFFFF : last, kj + 16 * c), a);
      acc[t] = a;
    }
    const __m512 dot = _mm512_permutexvar_ps(order, sum16(acc));
    _mm512_mask_storeu_ps(s + j, in, _mm512_mask_blend_ps(vis, ninf, _mm512_add_ps(_mm512_mul_ps(dot, vscale), mj)));
  }
}

// A query's softmax weights from its scores: e_j = exp(s_j - max), 16 at a time, packed densely in
// slot order with their slots (invisible slots dropped): the sums then meet the same terms in the
// same order wherever the visible slots lie, so a row's result does not depend on the tree's layout.
// Returns how many; a row that sees nothing gets softmax's answer over finfo.min everywhere: every
// slot alike. *inv: 1 / the weights' sum.
SPECBLOCK_AVX512 int64_t weights(const float* s, int64_t span, float* e, int32_t* idx, float* inv) {
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  __m512 vmax = ninf;
  for (int64_t j = 0; j < span; j += 16) {
    const __mmask16 in = span - j >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (span - j)) - 1u);
    vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(ninf, in, s + j));
  }
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
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
  if (cnt == 0) {
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
  *inv = 1.0f / _mm512_reduce_add_ps(zsum);
  return cnt;
}

// Slots a pass over the keys (then the values) takes at a time, for every query of a group: 64 slots
// of a 64-wide head are 16 KB, read from L2 once and then from L1 by each query. (Query by query,
// each one streamed the whole span of keys and values from L2.)
constexpr int64_t BLOCK = 64;

// Scratch a pass keeps per query and slot (score, weight, slot index: 12 bytes) is held to about this
// many bytes, so that it stays in L2: a prompt's thousands of queries then go in chunks. (All at
// once, a 1,500-token prompt's group wrote and reread about 40 MB of scratch from DRAM, and the op
// took 2x SDPA's prefill: experiments/prompt_attention.py.)
constexpr int64_t SCRATCH = 512 * 1024;

// One past the last visible slot of [j, j + 16) (the span's end cuts it), or 0 where none is.
SPECBLOCK_AVX512 inline int64_t block_end(const float* mask, int64_t span, int64_t j) {
  const __mmask16 in = span - j >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (span - j)) - 1u);
  const __mmask16 vis = _mm512_mask_cmp_ps_mask(in, _mm512_maskz_loadu_ps(in, mask + j), _mm512_set1_ps(-1e30f), _CMP_GT_OQ);
  return vis ? j + 32 - __builtin_clz(static_cast<unsigned>(vis)) : 0;
}

// One past the last slot a mask row leaves visible (the score's own test: above -1e30); the whole
// span where it leaves none, so that such a row still gets softmax's answer over every slot. A
// causal prompt's row i sees slots up to i: its passes stop there.
SPECBLOCK_AVX512 int64_t visible_end(const float* mask, int64_t span) {
  const __m512 floor = _mm512_set1_ps(-1e30f);
  int64_t j = ((span + 15) / 16) * 16 - 16;
  if (j >= 0 && span - j < 16) {  // a partial last block
    if (const int64_t e = block_end(mask, span, j)) return e;
    j -= 16;
  }
  // Then 64 hidden slots at a time, one compare each (a compiled step's mask is the whole buffer,
  // mostly hidden), and the block that holds the last visible slot 16 at a time.
  while (j >= 48) {
    const __m512 m = _mm512_max_ps(_mm512_max_ps(_mm512_loadu_ps(mask + j), _mm512_loadu_ps(mask + j - 16)),
                                   _mm512_max_ps(_mm512_loadu_ps(mask + j - 32), _mm512_loadu_ps(mask + j - 48)));
    if (_mm512_cmp_ps_mask(m, floor, _CMP_GT_OQ)) break;
    j -= 64;
  }
  for (; j >= 0; j -= 16)
    if (const int64_t e = block_end(mask, span, j)) return e;
  return span;
}

// softmax(q k^T * scale + mask) v for queries [0, Q) of one key/value head (query r at q + r * D,
// its mask row at mask + row[r] * span, its output at out[r]), in chunks of queries whose scratch
// fits SCRATCH. The same operations for a query whatever the call's other queries (so whatever the
// chunk), and whatever slots its visible keys sit in, as long as they come in the same order (a
// tree's ancestors follow the committed tokens, parents before children). Slots past a query's last
// visible one are not visited: they would add -inf scores and no weight.
template <int CT>
SPECBLOCK_AVX512 void group(const float* q, int64_t Q, const int64_t* row, const int64_t* ends, float* const* out,
                            const float* k, int64_t ks, const float* v, int64_t vs, const float* mask, int64_t span,
                            int64_t D, float scale) {
  const int64_t C = CT ? CT : (D + 15) / 16;  // 16-lane chunks of a head, the last one masked where D % 16
  const __mmask16 last = D % 16 ? static_cast<__mmask16>((1u << (D % 16)) - 1u) : static_cast<__mmask16>(0xFFFF);
  int64_t W = 1;  // scratch a query: up to the group's last visible slot (a compiled step's span is the whole buffer)
  for (int64_t r = 0; r < Q; ++r) W = std::max(W, ends[row[r]]);
  const int64_t QC = std::min(Q, std::max<int64_t>(1, SCRATCH / (12 * W)));
  // Reused across calls, sized up and never cleared; read through plain pointers below (a thread_local
  // in a shared library is a function call each time it is named).
  thread_local std::vector<float> s_, e_, inv_, acc_;
  thread_local std::vector<int32_t> idx_;
  thread_local std::vector<int64_t> cnt_, at_, end_;
  if (static_cast<int64_t>(s_.size()) < QC * W) {
    s_.resize(QC * W);
    e_.resize(QC * W);
    idx_.resize(QC * W);
  }
  if (static_cast<int64_t>(acc_.size()) < QC * C * 16) acc_.resize(QC * C * 16);
  if (static_cast<int64_t>(cnt_.size()) < QC) {
    inv_.resize(QC);
    cnt_.resize(QC);
    at_.resize(QC);
    end_.resize(QC);
  }
  float *const s = s_.data(), *const e = e_.data(), *const inv = inv_.data(), *const acc = acc_.data();
  int32_t* const idx = idx_.data();
  int64_t *const cnt = cnt_.data(), *const at = at_.data(), *const end = end_.data();
  __m512 qv[16], a[16];
  for (int64_t c0 = 0; c0 < Q; c0 += QC) {
    const int64_t n = std::min(QC, Q - c0), top = [&] {
      int64_t t = 0;
      for (int64_t r = 0; r < n; ++r) t = std::max(t, end[r] = ends[row[c0 + r]]);
      return t;
    }();
    for (int64_t b = 0; b < top; b += BLOCK)
      for (int64_t r = 0; r < n; ++r) {
        if (b >= end[r]) continue;
        const float* qr = q + (c0 + r) * D;
        for (int64_t c = 0; c < C; ++c) qv[c] = _mm512_maskz_loadu_ps(c + 1 < C ? 0xFFFF : last, qr + 16 * c);
        scores<CT>(qv, C, last, k, ks, mask + row[c0 + r] * span, b, std::min(end[r], b + BLOCK), scale, s + r * W);
      }
    for (int64_t r = 0; r < n; ++r) {
      cnt[r] = weights(s + r * W, end[r], e + r * W, idx + r * W, &inv[r]);
      at[r] = 0;
    }
    std::fill(acc, acc + n * C * 16, 0.0f);
    for (int64_t b = 0; b < top; b += BLOCK)  // each query's weighted values in its slot order, a block at a time
      for (int64_t r = 0; r < n; ++r) {
        const float* er = e + r * W;
        const int32_t* ir = idx + r * W;
        int64_t t = at[r];
        if (t >= cnt[r] || ir[t] >= b + BLOCK) continue;
        float* ar = acc + r * C * 16;
        for (int64_t c = 0; c < C; ++c) a[c] = _mm512_loadu_ps(ar + 16 * c);
        for (; t < cnt[r] && ir[t] < b + BLOCK; ++t) {
          const __m512 w = _mm512_set1_ps(er[t]);
          const float* vj = v + ir[t] * vs;
          for (int64_t c = 0; c < C; ++c)
            a[c] = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(c + 1 < C ? 0xFFFF : last, vj + 16 * c), a[c]);
        }
        at[r] = t;
        for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(ar + 16 * c, a[c]);
      }
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < C; ++c)
        _mm512_mask_storeu_ps(out[c0 + r] + 16 * c, c + 1 < C ? 0xFFFF : last,
                              _mm512_mul_ps(_mm512_loadu_ps(acc + (r * C + c) * 16), _mm512_set1_ps(inv[r])));
  }
}

// q [1, H, n, D], k and v [1, Hkv, span, D] (rows strided, the last dim contiguous; the static
// cache read in place), mask [1, 1, n, span] additive fp32 -> [1, n, H, D]: HF's attention output
// layout. Query head h reads key/value head h / (H / Hkv). A key/value head's H / Hkv x n queries
// go in a few groups (two tasks a thread where there are queries enough), each group sharing its
// passes over the keys and values.
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
  const int64_t g = H / Hkv, Q = g * n;  // a key/value head's queries, head-major: query r is head r / n, row r % n
  const int64_t parts = std::min<int64_t>(Q, std::max<int64_t>(1, (2 * at::get_num_threads() + Hkv - 1) / Hkv));
  const int64_t per = (Q + parts - 1) / parts;
  const float* qp = qc.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* mp = mc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  std::vector<int64_t> ends(n);  // per mask row, not per query: a row's query heads share it
  for (int64_t i = 0; i < n; ++i) ends[i] = visible_end(mp + i * span, span);
  at::parallel_for(0, Hkv * parts, 1, [&](int64_t t0, int64_t t1) {
    std::vector<int64_t> row(per);
    std::vector<float*> dst(per);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t kvh = t / parts, r0 = (t % parts) * per, r1 = std::min(Q, r0 + per);
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t h = kvh * g + r / n, i = r % n;
        row[r - r0] = i;
        dst[r - r0] = op + (i * H + h) * D;
      }
      if (r1 > r0)
        (D == 64 ? group<4> : group<0>)(qp + (kvh * g * n + r0) * D, r1 - r0, row.data(), ends.data(), dst.data(),
                                        kp + kvh * k.stride(1), k.stride(2), vp + kvh * v.stride(1), v.stride(2), mp,
                                        span, D, static_cast<float>(scale));
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
