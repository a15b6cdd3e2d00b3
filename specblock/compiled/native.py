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
"""

from __future__ import annotations

import warnings

import torch

from specblock.runtime import cext, packed, q4_kernel

SOURCE = r"""
#include <torch/library.h>
#include <ATen/core/stack.h>
#include <ATen/native/quantized/PackedParams.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/zeros.h>
#include <algorithm>
#include <map>
#include <shared_mutex>
#include <unordered_map>
#include <vector>

namespace {
using Packed = c10::intrusive_ptr<LinearPackedParamsBase>;
std::shared_mutex mu;
std::unordered_map<int64_t, Packed> table;
std::map<std::vector<int64_t>, Packed> fused;  // keys of the parts -> their rows packed as one matrix

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

at::Tensor packed_linear(const at::Tensor& x, int64_t key, int64_t out_features) {
  return find(key)->apply_dynamic(x);
}

// The parts' rows stacked and packed once, on first use: unpacking gives their fp16 values
// exactly (in fp32), so packing the stack again loses nothing.
Packed fuse(const std::vector<int64_t>& keys) {
  {
    std::shared_lock<std::shared_mutex> lock(mu);
    auto it = fused.find(keys);
    if (it != fused.end()) return it->second;
  }
  std::vector<at::Tensor> ws, bs;
  bool bias = false;
  for (int64_t k : keys) {
    auto [w, b] = find(k)->unpack();
    ws.push_back(w.to(at::kFloat));
    bs.push_back(b.has_value() ? b->to(at::kFloat) : at::zeros({w.size(0)}, w.options().dtype(at::kFloat)));
    bias = bias || b.has_value();
  }
  static auto prepack = c10::Dispatcher::singleton().findSchemaOrThrow("quantized::linear_prepack_fp16", "");
  torch::jit::Stack st{c10::IValue(at::cat(ws, 0).contiguous()),
                       bias ? c10::IValue(at::cat(bs, 0).contiguous()) : c10::IValue()};
  prepack.callBoxed(&st);
  Packed w = unbox(st.at(0), "specblock_native::packed_linear_cat");
  std::unique_lock<std::shared_mutex> lock(mu);
  return fused.emplace(keys, std::move(w)).first->second;
}

// Linears that read the same input (q/k/v, gate/up) as one GEMM: one call, one pass over x. The keys
// are plain ints (-1: none), as q4's linear_key_cat: with an int[] inductor's C++ wrapper calls the
// op boxed, building a list of IValues per call, and that code took g++ longer to compile.
at::Tensor packed_linear_cat(const at::Tensor& x, int64_t k0, int64_t k1, int64_t k2, int64_t k3, int64_t out_features) {
  std::vector<int64_t> keys;
  for (int64_t k : {k0, k1, k2, k3}) {
    if (k >= 0) keys.push_back(k);
  }
  return fuse(keys)->apply_dynamic(x);
}

// put(int key, Any packed): the ScriptObject fbgemm's prepack returned, kept under ``key``.
void put(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  c10::IValue obj = torch::jit::pop(*stack);
  int64_t key = torch::jit::pop(*stack).toInt();
  Packed w = unbox(obj, "specblock_native::put");
  std::unique_lock<std::shared_mutex> lock(mu);
  table[key] = std::move(w);
}

void drop(int64_t key) {  // and every fused matrix holding its rows
  std::unique_lock<std::shared_mutex> lock(mu);
  table.erase(key);
  for (auto it = fused.begin(); it != fused.end();) {
    bool has = std::find(it->first.begin(), it->first.end(), key) != it->first.end();
    it = has ? fused.erase(it) : std::next(it);
  }
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
}

TORCH_LIBRARY_IMPL(specblock_native, CPU, m) {
  m.impl("packed_linear", packed_linear);
  m.impl("packed_linear_cat", packed_linear_cat);
}
"""

_STATE: dict[str, object] = {}


#: The library's name and compiler flags (``_build`` and ``start_building`` build the same).
LIBRARY, CFLAGS = "specblock_native", ["-O2"]


def start_building() -> None:
    """``use_native_kernel``'s build begun in the background where it would run (``compiled.prebuild``)."""
    if packed.available():
        cext.start_build(LIBRARY, SOURCE, CFLAGS)


def _build() -> None:
    cext.build(LIBRARY, SOURCE, CFLAGS)
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
    else:
        torch.ops.specblock_native.put(key, weight)


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
        except Exception as exc:  # a missing compiler or headers: slower, not wrong
            _STATE["ok"] = False
            warnings.warn(f"specblock: the C++ packed-linear kernel could not be built ({type(exc).__name__}: "
                          f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else exc!r}); compiled "
                          "packed-fp16 graphs call the Python kernel instead (slower, same results)", stacklevel=2)
    return bool(_STATE["ok"])


def pin_python_kernel(model: torch.nn.Module) -> None:
    """This model's packed linears keep the Python kernel when traced, whatever the default: the
    baseline a measurement compares the C++ kernel with (a second copy of the model)."""
    for m in model.modules():
        if isinstance(m, packed.PackedLinear):
            m.compiled_op = packed.packed_linear
