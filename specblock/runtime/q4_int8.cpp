// q4's int8 kernel: part of q4_kernel.cpp's translation unit, inside its anonymous namespace.
// cext.read_source puts this text where q4_kernel.cpp says `// @include q4_int8.cpp` (the
// build's hash covers both files).

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
