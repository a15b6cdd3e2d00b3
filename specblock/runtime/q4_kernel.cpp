#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
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

// The bf16 checkpoint's weights from the same bytes (--dtype packed-q4): each d * q + m (d * q)
// rounded to bf16, ties to even, as torch rounds a float (the converter's last step; finite
// values only, which these are). Then widened back: exact in fp32.
SPECBLOCK_AVX512 static inline __m512 round_bf16(__m512 w) {
  const __m512i b = _mm512_castps_si512(w);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), odd);
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
// Q4_1's 16 values per feature and group as a table (one multiply-add and one rounding per 32
// weights), each weight looked up by its nibble: the lookup reads an index's low 4 bits only, so
// the low nibbles need no mask.
struct Q4_1B {
  static constexpr int QB = 16, SB = 2;
  SPECBLOCK_AVX512 static inline void decode(const uint8_t* q, const float* s, __m512& lo, __m512& hi) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 t = round_bf16(_mm512_fmadd_ps(iota, _mm512_set1_ps(s[0]), _mm512_set1_ps(s[1])));
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    lo = _mm512_permutexvar_ps(b, t);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), t);
  }
};
struct Q8_0B {
  static constexpr int QB = 32, SB = 1;
  SPECBLOCK_AVX512 static inline void decode(const uint8_t* q, const float* s, __m512& lo, __m512& hi) {
    Q8_0::decode(q, s, lo, hi);
    lo = round_bf16(lo);
    hi = round_bf16(hi);
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

// One linear's weights: the fp32 kernel's (qb, dm) and whether they stand for their bf16 roundings
// (Q4_1B, Q8_0B); the int8 kernel's are qb alone (3-D, dm empty); the AMX kernel's (q4_amx.cpp) are
// rounded to bf16 and laid out by tiles of 16 features (amx).
struct Weights {
  at::Tensor qb, dm;
  bool bf16 = false;
  bool amx = false;
  bool q8() const { return qb.scalar_type() == at::kChar; }  // Q8_0 (the head), else Q4_1
  const uint8_t* bytes() const { return static_cast<const uint8_t*>(qb.data_ptr()); }
};

// Several weights that read one x, their blocks (of NB features, or of 16 for AMX) numbered side by
// side from 0 (``starts``: each weight's first), computed in parallel chunks of that range: each
// chunk hands run(w, lo, hi, first) each weight w it overlaps, lo/hi counted in w's own blocks and
// first its first block (where its outputs start, in blocks).
template <class Run>
void parallel_parts(const std::vector<Weights>& ws, const std::vector<int64_t>& starts, int64_t blocks, Run run) {
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (size_t i = 0; i < ws.size(); ++i) {
      const int64_t n = ws[i].qb.size(0), lo = std::max(b0, starts[i]) - starts[i], hi = std::min(b1, starts[i] + n) - starts[i];
      if (lo < hi) run(ws[i], lo, hi, starts[i]);
    }
  });
}

// x [M, K] fp32 times one weight (see check_weights) -> [M, N] fp32.
at::Tensor run_fp32(const at::Tensor& x, const std::vector<Weights>& ws);
at::Tensor linear(const at::Tensor& x, const at::Tensor& qb, const at::Tensor& dm, bool bf16) { return run_fp32(x, {{qb, dm, bf16}}); }

// @include q4_int8.cpp

// @include q4_amx.cpp

// The fp32 kernel over several weights at once, as run8.
at::Tensor run_fp32(const at::Tensor& x, const std::vector<Weights>& ws) {
  TORCH_CHECK(cpu_ok(), "specblock_q4::linear needs AVX512F, AVX512BW and FMA");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "specblock_q4::linear: x must be 2-D float32");
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<int64_t> starts;
  int64_t blocks = 0;
  for (const auto& w : ws) {
    check_weights(w.qb, w.dm);
    TORCH_CHECK(K == w.qb.size(1) * 32, "specblock_q4::linear: x has ", K, " inputs, the weights ", w.qb.size(1) * 32);
    starts.push_back(blocks);
    blocks += w.qb.size(0);
  }
  const int64_t N = blocks * NB;
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  parallel_parts(ws, starts, blocks, [&](const Weights& w, int64_t lo, int64_t hi, int64_t first) {
    const auto run = w.bf16 ? (w.q8() ? run_blocks<Q8_0B> : run_blocks<Q4_1B>) : (w.q8() ? run_blocks<Q8_0> : run_blocks<Q4_1>);
    run(xp, M, K, w.bytes(), w.dm.data_ptr<float>(), lo, hi, yp + first * NB, N);
  });
  return y;
}

// Weights by key, for compiled graphs: a graph that holds an int instead of two tensors per
// linear leaves dynamo 420 fewer tensors to guard on every call.
std::shared_mutex mu;
std::unordered_map<int64_t, Weights> table;

void put(int64_t key, const at::Tensor& qb, const at::Tensor& dm, bool bf16) {
  std::unique_lock<std::shared_mutex> lock(mu);
  table[key] = {qb, dm, bf16};
}

void put_amx(int64_t key, const at::Tensor& qb, const at::Tensor& dm) {
  std::unique_lock<std::shared_mutex> lock(mu);
  table[key] = {qb, dm, true, true};
}

void drop(int64_t key) {
  std::unique_lock<std::shared_mutex> lock(mu);
  table.erase(key);
}

Weights find(int64_t key) {
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
  std::vector<Weights> ws;
  int64_t n = 0;
  for (const int64_t key : keys) {
    ws.push_back(find(key));
    n += ws.back().qb.size(0) * (ws.back().amx ? 16 : ws.back().qb.dim() == 3 ? NF : NB);
  }
  TORCH_CHECK(n == out_features, "specblock_q4::linear_key: keys hold ", n, " outputs, not ", out_features);
  for (const auto& w : ws)
    TORCH_CHECK(w.amx == ws[0].amx, "specblock_q4::linear_key_cat: AMX keys and others in one call");
  if (ws[0].amx) return run_amx(x, ws);
  const bool int8 = ws[0].qb.dim() == 3;
  for (const auto& w : ws)
    TORCH_CHECK((w.qb.dim() == 3) == int8, "specblock_q4::linear_key_cat: keys of both kernels in one call");
  if (!int8) return run_fp32(x, ws);
  std::vector<at::Tensor> w8;
  for (const auto& w : ws) w8.push_back(w.qb);
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
  m.def("linear(Tensor x, Tensor qb, Tensor dm, bool bf16=False) -> Tensor");
  m.def("linear_key(Tensor x, int key, int out_features) -> Tensor");
  m.def("linear_key_cat(Tensor x, int key0, int key1, int key2, int key3, int out_features) -> Tensor");
  m.def("put(int key, Tensor qb, Tensor dm, bool bf16=False) -> ()", put);
  m.def("linear_amx(Tensor x, Tensor qb, Tensor dm) -> Tensor");
  m.def("put_amx(int key, Tensor qb, Tensor dm) -> ()", put_amx);
  m.def("amx_ok() -> bool", amx_ok);
  m.def("bf16dot_ok() -> bool", bf16dot_ok);
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
  m.impl("linear_amx", linear_amx);
}
