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
at::Tensor linear(const at::Tensor& x, const at::Tensor& qb, const at::Tensor& dm) {
  TORCH_CHECK(cpu_ok(), "specblock_q4::linear needs AVX512F, AVX512BW and FMA");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "specblock_q4::linear: x must be 2-D float32");
  const bool q8 = check_weights(qb, dm);
  const int64_t M = x.size(0), K = x.size(1), N = qb.size(0) * NB;
  TORCH_CHECK(K == qb.size(1) * 32, "specblock_q4::linear: x has ", K, " inputs, the weights ", qb.size(1) * 32);
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const auto* qp = static_cast<const uint8_t*>(qb.data_ptr());
  const float* dp = dm.data_ptr<float>();
  at::parallel_for(0, N / NB, 1, [&](int64_t b0, int64_t b1) {
    (q8 ? run_blocks<Q8_0> : run_blocks<Q4_1>)(xp, M, K, qp, dp, b0, b1, yp, N);
  });
  return y;
}

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

// Eight 4-byte slots of one row's group against the block's 16 features. Integer sums are exact, so
// splitting the chain in two (for few rows, whose latency shows) moves no result.
template <int R>
SPECBLOCK_VNNI inline __m512i dot8(const __m512i* v, const int8_t* xr) {
  int32_t x4[8];
  std::memcpy(x4, xr, 32);
  __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
  if (R >= 4) {  // other rows' chains hide this one's latency
    for (int t = 0; t < 8; ++t) s0 = _mm512_dpbusd_epi32(s0, v[t], _mm512_set1_epi32(x4[t]));
    return s0;
  }
  for (int t = 0; t < 4; ++t) {
    s0 = _mm512_dpbusd_epi32(s0, v[t], _mm512_set1_epi32(x4[t]));
    s1 = _mm512_dpbusd_epi32(s1, v[t + 4], _mm512_set1_epi32(x4[t + 4]));
  }
  return _mm512_add_epi32(s0, s1);
}

// Per block of 16 features and group of 32 inputs, BYTES bytes: slot t (inputs 4t..4t+3) is a
// 64-byte operand, feature f's 4 weights at bytes 4f..4f+3.
struct W4 {  // Q4_1: slots t and t + 4 as the low and high nibbles of 64 bytes (256), then d[16], m[16] fp16
  static constexpr int64_t BYTES = 320;
  template <int R>
  SPECBLOCK_VNNI static inline void group(const uint8_t* w, const Rows8& x, int64_t g, __m512* acc) {
    __m512i v[8];
    const __m512i low = _mm512_set1_epi8(15);
    for (int j = 0; j < 4; ++j) {
      const __m512i p = _mm512_loadu_si512(w + 64 * j);
      v[j] = _mm512_and_si512(p, low);
      v[j + 4] = _mm512_and_si512(_mm512_srli_epi16(p, 4), low);
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 256)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 288)));
    for (int r = 0; r < R; ++r) {
      const int64_t i = r * x.G + g;
      const __m512i s = dot8<R>(v, x.q + i * 32);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(x.dx[i])), acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.dxs[i]), acc[r]);
    }
  }
};
struct W8 {  // Q8_0: q + 128 as unsigned bytes (512), then d[16] fp16
  static constexpr int64_t BYTES = 544;
  template <int R>
  SPECBLOCK_VNNI static inline void group(const uint8_t* w, const Rows8& x, int64_t g, __m512* acc) {
    __m512i v[8];
    for (int t = 0; t < 8; ++t) v[t] = _mm512_loadu_si512(w + 64 * t);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 512)));
    for (int r = 0; r < R; ++r) {
      const int64_t i = r * x.G + g;
      const __m512i s = _mm512_sub_epi32(dot8<R>(v, x.q + i * 32), _mm512_set1_epi32(x.s128[i]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(x.dx[i])), acc[r]);
    }
  }
};
// Rows [0, R) of x against one block: groups in order, the next ones prefetched: ``ahead`` groups on
// into L1, ``far`` groups on into L2 (0: off).
template <class W, int R>
SPECBLOCK_VNNI void block8(const uint8_t* w, Rows8 x, float* y, int64_t N, int64_t ahead, int64_t far) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < x.G; ++g) {
    const uint8_t* wg = w + g * W::BYTES;
    if (ahead > 0)
      for (int64_t o = 0; o < W::BYTES; o += 64) _mm_prefetch(reinterpret_cast<const char*>(wg + ahead * W::BYTES + o), _MM_HINT_T0);
    if (far > 0)
      for (int64_t o = 0; o < W::BYTES; o += 64) _mm_prefetch(reinterpret_cast<const char*>(wg + far * W::BYTES + o), _MM_HINT_T1);
    W::template group<R>(wg, x, g, acc);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * N, acc[r]);
}

template <class W>
struct Passes8 {
  using Fn = void (*)(const uint8_t*, Rows8, float*, int64_t, int64_t, int64_t);
  static constexpr Fn BY_ROWS[9] = {nullptr, block8<W, 1>, block8<W, 2>, block8<W, 3>, block8<W, 4>,
                                    block8<W, 5>, block8<W, 6>, block8<W, 7>, block8<W, 8>};
};

// Groups this many ahead are prefetched into L1 (0: off), as the fp32 kernel's blocks are; and this
// many further on into L2 (0: off). Without the second, a weight stream from L3 or DRAM overlapped
// little with the kernel's work at 8 rows (experiments/int8_kernel_bound.py, int8_prefetch.py).
std::atomic<int64_t> prefetch_groups{8};
std::atomic<int64_t> far_groups{32};

// x [M, K] fp32 times w uint8 [N/16, K/32, BYTES] (BYTES 320: Q4_1, 544: Q8_0) -> [M, N] fp32.
at::Tensor linear8(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(vnni_ok(), "specblock_q4::linear8 needs AVX512F, AVX512BW, AVX512-VNNI and FMA");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "specblock_q4::linear8: x must be 2-D float32");
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kByte && (w.size(2) == W4::BYTES || w.size(2) == W8::BYTES) &&
              w.is_contiguous(), "specblock_q4::linear8: w must be contiguous uint8 [N/16, K/32, 320 (Q4_1) or 544 (Q8_0)]");
  const int64_t M = x.size(0), K = x.size(1), G = w.size(1), N = w.size(0) * NF;
  TORCH_CHECK(K == G * 32, "specblock_q4::linear8: x has ", K, " inputs, the weights ", G * 32);
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  std::vector<int8_t> xq(M * K);
  std::vector<float> dx(M * G), dxs(M * G);
  std::vector<int32_t> s128(M * G);
  quantize_rows(xc.data_ptr<float>(), M * G, xq.data(), dx.data(), dxs.data(), s128.data());
  const bool q8 = w.size(2) == W8::BYTES;
  const int64_t bytes = w.size(2), ahead = prefetch_groups.load(std::memory_order_relaxed),
                far = far_groups.load(std::memory_order_relaxed);
  const auto* wp = static_cast<const uint8_t*>(w.data_ptr());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N / NF, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t r = 0; r < M; r += 8) {
        const Rows8 rows{xq.data() + r * K, dx.data() + r * G, dxs.data() + r * G, s128.data() + r * G, G};
        const int R = static_cast<int>(std::min<int64_t>(8, M - r));
        (q8 ? Passes8<W8>::BY_ROWS[R] : Passes8<W4>::BY_ROWS[R])(wp + b * G * bytes, rows, yp + r * N + b * NF, N, r == 0 ? ahead : 0,
                                                                  r == 0 ? far : 0);
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

// Either kernel's weights: the int8 kernel's are one 3-D tensor (dm empty).
at::Tensor linear_key(const at::Tensor& x, int64_t key, int64_t out_features) {
  auto w = find(key);
  const bool int8 = w.first.dim() == 3;
  const int64_t n = w.first.size(0) * (int8 ? NF : NB);
  TORCH_CHECK(n == out_features, "specblock_q4::linear_key: key ", key, " holds ", n, " outputs, not ", out_features);
  return int8 ? linear8(x, w.first) : linear(x, w.first, w.second);
}

}  // namespace

TORCH_LIBRARY(specblock_q4, m) {
  m.def("linear(Tensor x, Tensor qb, Tensor dm) -> Tensor");
  m.def("linear_key(Tensor x, int key, int out_features) -> Tensor");
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
  m.impl("linear8", linear8);
}
