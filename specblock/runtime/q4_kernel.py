"""``--dtype q4``'s own kernel: Q4_1 (and Q8_0) weights times fp32 activations, in AVX512, row-independent.

Why: torch's CPU int4 kernel (``_weight_int4pack_mm_for_cpu``) rounds its input and output to
bf16, so a q4 target was lossless only like bf16 (speculative methods parted from plain decoding
at near-ties, ``experiments/results/q4_rows.md``). This kernel keeps fp32 activations and fp32
sums, and multiplies by the exact Q4_1 weights ``d * q + m`` (``d * q`` is exact in fp32 since
``d`` is fp16 and ``q`` < 16, so one fused multiply-add gives ``dequantize_q4_1`` bit for bit).
Every output is the same sequence of fused multiply-adds (16 lanes per group half, groups in
order, then one horizontal sum) whatever the number of rows in the call or which rows share a
pass, so a token's result does not depend on the tree it sits in. With that, a q4 target is
lossless like fp32: every method equals plain decoding token for token (``tests/test_q4.py``).

Speed (``experiments/q4_rows.py``, its second table): the weights are read as 4 bits and decoded
once per pass in registers, so the real model's decoder linears cost about half of fbgemm's fp16
GEMM at one row; from about 8 rows on both are bound by fp32 multiply-adds and cost about the same.

Layout (``layout``): per block of 4 output features and group of 32 inputs, 64 bytes of nibbles
(byte ``i`` of a feature: input ``i`` low, input ``i + 16`` high, ggml's own order) and
``(d, m)`` per feature as fp32; a pass reads one block's bytes in order. The LM head, which a
Q4_1 GGUF keeps as Q8_0 (``d * q``, a signed byte per weight: also exact in fp32), goes through
the same passes with 128 bytes and one ``d`` per block (``layout_q8``): about half the bytes of an
fp16 head. Up to 4 rows go through a block in one pass (4 x 4 accumulators); more rows go 8 at a
time over half a block. While a block is computed the next one is prefetched: a forward reads each
weight once, in short streams the hardware prefetcher meets late (``experiments/q4_prefetch.py``:
compiled T(1) 14.05 -> 10.30 ms, T(4) 24.18 -> 14.84 on a Xeon).

Built on first use with the C++ compiler torch's extensions use (once per machine and torch
version, under ``$SPECBLOCK_HOME/extensions``, about 8 s); the instructions are chosen per
function (``target`` attributes) and the CPU is checked before use, so a build never runs where
AVX512 is missing. Where it cannot run, q4 falls back to torch's kernel and says so once.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import warnings
import weakref
from pathlib import Path

import torch

from specblock.q4file import GROUP

NB = 4  # output features per stored block
SOURCE = r"""
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
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

at::Tensor linear_key(const at::Tensor& x, int64_t key, int64_t out_features) {
  auto w = find(key);
  TORCH_CHECK(w.first.size(0) * NB == out_features, "specblock_q4::linear_key: key ", key, " holds ",
              w.first.size(0) * NB, " outputs, not ", out_features);
  return linear(x, w.first, w.second);
}

}  // namespace

TORCH_LIBRARY(specblock_q4, m) {
  m.def("linear(Tensor x, Tensor qb, Tensor dm) -> Tensor");
  m.def("linear_key(Tensor x, int key, int out_features) -> Tensor");
  m.def("put(int key, Tensor qb, Tensor dm) -> ()", put);
  m.def("drop(int key) -> ()", drop);
  m.def("set_prefetch(int blocks) -> ()", [](int64_t n) { prefetch_ahead.store(std::max<int64_t>(n, 0)); });
}
TORCH_LIBRARY_IMPL(specblock_q4, CPU, m) {
  m.impl("linear", linear);
  m.impl("linear_key", linear_key);
}
"""

_STATE: dict[str, object] = {}


def cpu_supports() -> bool:
    """AVX512F, AVX512BW and FMA (the extension checks again before running)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return {"avx512f", "avx512bw", "fma"} <= flags


def build_name() -> str:
    digest = hashlib.sha256((SOURCE + torch.__version__).encode()).hexdigest()[:12]
    return f"specblock_q4_{digest}"


def _build() -> None:
    from torch.utils.cpp_extension import load_inline

    from specblock.models.registry import specblock_home

    where = specblock_home() / "extensions" / build_name()
    where.mkdir(parents=True, exist_ok=True)
    # -fopenmp: at::parallel_for is an OpenMP region compiled into this library (without it, one thread)
    load_inline(build_name(), cpp_sources=[SOURCE], is_python_module=False, build_directory=str(where),
                extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False, no_implicit_headers=True)
    torch.library.register_fake("specblock_q4::linear", _fake)
    torch.library.register_fake("specblock_q4::linear_key", _fake_key)


def _fake(x: torch.Tensor, qb: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], qb.shape[0] * NB))


def _fake_key(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], out_features))


def load() -> bool:
    """Build (or load) the extension once per process; False, with one warning, where it cannot run."""
    if "ok" not in _STATE:
        why = None
        if os.environ.get("SPECBLOCK_Q4_KERNEL", "fp32") == "bf16":
            why = "SPECBLOCK_Q4_KERNEL=bf16 asks for torch's kernel"
        elif not cpu_supports():
            why = "this CPU has no AVX512F/AVX512BW"
        else:
            try:
                _build()
            except Exception as exc:  # a missing compiler or headers: torch's kernel, lossless only like bf16
                lines = str(exc).strip().splitlines()
                why = f"the extension could not be built ({type(exc).__name__}: {lines[-1] if lines else exc!r})"
        _STATE["ok"] = why is None
        if why is not None and "SPECBLOCK_Q4_KERNEL" not in why:
            warnings.warn(f"specblock: q4 runs torch's int4 kernel, lossless only like bf16 ({why})", stacklevel=2)
    return bool(_STATE["ok"])


def layout(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q4_1 triple as ``q4file`` stores it (``[N, K/2]`` nibbles, element ``2j`` low; fp16 ``d``,
    ``m`` ``[N, K/32]``) -> the kernel's ``qb`` uint8 ``[N/4, K/32, 4, 16]`` and ``dm`` fp32 ``[N/4, K/32, 4, 2]``."""
    n, k = qs.shape[0], qs.shape[1] * 2
    if n % NB or k % GROUP:
        raise ValueError(f"a {k} -> {n} linear does not fit the q4 kernel (inputs in groups of {GROUP}, outputs in {NB}s)")
    q = torch.stack([qs & 0xF, qs >> 4], -1).reshape(n, k // GROUP, 2, 16)  # uint8 throughout: loads stay quick
    nib = q[:, :, 0] | (q[:, :, 1] << 4)  # [N, G, 16]: input i low, input i + 16 high
    qb = nib.reshape(n // NB, NB, k // GROUP, 16).transpose(1, 2).contiguous()
    dm = torch.stack([d.float(), m.float()], -1).reshape(n // NB, NB, k // GROUP, 2).transpose(1, 2).contiguous()
    return qb, dm


def layout_q8(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 pair as ``q4file`` stores it (int8 ``q`` ``[N, K]``, fp16 ``d`` ``[N, K/32]``) -> the
    kernel's ``qb`` int8 ``[N/4, K/32, 4, 32]`` and ``dm`` fp32 ``[N/4, K/32, 4, 1]``."""
    n, k = q.shape
    if n % NB or k % GROUP:
        raise ValueError(f"a {k} -> {n} linear does not fit the q4 kernel (inputs in groups of {GROUP}, outputs in {NB}s)")
    qb = q.to(torch.int8).reshape(n // NB, NB, k // GROUP, GROUP).transpose(1, 2).contiguous()
    dm = d.float().reshape(n // NB, NB, k // GROUP, 1).transpose(1, 2).contiguous()
    return qb, dm


def linear(x: torch.Tensor, qb: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` fp32 times Q4_1 weights (``layout``) or Q8_0 ones (``layout_q8``): ``[M, N]`` fp32."""
    return torch.ops.specblock_q4.linear(x, qb, dm)


_KEYS = itertools.count()


def register(qb: torch.Tensor, dm: torch.Tensor, owner: object) -> int:
    """Keep ``(qb, dm)`` under a new key until ``owner`` is collected: what a compiled graph calls
    ``linear_key`` with (ints are cheap to guard, tensors are not)."""
    key = next(_KEYS)
    torch.ops.specblock_q4.put(key, qb, dm)
    weakref.finalize(owner, _drop, key)
    return key


def _drop(key: int) -> None:
    try:
        torch.ops.specblock_q4.drop(key)
    except (AttributeError, RuntimeError):  # interpreter shutdown: the library may be gone first
        pass


def linear_key(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return torch.ops.specblock_q4.linear_key(x, key, out_features)
