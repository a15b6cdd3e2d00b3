// --dtype packed-q4-amx: the bf16 checkpoint's weights from their 4-bit codes (as packed-q4), times
// the activations rounded to bf16, summed in fp32 by AMX tiles (TDPBF16PS), or on a CPU without tiles
// by AVX512-BF16 dot products (VDPBF16PS, the end of this file). Included into q4_kernel.cpp after the
// fp32 kernel; q4_kernel.py says why.
//
// Per tile of 16 output features and group of 32 inputs: the 16 features' weights decoded to bf16
// (an A tile, 1 KB) times the rows' inputs of the group (a B tile: 16 input pairs x M rows), added to
// a C tile of 16 features x M rows. A row's outputs take the same operations whatever the other rows
// (each C element reads only its row's B column), so a token's result does not depend on its tree.
// Weights: qb [N/16, K/32, 16, QB] and dm fp32 [N/16, K/32, 16, SB] (QB, SB as the fp32 kernel's
// formats): one tile's group is 256 (Q4_1) or 512 (Q8_0) contiguous bytes.

// The decoders need no tiles, so the AVX512-BF16 kernel below inlines them too.
#define SPECBLOCK_BF16DOT __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))
#define SPECBLOCK_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma,amx-tile,amx-bf16")))

constexpr int AMX_ROWS = 16;  // rows of x per pass: a B tile's columns
constexpr int AMX_PAIRS = 2;  // feature tiles per pass: two C tiles in flight share each B tile
// Groups ahead whose weights are prefetched (an AMX pass reads 2 x 16 features' streams).
constexpr int64_t AMX_AHEAD = 2;

struct TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Linux hands AMX's tile state to a process that asks for it (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); without it the first tile instruction faults.
bool amx_ok() {
  static const bool ok = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("amx-tile") &&
                         __builtin_cpu_supports("amx-bf16") && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

// A feature's 32 weights of a group as 32 bf16 in input order: bf16(d * q + m) from a 16-entry
// table (the fp32 kernel's multiply-add, rounded to nearest even by the conversion), looked up by
// nibble (vpermw reads 5 index bits: the low nibbles are masked).
struct AmxQ4_1 {
  static constexpr int QB = 16, SB = 2;
  SPECBLOCK_BF16DOT static inline __m512i decode(const uint8_t* q, const float* s) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m256i tab = (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(iota, _mm512_set1_ps(s[0]), _mm512_set1_ps(s[1])));
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(b, _mm256_set1_epi16(15))),
                                           _mm256_srli_epi16(b, 4), 1);
    return _mm512_permutexvar_epi16(idx, _mm512_castsi256_si512(tab));
  }
};
struct AmxQ8_0 {  // bf16(d * q): the head
  static constexpr int QB = 32, SB = 1;
  SPECBLOCK_BF16DOT static inline __m512i decode(const uint8_t* q, const float* s) {
    __m512 lo, hi;
    Q8_0::decode(q, s, lo, hi);
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  }
};

// Rows [r0, r0 + m) of x [M, K] -> B tiles: per group, 16 rows (input pairs) of m dwords, a row's
// pair of inputs as two bf16 (rounded to nearest even).
SPECBLOCK_AMX void amx_inputs(const float* x, int64_t K, int64_t m, uint32_t* xb) {
  const int64_t G = K / 32;
  const __m512i pair = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(static_cast<int>(m)));
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < G; ++g) {
      const float* p = x + r * K + g * 32;
      const __m512i v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + 16), _mm512_loadu_ps(p));
      _mm512_i32scatter_epi32(xb + g * 16 * m + r, pair, v, 4);
    }
}

// Feature tiles [t0, t1) of one weight into columns 16 t.. of y's rows [0, m) (row stride N).
template <class F>
SPECBLOCK_AMX void amx_tiles(const uint32_t* xb, int64_t m, int64_t K, const uint8_t* qp, const float* dp, int64_t t0,
                             int64_t t1, float* y, int64_t N) {
  const int64_t G = K / 32;
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t : {0, 1, 2}) cfg.rows[t] = 16;  // C0, C1, B: 16 rows of m dwords
  for (int t : {0, 1, 2}) cfg.colsb[t] = static_cast<uint16_t>(m * 4);
  for (int t : {3, 4}) cfg.rows[t] = 16, cfg.colsb[t] = 64;  // A0, A1: 16 features x 32 bf16
  _tile_loadconfig(&cfg);
  alignas(64) uint16_t a[2][AMX_PAIRS][16 * 32];  // by group parity: a group's stores never wait on the last one's loads
  alignas(64) float c[16 * AMX_ROWS];
  const __m512i col = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(static_cast<int>(m)));
  const int64_t tile_q = G * 16 * F::QB, tile_s = G * 16 * F::SB;
  for (int64_t t = t0; t < t1; t += AMX_PAIRS) {
    const int nt = static_cast<int>(std::min<int64_t>(AMX_PAIRS, t1 - t));
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t g = 0; g < G; ++g) {
      if (g + AMX_AHEAD < G)
        for (int u = 0; u < nt; ++u) {
          const char* pq = reinterpret_cast<const char*>(qp + (t + u) * tile_q + (g + AMX_AHEAD) * 16 * F::QB);
          const char* ps = reinterpret_cast<const char*>(dp + (t + u) * tile_s + (g + AMX_AHEAD) * 16 * F::SB);
          for (int o = 0; o < 16 * F::QB; o += 64) _mm_prefetch(pq + o, _MM_HINT_T0);
          for (int o = 0; o < 16 * F::SB * 4; o += 64) _mm_prefetch(ps + o, _MM_HINT_T0);
        }
      _tile_loadd(2, xb + g * 16 * m, static_cast<int>(m * 4));
      for (int u = 0; u < nt; ++u) {
        uint16_t* buf = a[g & 1][u];
        const uint8_t* q = qp + (t + u) * tile_q + g * 16 * F::QB;
        const float* s = dp + (t + u) * tile_s + g * 16 * F::SB;
        for (int f = 0; f < 16; ++f)
          _mm512_store_si512(reinterpret_cast<__m512i*>(buf + f * 32), F::decode(q + f * F::QB, s + f * F::SB));
        if (u == 0) {
          _tile_loadd(3, buf, 64);
          _tile_dpbf16ps(0, 3, 2);
        } else {
          _tile_loadd(4, buf, 64);
          _tile_dpbf16ps(1, 4, 2);
        }
      }
    }
    for (int u = 0; u < nt; ++u) {
      if (u == 0) _tile_stored(0, c, static_cast<int>(m * 4));
      else _tile_stored(1, c, static_cast<int>(m * 4));
      for (int64_t r = 0; r < m; ++r) _mm512_storeu_ps(y + r * N + (t + u) * 16, _mm512_i32gather_ps(col, c + r, 4));
    }
  }
  _tile_release();
}

// One call of x [M, K] fp32 times several AMX weights that read it, checked, as both kernels start it:
// the weights' tiles numbered side by side (``starts``: each weight's first, as parallel_parts takes
// them; ``tiles`` in all), x contiguous, and y [M, N = 16 x tiles] for their outputs side by side.
struct TileCall {
  std::vector<int64_t> starts;
  int64_t tiles = 0, M, K, N;
  at::Tensor xc, y;

  TileCall(const at::Tensor& x, const std::vector<Weights>& ws) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "specblock_q4::linear_amx: x must be 2-D float32");
    for (const auto& w : ws) {
      TORCH_CHECK(w.qb.dim() == 4 && w.qb.size(2) == 16 && w.dm.dim() == 4, "specblock_q4::linear_amx: not AMX weights");
      TORCH_CHECK(x.size(1) == w.qb.size(1) * 32, "specblock_q4::linear_amx: x has ", x.size(1), " inputs, the weights ",
                  w.qb.size(1) * 32);
      starts.push_back(tiles);
      tiles += w.qb.size(0);
    }
    M = x.size(0), K = x.size(1), N = tiles * 16;
    xc = x.contiguous();
    y = at::empty({M, N}, x.options());
  }
};

at::Tensor run_bf16dot(const at::Tensor& x, const std::vector<Weights>& ws);

// x [M, K] fp32 times several AMX weights that read it: [M, N] fp32, their outputs side by side. On
// tiles where the CPU has them, on AVX512-BF16 dot products elsewhere (run_bf16dot, below).
at::Tensor run_amx(const at::Tensor& x, const std::vector<Weights>& ws) {
  if (!amx_ok()) return run_bf16dot(x, ws);
  const TileCall call(x, ws);
  const int64_t M = call.M, K = call.K, N = call.N;
  const at::Tensor& xc = call.xc;
  const at::Tensor& y = call.y;
  // amx_inputs writes every entry a pass reads: no zeroing
  const std::unique_ptr<uint32_t[]> xb(new uint32_t[static_cast<size_t>(K / 32) * 16 * AMX_ROWS]);
  for (int64_t r0 = 0; r0 < M; r0 += AMX_ROWS) {
    const int64_t m = std::min<int64_t>(AMX_ROWS, M - r0);
    amx_inputs(xc.data_ptr<float>() + r0 * K, K, m, xb.get());
    float* yp = y.data_ptr<float>() + r0 * N;
    parallel_parts(ws, call.starts, call.tiles, [&](const Weights& w, int64_t lo, int64_t hi, int64_t first) {
      (w.q8() ? amx_tiles<AmxQ8_0> : amx_tiles<AmxQ4_1>)(xb.get(), m, K, w.bytes(), w.dm.data_ptr<float>(), lo, hi,
                                                          yp + first * 16, N);
    });
  }
  return y;
}

at::Tensor linear_amx(const at::Tensor& x, const at::Tensor& qb, const at::Tensor& dm) {
  return run_amx(x, {{qb, dm, true, true}});
}

// ---- The same products without tiles, for CPUs with AVX512-BF16 but no AMX (AMD Zen 4 and 5,
// Intel Cooper Lake). Per feature and group: its 32 weights decoded to bf16 as above (one register),
// one VDPBF16PS per row against the row's 32 inputs rounded to bf16, accumulated per lane over the
// groups in order; then each output is its accumulator's horizontal sum in _mm512_reduce_add_ps's
// tree (``sum16`` gives 16 of them in that same tree at once). A row's outputs take the same
// operations whatever the call's rows (passes of 1, 2, 4 or 8 rows; weights decoded in the pass or
// read back from a buffer, the same bits). The sums run in another order than AMX's, so on such a CPU
// the model is this kernel's own: every method is held to its own greedy decoding, as ever.

bool bf16dot_ok() {
  static const bool ok = cpu_ok() && __builtin_cpu_supports("avx512bf16");
  return ok;
}

// x [rows x K] fp32 -> bf16 in order, rounded to nearest even.
SPECBLOCK_BF16DOT void bf16_rows(const float* x, int64_t n32, uint16_t* xb) {
  for (int64_t i = 0; i < n32; ++i)
    _mm512_storeu_si512(xb + i * 32, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i * 32 + 16), _mm512_loadu_ps(x + i * 32)));
}

// 16 accumulators -> their 16 horizontal sums, each in _mm512_reduce_add_ps's tree: lanes i + i+8,
// then i + i+4, then i + i+2, then the last two (float addition commutes, so each sum is the same bits).
SPECBLOCK_BF16DOT inline __m512 sum16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // [a2i lanes 0-7 + 8-15 | a2i+1 the same]
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // per 128-bit chunk: one feature's 4 partial sums (features 4i .. 4i + 3)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88), _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // per chunk: (x0 + x2, x1 + x3) of two features
    d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44), _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
  const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
  // lane 4k + m holds accumulator k + 4m: put each back in its own lane
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, s);
}

// Groups ahead whose bytes and scales are prefetched, by the pass that first reads a tile's groups
// (2 measured best on Zen 5 with weights streamed from memory, against 1 tile ahead at once and 4).
// Past a tile's last group come the next tile's first: the layout runs on.
constexpr int64_t DOT_AHEAD = 2;

template <class F>
SPECBLOCK_BF16DOT inline void prefetch_group(const uint8_t* q, const float* s) {
  for (int o = 0; o < 16 * F::QB; o += 64) _mm_prefetch(reinterpret_cast<const char*>(q) + o, _MM_HINT_T0);
  for (int o = 0; o < 16 * F::SB * 4; o += 64) _mm_prefetch(reinterpret_cast<const char*>(s) + o, _MM_HINT_T0);
}

// Rows [0, R) of xb against features [j0, j0 + NJ) of one tile (qp, dp: its first group). R x NJ
// accumulators, at most 28 of the 32 registers (the rest hold the NJ decoded weights and a row); each sums
// one row's products in group order, so a row's bits do not depend on R or NJ.
template <class F, int R, int NJ>
SPECBLOCK_BF16DOT void dot_rows(const uint16_t* xb, int64_t K, const uint8_t* qp, const float* dp, int j0, float* y, int64_t N) {
  const int64_t G = K / 32;
  static_assert(R * NJ <= 28 && 16 % NJ == 0, "accumulators beside NJ weights and a row in 32 registers; passes tile 16 features");
  __m512 acc[R][NJ];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NJ; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    if (F::SB > 0 && j0 == 0) prefetch_group<F>(qp + (g + DOT_AHEAD) * 16 * F::QB, dp + (g + DOT_AHEAD) * 16 * F::SB);
    __m512i w[NJ];
#pragma GCC unroll 16
    for (int j = 0; j < NJ; ++j) w[j] = F::decode(qp + (g * 16 + j0 + j) * F::QB, dp + (g * 16 + j0 + j) * F::SB);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh xr = (__m512bh)_mm512_loadu_si512(xb + r * K + g * 32);
#pragma GCC unroll 16
      for (int j = 0; j < NJ; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)w[j], xr);
    }
  }
  // sum16 reduces 16 accumulators (zeros past the last) in one tree each: lane i of chunk c's sums is
  // accumulator c + i, row-major, so row (c + i) / NJ's feature j0 + (c + i) % NJ
  for (int c = 0; c < R * NJ; c += 16) {
    __m512 all[16];
    for (int i = 0; i < 16; ++i) all[i] = c + i < R * NJ ? acc[(c + i) / NJ][(c + i) % NJ] : _mm512_setzero_ps();
    alignas(64) float sums[16];
    _mm512_store_ps(sums, sum16(all));
    for (int i = 0; i < 16 && c + i < R * NJ; ++i) y[((c + i) / NJ) * N + j0 + (c + i) % NJ] = sums[i];
  }
}

// Up to this many rows one pass takes them all, decoding each weight once as it goes; more rows go in
// passes of 8 over a tile decoded once into a buffer (experiments/bf16_rows.py). Until stop 71, 5 and 6
// rows ran as passes of 4 + 1 and 4 + 2, each decoding the weights, and 3 and 7 as padded passes of 4
// and 8: 5 to 7 rows now keep 4 features a pass (20-28 accumulators, a few spilled at 7), 10-16% less
// time for the forward's linears than before, 3 rows 9% (bf16_rows_zen5_passes_s71, same bits). Two features a
// pass (16 accumulators at most) was no faster for 5 or 6 rows: its eight reductions per tile cost as
// much as the decode saved; 8 rows keep them (4 features measured the same).
constexpr int64_t DOT_INLINE_ROWS = 8;

// A tile's weights already decoded (dot_tiles' buffer): a feature's group is 64 bytes of bf16.
struct DotDecoded {
  static constexpr int QB = 64, SB = 0;
  SPECBLOCK_BF16DOT static inline __m512i decode(const uint8_t* q, const float*) { return _mm512_loadu_si512(q); }
};

// The pass for R = 1..8 rows (index R - 1): 4 features at once from 3 rows on, 2 at 8 (DOT_INLINE_ROWS).
template <class F>
struct DotPasses {
  using Fn = void (*)(const uint16_t*, int64_t, const uint8_t*, const float*, int, float*, int64_t);
  static constexpr Fn P[8] = {dot_rows<F, 1, 16>, dot_rows<F, 2, 8>, dot_rows<F, 3, 4>, dot_rows<F, 4, 4>,
                              dot_rows<F, 5, 4>,  dot_rows<F, 6, 4>, dot_rows<F, 7, 4>, dot_rows<F, 8, 2>};
  static constexpr int NJ[8] = {16, 8, 4, 4, 4, 4, 4, 2};
  // a call's n rows (1..8) in one pass over each group of NJ features in turn
  SPECBLOCK_BF16DOT static void run(const uint16_t* xb, int64_t K, const uint8_t* q, const float* s, float* y, int64_t N,
                                    int64_t n) {
    for (int j0 = 0; j0 < 16; j0 += NJ[n - 1]) P[n - 1](xb, K, q, s, j0, y, N);
  }
};

template <class F>
SPECBLOCK_BF16DOT void dot_tiles(const uint16_t* xb, int64_t M, int64_t K, const uint8_t* qp, const float* dp, int64_t t0,
                                    int64_t t1, float* y, int64_t N) {
  const int64_t G = K / 32, tile_q = G * 16 * F::QB, tile_s = G * 16 * F::SB;
  static thread_local std::vector<uint16_t> decoded;  // read and written unaligned
  if (M > DOT_INLINE_ROWS && static_cast<int64_t>(decoded.size()) < G * 16 * 32) decoded.resize(G * 16 * 32);
  uint16_t* const buf = decoded.data();
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* q = qp + t * tile_q;
    const float* s = dp + t * tile_s;
    if (M <= DOT_INLINE_ROWS) {  // one pass, decoding as it goes
      DotPasses<F>::run(xb, K, q, s, y + t * 16, N, M);
      continue;
    }
    // more rows: the tile decoded once, in one sweep of its bytes, for every pass to read
    for (int64_t g = 0; g < G; ++g) {
      prefetch_group<F>(q + (g + DOT_AHEAD) * 16 * F::QB, s + (g + DOT_AHEAD) * 16 * F::SB);
      for (int64_t i = g * 16; i < g * 16 + 16; ++i) _mm512_storeu_si512(buf + i * 32, F::decode(q + i * F::QB, s + i * F::SB));
    }
    const auto* d = reinterpret_cast<const uint8_t*>(buf);
    for (int64_t r = 0; r < M; r += DOT_INLINE_ROWS) {
      const int64_t n = std::min<int64_t>(DOT_INLINE_ROWS, M - r);
      DotPasses<DotDecoded>::run(xb + r * K, K, d, nullptr, y + r * N + t * 16, N, n);
    }
  }
}

// x [M, K] fp32 times several layout_amx weights that read it, without tiles (run_amx's contract).
at::Tensor run_bf16dot(const at::Tensor& x, const std::vector<Weights>& ws) {
  TORCH_CHECK(bf16dot_ok(), "specblock_q4::linear_amx needs AMX-BF16 or AVX512-BF16");
  const TileCall call(x, ws);
  const int64_t M = call.M, K = call.K, N = call.N;
  const at::Tensor& xc = call.xc;
  const at::Tensor& y = call.y;
  if (M == 0) return y;
  const std::unique_ptr<uint16_t[]> xb(new uint16_t[static_cast<size_t>(M * K)]);  // the call's rows in bf16
  bf16_rows(xc.data_ptr<float>(), M * K / 32, xb.get());
  float* yp = y.data_ptr<float>();
  parallel_parts(ws, call.starts, call.tiles, [&](const Weights& w, int64_t lo, int64_t hi, int64_t first) {
    (w.q8() ? dot_tiles<AmxQ8_0> : dot_tiles<AmxQ4_1>)(xb.get(), M, K, w.bytes(), w.dm.data_ptr<float>(), lo, hi,
                                                        yp + first * 16, N);
  });
  return y;
}
