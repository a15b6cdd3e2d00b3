#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>
#include <shared_mutex>
#include <unordered_map>
#include <utility>

namespace {
constexpr int NB = 4;
#define SPECBLOCK_AVX512 __attribute__((target("avx512f,avx512bw,fma")))

// Weight formats: per block of NB features and group of 32 inputs, QB bytes and SB fp32 scales
// per feature; decode gives a feature's 32 weights as two 16-lane halves, exactly. (fp16 scales,
// the GGUF's own, read fewer bytes but cost more instructions than they saved: tried, not kept.)
struct Q4_1 {  // 16 bytes (input i low nibble, i + 16 high, ggml's order) and (d, m): d * q + m
  static constexpr int QB = 16, SB = 2;
  SPECBLOCK_AVX512 static inline void decode(const uint8_t* q, const float* s, __m512& lo, __m512& hi) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    const __m512 d = _mm512_set1_ps(s[0]), m = _mm512_set1_ps(s[1]);
    lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15))), d, m);
    hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), d, m);
  }
};
struct Q8_0 {  // 32 signed bytes in order and d: d * q (exact in fp32)
  static constexpr int QB = 32, SB = 1;
  SPECBLOCK_AVX512 static inline void decode(const uint8_t* q, const float* s, __m512& lo, __m512& hi) {
    const __m512 d = _mm512_set1_ps(s[0]);
    lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)))), d);
    hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)))), d);
  }
};

// Rows [0, R) of x against NJ consecutive features of a block (qb, dm already offset to the
// first). Each output: acc = fma(w_lo, x_lo, acc); acc = fma(w_hi, x_hi, acc) per group in
// order, then one horizontal sum: the same operations whatever R, NJ or the call's row count.
template <class F, int R, int NJ>
SPECBLOCK_AVX512 void block_rows(const float* x, int64_t K, const uint8_t* qb, const float* dm, float* y, int64_t N) {
  const int64_t G = K / 32;
  __m512 acc[R][NJ];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NJ; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 wl[NJ], wh[NJ];
    const uint8_t* q = qb + g * F::QB * NB;
    const float* s = dm + g * F::SB * NB;
    for (int j = 0; j < NJ; ++j) F::decode(q + F::QB * j, s + F::SB * j, wl[j], wh[j]);
    for (int r = 0; r < R; ++r) {
      const __m512 xl = _mm512_loadu_ps(x + r * K + g * 32), xh = _mm512_loadu_ps(x + r * K + g * 32 + 16);
      for (int j = 0; j < NJ; ++j) {
        acc[r][j] = _mm512_fmadd_ps(wl[j], xl, acc[r][j]);
        acc[r][j] = _mm512_fmadd_ps(wh[j], xh, acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NJ; ++j) y[r * N + j] = _mm512_reduce_add_ps(acc[r][j]);
}

// Up to 4 rows: the block's 4 features per pass. More: 8 rows x 2 features per pass.
template <class F>
struct Passes {
  using BlockFn = void (*)(const float*, int64_t, const uint8_t*, const float*, float*, int64_t);
  static constexpr BlockFn WIDE[5] = {nullptr, block_rows<F, 1, 4>, block_rows<F, 2, 4>, block_rows<F, 3, 4>, block_rows<F, 4, 4>};
  static constexpr BlockFn TALL[9] = {nullptr, block_rows<F, 1, 2>, block_rows<F, 2, 2>, block_rows<F, 3, 2>, block_rows<F, 4, 2>,
                                      block_rows<F, 5, 2>, block_rows<F, 6, 2>, block_rows<F, 7, 2>, block_rows<F, 8, 2>};
};

bool cpu_ok() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("fma");
  return ok;
}

// Prefetch the block this many ahead of the one being computed (its bytes and scales): a layer's
// weights come from the last-level cache or memory in short streams that the hardware prefetcher
// meets too late. 1 measured best (experiments/q4_prefetch.py); set_prefetch changes it, 0 is off.
std::atomic<int64_t> prefetch_ahead{1};

// Blocks [b0, b1) of one weight into columns 4 b.. of y [M, N]: the same passes whatever the
// call's rows.
template <class F>
void run_blocks(const float* xp, int64_t M, int64_t K, const uint8_t* qp, const float* dp, int64_t b0, int64_t b1,
                float* yp, int64_t N) {
  const int64_t G = K / 32;
  const int64_t qbytes = G * F::QB * NB, sbytes = G * F::SB * NB * 4, ahead = prefetch_ahead.load(std::memory_order_relaxed);
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* q = qp + b * G * F::QB * NB;
    const float* s = dp + b * G * F::SB * NB;
    if (ahead > 0 && b + ahead < b1) {
      const char* pq = reinterpret_cast<const char*>(q) + ahead * qbytes;
      const char* ps = reinterpret_cast<const char*>(s) + ahead * sbytes;
      for (int64_t o = 0; o < qbytes; o += 64) _mm_prefetch(pq + o, _MM_HINT_T0);
      for (int64_t o = 0; o < sbytes; o += 64) _mm_prefetch(ps + o, _MM_HINT_T0);
    }
    float* out = yp + b * NB;
    if (M <= 4) {
      Passes<F>::WIDE[M](xp, K, q, s, out, N);
      continue;
    }
    for (int64_t r = 0; r < M; r += 8)
      for (int j0 = 0; j0 < NB; j0 += 2)
        Passes<F>::TALL[std::min<int64_t>(8, M - r)](xp + r * K, K, q + F::QB * j0, s + F::SB * j0, out + r * N + j0, N);
  }
}

// Q4_1: qb uint8 [N/4, K/32, 4, 16], dm fp32 [N/4, K/32, 4, 2]; Q8_0: qb int8 [N/4, K/32, 4, 32],
// dm fp32 [N/4, K/32, 4, 1]. The byte type tells them apart. Returns whether it is Q8_0.
bool check_weights(const at::Tensor& qb, const at::Tensor& dm) {
  const bool q8 = qb.scalar_type() == at::kChar;
  const int64_t qbytes = q8 ? Q8_0::QB : Q4_1::QB, scales = q8 ? Q8_0::SB : Q4_1::SB;
  TORCH_CHECK(qb.dim() == 4 && (q8 || qb.scalar_type() == at::kByte) && qb.size(2) == NB && qb.size(3) == qbytes && qb.is_contiguous(),
              "specblock_q4::linear: qb must be contiguous uint8 [N/4, K/32, 4, 16] (Q4_1) or int8 [N/4, K/32, 4, 32] (Q8_0)");
  TORCH_CHECK(dm.dim() == 4 && dm.scalar_type() == at::kFloat && dm.size(0) == qb.size(0) && dm.size(1) == qb.size(1) &&
              dm.size(2) == NB && dm.size(3) == scales && dm.is_contiguous(),
              "specblock_q4::linear: dm must be contiguous float32 [N/4, K/32, 4, ", scales, "]");
  return q8;
}

// x [M, K] fp32 times one weight (see check_weights) -> [M, N] fp32.
at::Tensor run_fp32(const at::Tensor& x, const std::vector<std::pair<at::Tensor, at::Tensor>>& ws);
at::Tensor linear(const at::Tensor& x, const at::Tensor& qb, const at::Tensor& dm) { return run_fp32(x, {{qb, dm}}); }

// ---- The int8 kernel: activations quantized to int8 per row and group of 32 (ggml's Q8_1:
// dx = amax / 127, xq = round(x * 127 / amax), ties to even), integer dot products with
// AVX512-VNNI, fp32 scaling. One output feature per 32-bit lane (16 a block), so a row needs no
// horizontal sum, and every output is the same operations whatever the call's rows.
constexpr int NF = 16;
#define SPECBLOCK_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,fma")))

bool vnni_ok() {
  static const bool ok = cpu_ok() && __builtin_cpu_supports("avx512vnni");
  return ok;
}

// A call's activations, quantized: row r, group g at index r * G + g (xq at (r * G + g) * 32).
struct Rows8 {
  const int8_t* q;
  const float* dx;   // dx = amax / 127
  const float* dxs;  // dx * sum(xq): what a Q4_1 offset m multiplies
  const int32_t* s128;  // 128 * sum(xq): what a Q8_0 weight's +128 adds to its integer sum
  int64_t G;
};

SPECBLOCK_VNNI void quantize_rows(const float* x, int64_t n, int8_t* xq, float* dx, float* dxs, int32_t* s128) {
  for (int64_t i = 0; i < n; ++i) {  // n = rows x groups, each 32 floats in order
    const __m512 a = _mm512_loadu_ps(x + i * 32), b = _mm512_loadu_ps(x + i * 32 + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const __m512 id = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    const __m512i ia = _mm512_cvtps_epi32(_mm512_mul_ps(a, id)), ib = _mm512_cvtps_epi32(_mm512_mul_ps(b, id));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + i * 32), _mm512_cvtsepi32_epi8(ia));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + i * 32 + 16), _mm512_cvtsepi32_epi8(ib));
    const int32_t s = _mm512_reduce_add_epi32(_mm512_add_epi32(ia, ib));
    dx[i] = amax / 127.f;
    dxs[i] = dx[i] * static_cast<float>(s);
    s128[i] = 128 * s;
  }
}

SPECBLOCK_VNNI inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// One row's group (eight 4-byte slots, each broadcast from memory: through a general register it
// took a shuffle port that the VNNI instructions need) against NBK blocks of 16 features: each
// broadcast feeds every block. Integer sums are exact, so splitting a lone block's chain in two (for
// few rows, whose latency shows) moves no result.
template <int R, int NBK>
SPECBLOCK_VNNI inline void dot8(const __m512i (*v)[8], const int8_t* xr, __m512i* s) {
  for (int k = 0; k < NBK; ++k) s[k] = _mm512_setzero_si512();
  if (NBK == 1 && R < 4) {
    __m512i s1 = _mm512_setzero_si512();
    for (int t = 0; t < 4; ++t) {
      s[0] = _mm512_dpbusd_epi32(s[0], v[0][t], _mm512_set1_epi32(load4(xr + 4 * t)));
      s1 = _mm512_dpbusd_epi32(s1, v[0][t + 4], _mm512_set1_epi32(load4(xr + 4 * t + 16)));
    }
    s[0] = _mm512_add_epi32(s[0], s1);
    return;
  }
  for (int t = 0; t < 8; ++t) {
    const __m512i b = _mm512_set1_epi32(load4(xr + 4 * t));
    for (int k = 0; k < NBK; ++k) s[k] = _mm512_dpbusd_epi32(s[k], v[k][t], b);
  }
}

// Per block of 16 features and group of 32 inputs, BYTES bytes: slot t (inputs 4t..4t+3) is a
// 64-byte operand, feature f's 4 weights at bytes 4f..4f+3. ``group`` takes NBK blocks ``stride``
// bytes apart; each output gets the same operations whatever NBK.
struct W4 {  // Q4_1: slots t and t + 4 as the low and high nibbles of 64 bytes (256), then d[16], m[16] fp16
  static constexpr int64_t BYTES = 320;
  template <int R, int NBK>
  SPECBLOCK_VNNI static inline void group(const uint8_t* w, int64_t stride, const Rows8& x, int64_t g, __m512 (*acc)[NBK]) {
    __m512i v[NBK][8];
    __m512 d[NBK], m[NBK];
    const __m512i low = _mm512_set1_epi8(15);
    for (int k = 0; k < NBK; ++k) {
      const uint8_t* wk = w + k * stride;
      for (int j = 0; j < 4; ++j) {
        const __m512i p = _mm512_loadu_si512(wk + 64 * j);
        v[k][j] = _mm512_and_si512(p, low);
        v[k][j + 4] = _mm512_and_si512(_mm512_srli_epi16(p, 4), low);
      }
      d[k] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + 256)));
      m[k] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + 288)));
    }
    for (int r = 0; r < R; ++r) {
      const int64_t i = r * x.G + g;
      __m512i s[NBK];
      dot8<R, NBK>(v, x.q + i * 32, s);
      const __m512 dx = _mm512_set1_ps(x.dx[i]), dxs = _mm512_set1_ps(x.dxs[i]);
      for (int k = 0; k < NBK; ++k) {
        acc[r][k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[k]), _mm512_mul_ps(d[k], dx), acc[r][k]);
        acc[r][k] = _mm512_fmadd_ps(m[k], dxs, acc[r][k]);
      }
    }
  }
};
struct W8 {  // Q8_0: q + 128 as unsigned bytes (512), then d[16] fp16
  static constexpr int64_t BYTES = 544;
  template <int R, int NBK>
  SPECBLOCK_VNNI static inline void group(const uint8_t* w, int64_t stride, const Rows8& x, int64_t g, __m512 (*acc)[NBK]) {
    __m512i v[NBK][8];
    __m512 d[NBK];
    for (int k = 0; k < NBK; ++k) {
      const uint8_t* wk = w + k * stride;
      for (int t = 0; t < 8; ++t) v[k][t] = _mm512_loadu_si512(wk + 64 * t);
      d[k] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + 512)));
    }
    for (int r = 0; r < R; ++r) {
      const int64_t i = r * x.G + g;
      __m512i s[NBK];
      dot8<R, NBK>(v, x.q + i * 32, s);
      const __m512 dx = _mm512_set1_ps(x.dx[i]);
      const __m512i c = _mm512_set1_epi32(x.s128[i]);
      for (int k = 0; k < NBK; ++k)
        acc[r][k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(s[k], c)), _mm512_mul_ps(d[k], dx), acc[r][k]);
    }
  }
};
// Rows [0, R) of x against NBK blocks ``stride`` bytes apart: groups in order, the next ones
// prefetched: ``ahead`` groups on into L1, ``far`` groups on into L2 (0: off).
template <class W, int R, int NBK>
SPECBLOCK_VNNI void block8(const uint8_t* w, int64_t stride, Rows8 x, float* y, int64_t N, int64_t ahead, int64_t far) {
  __m512 acc[R][NBK];
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < NBK; ++k) acc[r][k] = _mm512_setzero_ps();
  for (int64_t g = 0; g < x.G; ++g) {
    const uint8_t* wg = w + g * W::BYTES;
    for (int k = 0; k < NBK; ++k) {
      const char* pk = reinterpret_cast<const char*>(wg + k * stride);
      if (ahead > 0)
        for (int64_t o = 0; o < W::BYTES; o += 64) _mm_prefetch(pk + ahead * W::BYTES + o, _MM_HINT_T0);
      if (far > 0)
        for (int64_t o = 0; o < W::BYTES; o += 64) _mm_prefetch(pk + far * W::BYTES + o, _MM_HINT_T1);
    }
    W::template group<R, NBK>(wg, stride, x, g, acc);
  }
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < NBK; ++k) _mm512_storeu_ps(y + r * N + k * NF, acc[r][k]);
}

template <class W, int NBK>
struct Passes8 {
  using Fn = void (*)(const uint8_t*, int64_t, Rows8, float*, int64_t, int64_t, int64_t);
  static constexpr Fn BY_ROWS[9] = {nullptr, block8<W, 1, NBK>, block8<W, 2, NBK>, block8<W, 3, NBK>, block8<W, 4, NBK>,
                                    block8<W, 5, NBK>, block8<W, 6, NBK>, block8<W, 7, NBK>, block8<W, 8, NBK>};
};

// Groups this many ahead are prefetched into L1 (0: off), as the fp32 kernel's blocks are; and this
// many further on into L2 (0: off). Without the second, a weight stream from L3 or DRAM overlapped
// little with the kernel's work at 8 rows (experiments/int8_kernel_bound.py, int8_prefetch.py).
std::atomic<int64_t> prefetch_groups{8};
std::atomic<int64_t> far_groups{32};

// One weight's part of a call: its blocks go to output columns col.. (several weights that read
// the same input share one call: q/k/v, gate/up).
struct Seg8 {
  const uint8_t* w;
  int64_t blocks, bytes, col;
};

void check8(const at::Tensor& w, int64_t K) {
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kByte && (w.size(2) == W4::BYTES || w.size(2) == W8::BYTES) &&
              w.is_contiguous(), "specblock_q4::linear8: w must be contiguous uint8 [N/16, K/32, 320 (Q4_1) or 544 (Q8_0)]");
  TORCH_CHECK(K == w.size(1) * 32, "specblock_q4::linear8: x has ", K, " inputs, the weights ", w.size(1) * 32);
}

// x [M, K] fp32 (quantized once) times each weight of ``ws`` (each checked by check8) -> [M, sum of
// their outputs] fp32, side by side in order.
at::Tensor run8(const at::Tensor& x, const std::vector<at::Tensor>& ws) {
  TORCH_CHECK(vnni_ok(), "specblock_q4::linear8 needs AVX512F, AVX512BW, AVX512-VNNI and FMA");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "specblock_q4::linear8: x must be 2-D float32");
  const int64_t M = x.size(0), K = x.size(1), G = K / 32;
  std::vector<Seg8> segs;
  int64_t blocks = 0;
  for (const auto& w : ws) {
    check8(w, K);
    segs.push_back({static_cast<const uint8_t*>(w.data_ptr()), w.size(0), w.size(2), blocks * NF});
    blocks += w.size(0);
  }
  const int64_t N = blocks * NF;
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  std::vector<int8_t> xq(M * K);
  std::vector<float> dx(M * G), dxs(M * G);
  std::vector<int32_t> s128(M * G);
  quantize_rows(xc.data_ptr<float>(), M * G, xq.data(), dx.data(), dxs.data(), s128.data());
  const int64_t ahead = prefetch_groups.load(std::memory_order_relaxed), far = far_groups.load(std::memory_order_relaxed);
  float* yp = y.data_ptr<float>();
  // A thread's blocks, weight by weight; in pairs (each activation broadcast feeds both), a weight's
  // lone last one alone.
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    int64_t first = 0;
    for (const Seg8& sg : segs) {
      const int64_t lo = std::max(b0, first) - first, hi = std::min(b1, first + sg.blocks) - first;
      first += sg.blocks;
      const bool q8 = sg.bytes == W8::BYTES;
      const int64_t stride = G * sg.bytes;
      for (int64_t b = lo; b < hi; b += 2) {
        const bool pair = b + 1 < hi;
        for (int64_t r = 0; r < M; r += 8) {
          const Rows8 rows{xq.data() + r * K, dx.data() + r * G, dxs.data() + r * G, s128.data() + r * G, G};
          const int R = static_cast<int>(std::min<int64_t>(8, M - r));
          const auto fn = q8 ? (pair ? Passes8<W8, 2>::BY_ROWS[R] : Passes8<W8, 1>::BY_ROWS[R])
                             : (pair ? Passes8<W4, 2>::BY_ROWS[R] : Passes8<W4, 1>::BY_ROWS[R]);
          fn(sg.w + b * stride, stride, rows, yp + r * N + sg.col + b * NF, N, r == 0 ? ahead : 0, r == 0 ? far : 0);
        }
      }
    }
  });
  return y;
}

// x [M, K] fp32 times w uint8 [N/16, K/32, BYTES] (BYTES 320: Q4_1, 544: Q8_0) -> [M, N] fp32.
at::Tensor linear8(const at::Tensor& x, const at::Tensor& w) { return run8(x, {w}); }

// The fp32 kernel over several weights at once, as run8.
at::Tensor run_fp32(const at::Tensor& x, const std::vector<std::pair<at::Tensor, at::Tensor>>& ws) {
  TORCH_CHECK(cpu_ok(), "specblock_q4::linear needs AVX512F, AVX512BW and FMA");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "specblock_q4::linear: x must be 2-D float32");
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<int64_t> starts;
  int64_t blocks = 0;
  for (const auto& w : ws) {
    check_weights(w.first, w.second);
    TORCH_CHECK(K == w.first.size(1) * 32, "specblock_q4::linear: x has ", K, " inputs, the weights ", w.first.size(1) * 32);
    starts.push_back(blocks);
    blocks += w.first.size(0);
  }
  const int64_t N = blocks * NB;
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (size_t i = 0; i < ws.size(); ++i) {
      const int64_t n = ws[i].first.size(0), lo = std::max(b0, starts[i]) - starts[i], hi = std::min(b1, starts[i] + n) - starts[i];
      if (lo >= hi) continue;
      const auto* qp = static_cast<const uint8_t*>(ws[i].first.data_ptr());
      const float* dp = ws[i].second.data_ptr<float>();
      (ws[i].first.scalar_type() == at::kChar ? run_blocks<Q8_0> : run_blocks<Q4_1>)(xp, M, K, qp, dp, lo, hi, yp + starts[i] * NB, N);
    }
  });
  return y;
}

// Weights by key, for compiled graphs: a graph that holds an int instead of two tensors per
// linear leaves dynamo 420 fewer tensors to guard on every call.
std::shared_mutex mu;
std::unordered_map<int64_t, std::pair<at::Tensor, at::Tensor>> table;

void put(int64_t key, const at::Tensor& qb, const at::Tensor& dm) {
  std::unique_lock<std::shared_mutex> lock(mu);
  table[key] = {qb, dm};
}

void drop(int64_t key) {
  std::unique_lock<std::shared_mutex> lock(mu);
  table.erase(key);
}

std::pair<at::Tensor, at::Tensor> find(int64_t key) {
  std::shared_lock<std::shared_mutex> lock(mu);
  auto it = table.find(key);
  TORCH_CHECK(it != table.end(), "specblock_q4::linear_key: no weights under key ", key);
  return it->second;
}

// Either kernel's weights: the int8 kernel's are one 3-D tensor (dm empty). Several keys: the
// weights that read the same x, one call, their outputs side by side (every output the same bits
// as its own call's).
at::Tensor run_keys(const at::Tensor& x, const std::vector<int64_t>& keys, int64_t out_features) {
  TORCH_CHECK(!keys.empty(), "specblock_q4::linear_key: no keys");
  std::vector<std::pair<at::Tensor, at::Tensor>> ws;
  int64_t n = 0;
  for (const int64_t key : keys) {
    ws.push_back(find(key));
    n += ws.back().first.size(0) * (ws.back().first.dim() == 3 ? NF : NB);
  }
  TORCH_CHECK(n == out_features, "specblock_q4::linear_key: keys hold ", n, " outputs, not ", out_features);
  const bool int8 = ws[0].first.dim() == 3;
  for (const auto& w : ws)
    TORCH_CHECK((w.first.dim() == 3) == int8, "specblock_q4::linear_key_cat: keys of both kernels in one call");
  if (!int8) return run_fp32(x, ws);
  std::vector<at::Tensor> w8;
  for (const auto& w : ws) w8.push_back(w.first);
  return run8(x, w8);
}

// Up to four keys as plain ints (-1: none), not an int[]: inductor's C++ wrapper calls an op of
// plain ints through the light stable ABI, one with a list through boxed IValues, which cost each
// compiled graph seconds more to build.
at::Tensor linear_key_cat(const at::Tensor& x, int64_t k0, int64_t k1, int64_t k2, int64_t k3, int64_t out_features) {
  std::vector<int64_t> keys;
  for (const int64_t k : {k0, k1, k2, k3})
    if (k >= 0) keys.push_back(k);
  return run_keys(x, keys, out_features);
}

at::Tensor linear_key(const at::Tensor& x, int64_t key, int64_t out_features) {
  return run_keys(x, {key}, out_features);
}

}  // namespace

TORCH_LIBRARY(specblock_q4, m) {
  m.def("linear(Tensor x, Tensor qb, Tensor dm) -> Tensor");
  m.def("linear_key(Tensor x, int key, int out_features) -> Tensor");
  m.def("linear_key_cat(Tensor x, int key0, int key1, int key2, int key3, int out_features) -> Tensor");
  m.def("put(int key, Tensor qb, Tensor dm) -> ()", put);
  m.def("drop(int key) -> ()", drop);
  m.def("set_prefetch(int blocks) -> ()", [](int64_t n) { prefetch_ahead.store(std::max<int64_t>(n, 0)); });
  m.def("linear8(Tensor x, Tensor w) -> Tensor");
  m.def("set_prefetch8(int groups) -> ()", [](int64_t n) { prefetch_groups.store(std::max<int64_t>(n, 0)); });
  m.def("set_far8(int groups) -> ()", [](int64_t n) { far_groups.store(std::max<int64_t>(n, 0)); });
}
TORCH_LIBRARY_IMPL(specblock_q4, CPU, m) {
  m.impl("linear", linear);
  m.impl("linear_key", linear_key);
  m.impl("linear_key_cat", linear_key_cat);
  m.impl("linear8", linear8);
}
