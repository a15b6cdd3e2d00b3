"""The CPU dtype ``packed-fp16``: every linear's weight stored as fp16 in fbgemm's packed layout,
all arithmetic in fp32.

Why: on a CPU without native bf16 (AVX2 only, no AVX512-BF16 or AMX) a bf16 product of more than
one row is emulated, so tree verification in bf16 costs 4-7x one token at 8-16 tree tokens, and
fp32 reads twice the bytes for one token. fbgemm's fp16 GEMM reads half of fp32's bytes, from a
layout packed once at load time, and computes in fp32 at any row count.
``python experiments/target_speed.py --dtypes bfloat16,float32,packed-fp16`` measures the three
side by side (figures in the README).

The arithmetic is fp32 and each output row is its own dot products, so a token's logits do not
depend on the other rows of a tree beyond float rounding, as in fp32: the losslessness tests run
on it unchanged. The weights differ from the checkpoint's by fp16 rounding (finer than bf16's), so
this is a slightly different target than ``float32``: every method here, plain decoding included,
runs the same packed model, and outputs are compared with that model's own greedy decoding.
"""

from __future__ import annotations

import itertools
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch
from torch import nn

from specblock.errors import SpecBlockError

PACKED_FP16 = "packed-fp16"


def available() -> bool:
    """fbgemm (x86 builds of torch) provides the packed fp16 GEMM; ARM builds do not."""
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(torch.ops.quantized, "linear_prepack_fp16")


class PackedLinear(nn.Module):
    """An ``nn.Linear`` whose forward runs fbgemm's packed fp16 GEMM.

    The fp32 ``weight`` stays, frozen, for code that reads weights (drafters copy the target's head
    rows; a tied head shares the embedding's storage); the forward reads only the packed copy.
    ``compiled_op`` is what a traced forward calls (``packed_linear``, or the C++ kernel once
    ``use_compiled_op`` swapped it in)."""

    compiled_op = None  # packed_linear, set below its definition
    shared = None  # a shared_input.SharedInput: eager calls read its stacked product (q/k/v)
    shared_cols = None  # this linear's columns of it

    def __init__(self, lin: nn.Linear, packed: torch.ScriptObject | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.weight = lin.weight
        self.bias = lin.bias
        self._packed = packed if packed is not None else prepack(lin)
        self._register()

    def _register(self) -> None:
        self._key = next(_KEYS)
        _put(self._key, self._packed, self)
        weakref.finalize(self, _drop, self._key)

    def __setstate__(self, state: dict) -> None:
        """A copy (deepcopy, pickle) gets a key of its own: the original's is dropped with it. A
        copy without the packed weight registers nothing: dynamo's saved guards (a precompiled
        graph's, ``compiled/precompile.py``) rebuild modules with their tensors left out."""
        super().__setstate__(state)
        if isinstance(self._packed, torch.ScriptObject):
            self._register()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # the same kernel, behind an op dynamo can trace (see packed_linear)
            return self.compiled_op(x, self._key, self.out_features)
        if self.shared is not None:  # q/k/v as one GEMM (shared_input.py)
            return self.shared.run(self, x)
        return torch.ops.quantized.linear_dynamic_fp16(x, self._packed)

    def repack(self) -> None:
        """Pack ``weight`` and ``bias`` again after they changed (an adapting drafter's update),
        under the same key, so compiled graphs that name it read the new weights too."""
        self._packed = prepack(self)
        _put(self._key, self._packed, self)
        if self.shared is not None:
            self.shared.pack()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed fp16"


#: Packed weights by key, for ``packed_linear``: a compiled graph may hold ints, not fbgemm's
#: packed-weight object. Each ``PackedLinear`` removes its entry when it is collected.
_PACKED: dict[int, torch.ScriptObject] = {}
_KEYS = itertools.count()


#: ``specblock::packed_linear``, registered with the plain ``torch.library.Library`` API rather
#: than the ``custom_op`` decorator: the decorator's wrappers (autograd, schema checks) cost about
#: 30 us a call on this CPU, 211 calls per forward of the real model, about a fifth of a
#: compiled T(1); the plain registration costs about 7 us over the kernel
#: (``experiments/packed_op_overhead.py``). A compiled graph calls it through the dispatcher.
_LIB = torch.library.Library("specblock", "DEF")
_LIB.define("packed_linear(Tensor x, int key, int out_features) -> Tensor")


def _packed_linear_cpu(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    """fbgemm's packed fp16 GEMM as an opaque op for ``torch.compile``.

    Why: dynamo cannot put the packed-weight ScriptObject into a graph, so every ``PackedLinear``
    split a compiled forward in two (211 graph breaks in the real model), and the compiled
    packed-fp16 target ran slower than the eager one. Behind this op, with the weight named by an
    int, the whole forward is one graph whose linears inductor calls as extern kernels."""
    return torch.ops.quantized.linear_dynamic_fp16(x, _PACKED[key])


def _packed_linear_fake(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


_LIB.impl("packed_linear", _packed_linear_cpu, "CPU")
torch.library.register_fake("specblock::packed_linear", _packed_linear_fake, lib=_LIB)
packed_linear = torch.ops.specblock.packed_linear
PackedLinear.compiled_op = packed_linear

#: Who else keeps the packed weights by key: the C++ kernel of the compiled path has a table of
#: its own (``specblock/compiled/native.py``).
_MIRRORS: list[Callable[[int, object | None], None]] = []
#: Each packed weight's fp32 ``weight`` and ``bias`` (the module's own tensors, not copies), for a
#: mirror that lays the weights out its own way: reading them back from fbgemm's packed copy
#: (``unpack``) was most of that work (later starts 8.70 against 8.27 s, ``start_time_fp16kernel*_s66.md``).
_DENSE: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}


def _put(key: int, weight: torch.ScriptObject, module: nn.Module | None = None) -> None:
    _PACKED[key] = weight
    if module is not None:
        _DENSE[key] = (module.weight, module.bias)
    for mirror in _MIRRORS:
        mirror(key, weight)


def dense(key: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The fp32 weight and bias packed under ``key`` (None where no module gave them)."""
    return _DENSE.get(key)


def _drop(key: int) -> None:
    _PACKED.pop(key, None)
    _DENSE.pop(key, None)
    for mirror in _MIRRORS:
        try:
            mirror(key, None)
        except Exception:  # at interpreter exit the mirror's library may be gone first: nothing to free then
            pass


def use_compiled_op(op, mirror: Callable[[int, object | None], None]) -> None:
    """Traced ``PackedLinear`` forwards call ``op(x, key, out_features)`` from now on (unless a module
    pins its own ``compiled_op``); ``mirror(key, weight)`` is told of every packed weight, present and
    future, and ``mirror(key, None)`` of each one dropped."""
    if mirror not in _MIRRORS:
        _MIRRORS.append(mirror)
        for key, weight in list(_PACKED.items()):
            mirror(key, weight)
    PackedLinear.compiled_op = op


def prepack(lin: nn.Linear) -> torch.ScriptObject:
    """fbgemm's packed fp16 copy of ``lin``'s weight and bias."""
    bias = None if lin.bias is None else lin.bias.detach().float().contiguous()
    return torch.ops.quantized.linear_prepack_fp16(lin.weight.detach().float().contiguous(), bias)


def served(module: nn.Module) -> bool:
    """A linear served from a compact copy of its fp32 ``weight`` that ``repack`` rebuilds: a
    ``PackedLinear``, or a drafter's int8 one (``q4.Int8Linear``)."""
    return callable(getattr(module, "repack", None)) and isinstance(getattr(module, "weight", None), torch.Tensor)


def unpack_linears(model: nn.Module) -> int:
    """Each served linear of ``model`` (``served``) back to an ``nn.Linear`` on the same fp32
    weight and bias, in place (a copy to train: a packed forward has no gradient); returns how many."""
    found = [(mod, name, child) for mod in list(model.modules()) for name, child in mod.named_children()
             if served(child)]
    for mod, name, child in found:
        bias = getattr(child, "bias", None)
        lin = nn.Linear(child.in_features, child.out_features, bias=bias is not None, device="meta")
        lin.weight, lin.bias = child.weight, bias
        setattr(mod, name, lin)
    return len(found)


def pack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of an fp32 CPU model in place; returns how many."""
    if not available():
        raise SpecBlockError(f"--dtype {PACKED_FP16} needs torch's fbgemm (x86 CPUs); use bfloat16 or float32")
    p = next(model.parameters())
    if p.device.type != "cpu":
        raise SpecBlockError(f"--dtype {PACKED_FP16} runs on the CPU only; on {p.device.type} use bfloat16")
    if p.dtype != torch.float32:
        raise SpecBlockError(f"--dtype {PACKED_FP16} packs an fp32 model, not a {p.dtype} one; load it in float32 first")
    for p in model.parameters():
        p.requires_grad_(False)
    found = [(mod, name, child) for mod in list(model.modules()) for name, child in mod.named_children()
             if type(child) is nn.Linear]
    # fbgemm packs on one thread and releases the GIL: pack on torch's threads, then build the
    # modules in order (their keys come in a fixed order).
    with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        packs = list(pool.map(lambda f: prepack(f[2]), found))
    for (mod, name, child), packed in zip(found, packs):
        setattr(mod, name, PackedLinear(child, packed))
    return len(found)
