"""``specblock::packed_linear``'s kernel in C++ for compiled graphs: ``specblock_native::packed_linear``.

Why: a compiled packed-fp16 graph (``cpp_wrapper``) reaches each of the real model's 211 linears
through the dispatcher. With the op's kernel in Python every call takes the GIL, boxes its
arguments into Python objects and looks the weight up in a dict. That hop cost more per call than
the one-row fp16 GEMM it wraps (``python experiments/compiled_speed.py --python-kernel-baseline``
times the two side by side). This kernel does the same lookup and calls the same fbgemm routine
(``LinearPackedParamsBase::apply_dynamic``, which is what ``quantized::linear_dynamic_fp16``
runs) from C++: identical results, tested in ``tests/test_native.py``.

The extension is built on first use with the C++ compiler inductor needs anyway (once per machine
and torch version; cached under ``$SPECBLOCK_HOME/extensions``). The source includes only the
headers it uses, and ``no_implicit_headers`` keeps ``load_inline`` from adding
``torch/extension.h`` (all of libtorch's C++ API and pybind11): 7.1 s instead of 26.9 s here
(``python experiments/native_build_time.py``). Where it cannot be built, the compiled path keeps
the Python kernel and says so once: slower, same results.

The library also holds an fp16 kernel of our own, the default where the CPU has AVX512
(``SPECBLOCK_FP16_KERNEL=fbgemm`` turns it off): for calls of up to 16 fp32 rows it reads a copy of
the weights in its own layout (fp16, a block's four output features interleaved per 32 inputs, made
on first use from the modules' fp32 tensors), widens them exactly and sums in fp32, the blocks split over the threads
with the next one prefetched. Why: on the real model's own weights, one forward's linears in the
order a compiled graph calls them took 12.38 / 15.67 / 20.02 ms at 1 / 4 / 8 rows against fbgemm's
14.96 / 18.88 / 22.43 (``experiments/fp16_kernel_forward.py``, ``fp16_kernel_forward_o3_s66.md``),
and the compiled T(1) 14.64 against 16.50 ms (``compiled_speed_fp16_kernel_o3_s66.md``; built at -O2,
which does not unroll its loops over rows and features, it had lost). Each row's result is the same
bits whatever the rows beside it (fbgemm's depend on the row count), and agrees with fbgemm's to
fp32 rounding, not bit for bit. Eager forwards keep fbgemm, and prompts past 16 rows too.
"""

from __future__ import annotations

import os
import warnings

import torch

from specblock.runtime import cext, packed, q4_kernel

SOURCE = r"""
#include <torch/library.h>
#include <ATen/core/stack.h>
#include <ATen/native/quantized/PackedParams.h>
#include <ATen/Parallel.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <map>
#include <optional>
#include <shared_mutex>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace {
using Packed = c10::intrusive_ptr<LinearPackedParamsBase>;
std::shared_mutex mu;
std::unordered_map<int64_t, Packed> table;
std::map<std::vector<int64_t>, Packed> fused;  // keys of the parts -> their rows packed as one matrix

// ---- the fp16 kernel (switched by set_fp16_kernel: on by default where the CPU runs it; the Python
// module says why) ----
constexpr int NB = 4;             // output features a block
constexpr int64_t MAX_ROWS = 16;  // more rows (a prompt) go to fbgemm
std::atomic<bool> ours_on{false};
struct Ours {
  at::Tensor w;                 // fp16 [N/4, K/32, 4, 32]: a block's features interleaved per 32 inputs
  std::optional<at::Tensor> b;  // fp32 [N]
};
std::unordered_map<int64_t, Ours> ours_single;
std::map<std::vector<int64_t>, Ours> ours_fused;
// The modules' own fp32 weight and bias by key (put_dense): the layout is made from them, as
// reading fbgemm's copy back (unpack) was most of the work of making it.
std::unordered_map<int64_t, std::pair<at::Tensor, std::optional<at::Tensor>>> dense;

#define AVX512 __attribute__((target("avx512f,avx512bw,fma")))

// R rows against one block's 4 features: per group of 32 inputs each feature's 32 fp16 weights
// widened exactly, two fmas per row and feature, one horizontal sum at the end: the same operations
// for a row whatever R, so a row's result does not depend on the rows beside it.
template <int R>
AVX512 void block_rows(const float* x, int64_t K, const uint16_t* w, float* y, int64_t N) {
  const int64_t G = K / 32;
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 wl[NB], wh[NB];
    const uint16_t* q = w + g * 32 * NB;
    for (int j = 0; j < NB; ++j) {
      wl[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * j)));
      wh[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * j + 16)));
    }
    for (int r = 0; r < R; ++r) {
      const __m512 xl = _mm512_loadu_ps(x + r * K + g * 32), xh = _mm512_loadu_ps(x + r * K + g * 32 + 16);
      for (int j = 0; j < NB; ++j) {
        acc[r][j] = _mm512_fmadd_ps(wl[j], xl, acc[r][j]);
        acc[r][j] = _mm512_fmadd_ps(wh[j], xh, acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) y[r * N + j] = _mm512_reduce_add_ps(acc[r][j]);
}
using RowsFn = void (*)(const float*, int64_t, const uint16_t*, float*, int64_t);
const RowsFn ROWS_FN[5] = {nullptr, block_rows<1>, block_rows<2>, block_rows<3>, block_rows<4>};

// x [M, K] fp32 contiguous -> [M, N]: blocks split over the threads, the next block prefetched.
at::Tensor ours_linear(const at::Tensor& x, const Ours& o) {
  const int64_t M = x.size(0), K = x.size(1), N = o.w.size(0) * NB, G = K / 32;
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const auto* wp = reinterpret_cast<const uint16_t*>(o.w.data_ptr());
  float* yp = y.data_ptr<float>();
  const int64_t bytes = G * 32 * NB * 2;
  at::parallel_for(0, N / NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint16_t* q = wp + b * G * 32 * NB;
      if (b + 1 < b1) {
        const char* p = reinterpret_cast<const char*>(q) + bytes;
        for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
      }
      for (int64_t r = 0; r < M; r += 4)
        ROWS_FN[std::min<int64_t>(4, M - r)](xp + r * K, K, q, yp + r * N + b * NB, N);
    }
  });
  if (o.b) y.add_(*o.b);
  return y;
}

Packed unbox(const c10::IValue& obj, const char* who) {
  TORCH_CHECK(obj.isObject(), who, ": expected a packed linear weight");
  auto o = obj.toObject();
  TORCH_CHECK(o->type()->name() && o->type()->name()->name() == "LinearPackedParamsBase" && o->slots().size() == 1,
              who, ": expected a packed linear weight, got ", o->type()->repr_str());
  return c10::static_intrusive_pointer_cast<LinearPackedParamsBase>(o->getSlot(0).toCapsule());
}

Packed find(int64_t key) {
  std::shared_lock<std::shared_mutex> lock(mu);
  auto it = table.find(key);
  TORCH_CHECK(it != table.end(), "specblock_native::packed_linear: no packed weight under key ", key);
  return it->second;
}

// ``keys``' rows stacked in fp32, and their biases (none where no part has one): from the modules'
// own tensors where ``put_dense`` gave them, else fbgemm's copy read back (the same fp16 values,
// exactly, but most of the work). fbgemm's stacked copy and the fp16 kernel's are both made from it.
std::pair<at::Tensor, std::optional<at::Tensor>> stacked(const std::vector<int64_t>& keys) {
  std::vector<at::Tensor> ws, bs;
  bool bias = false;
  for (int64_t k : keys) {
    at::Tensor w;
    std::optional<at::Tensor> b;
    {
      std::shared_lock<std::shared_mutex> lock(mu);
      auto it = dense.find(k);
      if (it != dense.end()) std::tie(w, b) = it->second;
    }
    if (!w.defined()) {
      auto [uw, ub] = find(k)->unpack();
      w = uw;
      if (ub.has_value()) b = *ub;
    }
    ws.push_back(w.to(at::kFloat));
    bs.push_back(b.has_value() ? b->to(at::kFloat) : at::zeros({w.size(0)}, w.options().dtype(at::kFloat)));
    bias = bias || b.has_value();
  }
  std::optional<at::Tensor> b;
  if (bias) b = at::cat(bs, 0).contiguous();
  return {at::cat(ws, 0).contiguous(), b};
}

// ``keys``' rows in the fp16 kernel's layout; none where the shape does not fit it (K a multiple of
// 32, N of 4).
std::optional<Ours> make_ours(const std::vector<int64_t>& keys) {
  auto [w, b] = stacked(keys);
  const int64_t N = w.size(0), K = w.size(1);
  if (K % 32 != 0 || N % NB != 0) return std::nullopt;
  Ours o;
  o.w = w.to(at::kHalf).reshape({N / NB, NB, K / 32, 32}).transpose(1, 2).contiguous();
  o.b = b;
  return o;
}

// The fp16 kernel's copy of ``keys``' rows, made on first use and kept beside fbgemm's; none where the
// shape does not fit the kernel. Returned by value (two tensor handles): a repack on another thread
// may drop the kept one meanwhile.
std::optional<Ours> ours_for(const std::vector<int64_t>& keys) {
  auto usable = [](const Ours& o) { return o.w.defined() ? std::optional<Ours>(o) : std::nullopt; };
  {
    std::shared_lock<std::shared_mutex> lock(mu);
    if (keys.size() == 1) {
      auto it = ours_single.find(keys[0]);
      if (it != ours_single.end()) return usable(it->second);
    } else {
      auto it = ours_fused.find(keys);
      if (it != ours_fused.end()) return usable(it->second);
    }
  }
  Ours o = make_ours(keys).value_or(Ours{});
  std::unique_lock<std::shared_mutex> lock(mu);
  const Ours& kept = keys.size() == 1 ? ours_single.emplace(keys[0], std::move(o)).first->second
                                      : ours_fused.emplace(keys, std::move(o)).first->second;
  return usable(kept);
}

// The fp16 kernel where it is on and the call has a few fp32 rows, else fbgemm's fp16 GEMM on
// ``fbgemm()``'s weight (looked up, or stacked on first use, only then).
template <class Fbgemm>
at::Tensor apply(const at::Tensor& x, const std::vector<int64_t>& keys, Fbgemm fbgemm) {
  const int64_t K = x.size(-1), M = K ? x.numel() / K : 0;
  if (ours_on && x.scalar_type() == at::kFloat && M >= 1 && M <= MAX_ROWS) {
    if (std::optional<Ours> o = ours_for(keys)) {
      at::Tensor y = ours_linear(x.reshape({M, K}).contiguous(), *o);
      std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
      shape.back() = y.size(1);
      return y.view(shape);
    }
  }
  return fbgemm()->apply_dynamic(x);
}

at::Tensor packed_linear(const at::Tensor& x, int64_t key, int64_t out_features) {
  return apply(x, {key}, [&] { return find(key); });
}

// The parts' rows stacked and packed once, on first use: packing their fp32 rows again gives the
// same fp16 values, so the stack loses nothing.
Packed fuse(const std::vector<int64_t>& keys) {
  {
    std::shared_lock<std::shared_mutex> lock(mu);
    auto it = fused.find(keys);
    if (it != fused.end()) return it->second;
  }
  auto [w, b] = stacked(keys);
  static auto prepack = c10::Dispatcher::singleton().findSchemaOrThrow("quantized::linear_prepack_fp16", "");
  torch::jit::Stack st{c10::IValue(w), b ? c10::IValue(*b) : c10::IValue()};
  prepack.callBoxed(&st);
  Packed packed = unbox(st.at(0), "specblock_native::packed_linear_cat");
  std::unique_lock<std::shared_mutex> lock(mu);
  return fused.emplace(keys, std::move(packed)).first->second;
}

// Linears that read the same input (q/k/v, gate/up) as one GEMM: one call, one pass over x. The keys
// are plain ints (-1: none), as q4's linear_key_cat: with an int[] inductor's C++ wrapper calls the
// op boxed, building a list of IValues per call, and that code took g++ longer to compile.
at::Tensor packed_linear_cat(const at::Tensor& x, int64_t k0, int64_t k1, int64_t k2, int64_t k3, int64_t out_features) {
  std::vector<int64_t> keys;
  for (int64_t k : {k0, k1, k2, k3}) {
    if (k >= 0) keys.push_back(k);
  }
  return apply(x, keys, [&] { return fuse(keys); });
}

void set_fp16_kernel(bool on) { ours_on = on; }

template <class Map>
void erase_holding(Map& m, int64_t key) {
  for (auto it = m.begin(); it != m.end();) {
    bool has = std::find(it->first.begin(), it->first.end(), key) != it->first.end();
    it = has ? m.erase(it) : std::next(it);
  }
}

// Every stacked or laid-out copy holding ``key``'s rows (the caller holds the lock).
void forget_copies(int64_t key) {
  ours_single.erase(key);
  erase_holding(fused, key);
  erase_holding(ours_fused, key);
}

// put(int key, Any packed): the ScriptObject fbgemm's prepack returned, kept under ``key``.
void put(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  c10::IValue obj = torch::jit::pop(*stack);
  int64_t key = torch::jit::pop(*stack).toInt();
  Packed w = unbox(obj, "specblock_native::put");
  std::unique_lock<std::shared_mutex> lock(mu);
  table[key] = std::move(w);
  forget_copies(key);  // a repack: copies of the old weights go
}

// put_dense(int key, Tensor weight, Tensor? bias): the module's fp32 tensors (kept, not copied).
void put_dense(int64_t key, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  std::unique_lock<std::shared_mutex> lock(mu);
  dense[key] = {weight, bias};
  forget_copies(key);
}

void drop(int64_t key) {  // and every fused matrix holding its rows, and the fp16 kernel's copies
  std::unique_lock<std::shared_mutex> lock(mu);
  table.erase(key);
  dense.erase(key);
  forget_copies(key);
}

// How many weights the tables hold: (single, fused).
std::tuple<int64_t, int64_t> size() {
  std::shared_lock<std::shared_mutex> lock(mu);
  return {static_cast<int64_t>(table.size()), static_cast<int64_t>(fused.size())};
}
}  // namespace

TORCH_LIBRARY(specblock_native, m) {
  m.def("packed_linear(Tensor x, int key, int out_features) -> Tensor");
  m.def("put(int key, Any packed) -> ()", torch::CppFunction::makeFromBoxedFunction<&put>());
  m.def("packed_linear_cat(Tensor x, int key0, int key1, int key2, int key3, int out_features) -> Tensor");
  m.def("drop(int key) -> ()", drop);
  m.def("size() -> (int, int)", size);
  m.def("set_fp16_kernel(bool on) -> ()", set_fp16_kernel);
  m.def("put_dense(int key, Tensor weight, Tensor? bias) -> ()", put_dense);
}

TORCH_LIBRARY_IMPL(specblock_native, CPU, m) {
  m.impl("packed_linear", packed_linear);
  m.impl("packed_linear_cat", packed_linear_cat);
}
"""

_STATE: dict[str, object] = {}


#: The library's name and compiler flags (``_build`` and ``start_building`` build the same).
#: -O3 for the fp16 kernel (at -O2 it ran slower than fbgemm: fp16_kernel_forward_s66 against
#: fp16_kernel_forward_o3_s66), OpenMP for its threads.
LIBRARY, CFLAGS, LDFLAGS = "specblock_native", ["-O3", "-fopenmp"], ["-fopenmp"]
#: ``SPECBLOCK_FP16_KERNEL``: ``ours`` (the default: compiled packed linears of up to 16 rows on the fp16
#: kernel above, where the CPU has AVX512; the module's last paragraph says why) or ``fbgemm``.
FP16_KERNEL_ENV = "SPECBLOCK_FP16_KERNEL"


def start_building() -> None:
    """``use_native_kernel``'s build begun in the background where it would run (``compiled.prebuild``)."""
    if packed.available():
        cext.start_build(LIBRARY, SOURCE, CFLAGS, LDFLAGS)


def _build() -> None:
    cext.build(LIBRARY, SOURCE, CFLAGS, LDFLAGS)
    torch.library.register_fake("specblock_native::packed_linear", _fake)
    torch.library.register_fake("specblock_native::packed_linear_cat", _fake_cat)


def _fake(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def _fake_cat(x: torch.Tensor, k0: int, k1: int, k2: int, k3: int, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def packed_linear_cat(x: torch.Tensor, keys: list[int], out_features: int) -> torch.Tensor:
    """Up to ``q4_kernel.CAT_KEYS`` packed linears that read ``x`` as one GEMM, their outputs side by
    side (what ``compiled/fuse.py`` puts in a compiled graph for q/k/v and gate/up)."""
    return torch.ops.specblock_native.packed_linear_cat(x, *q4_kernel.cat_keys(keys), out_features)


def _mirror(key: int, weight: object | None) -> None:
    if weight is None:
        torch.ops.specblock_native.drop(key)
        return
    torch.ops.specblock_native.put(key, weight)
    if (fp32 := packed.dense(key)) is not None:  # the fp16 kernel lays its copy out from these
        torch.ops.specblock_native.put_dense(key, fp32[0].detach(), None if fp32[1] is None else fp32[1].detach())


def use_native_kernel() -> bool:
    """Build (or load) the extension once per process and make compiled packed linears call it.
    Returns whether they do; on a failed build, warns once and leaves the Python kernel in place."""
    if "ok" not in _STATE:
        try:
            if not packed.available():
                raise RuntimeError("torch has no fbgemm here")
            _build()
            packed.use_compiled_op(torch.ops.specblock_native.packed_linear, _mirror)
            _STATE["ok"] = True
            set_fp16_kernel(fp16_kernel_wanted())
        except Exception as exc:  # a missing compiler or headers: slower, not wrong
            _STATE["ok"] = False
            warnings.warn(f"specblock: the C++ packed-linear kernel could not be built ({type(exc).__name__}: "
                          f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else exc!r}); compiled "
                          "packed-fp16 graphs call the Python kernel instead (slower, same results)", stacklevel=2)
    return bool(_STATE["ok"])


def fp16_kernel_wanted() -> bool:
    """The fp16 kernel on a CPU it runs on (AVX512F/BW and FMA), unless ``SPECBLOCK_FP16_KERNEL=fbgemm``."""
    value = os.environ.get(FP16_KERNEL_ENV, "ours").strip().lower() or "ours"
    if value not in ("fbgemm", "ours"):
        warnings.warn(f"specblock: {FP16_KERNEL_ENV}={value!r} is neither 'ours' nor 'fbgemm'; fbgemm's kernel runs",
                      stacklevel=2)
        return False
    return value == "ours" and q4_kernel.cpu_supports()  # the same instructions as q4's kernel (AVX512F/BW, FMA)


def set_fp16_kernel(on: bool) -> None:
    """Compiled packed linears of up to 16 fp32 rows on the fp16 kernel (True) or on fbgemm (False),
    from the next call on; needs the library (``use_native_kernel``). Graphs call the same op either
    way, so saved graphs serve both."""
    torch.ops.specblock_native.set_fp16_kernel(bool(on))


def pin_python_kernel(model: torch.nn.Module) -> None:
    """This model's packed linears keep the Python kernel when traced, whatever the default: the
    baseline a measurement compares the C++ kernel with (a second copy of the model)."""
    for m in model.modules():
        if isinstance(m, packed.PackedLinear):
            m.compiled_op = packed.packed_linear
