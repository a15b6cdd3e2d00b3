"""The two parts of a forward whose bits inductor changes, made the same eager and compiled: the
RMSNorm (one C++ op, ``rms_norm.cpp``) and rotary's cos/sin (one table, read by position).

Why: q4's int8 kernel rounds every linear's input to int8, so a last-bit difference anywhere
before a linear can move a rounding step and the logits by a few tenths. Linears and attention
are our own ops in both paths, and an elementwise product or sum is the same bits in ATen and in
inductor's C++ (it builds with ``-ffp-contract=off``); what is not the same (probed on HF's Llama
modules, eager against ``torch.compile``) is a reduction, whose order inductor picks (RMSNorm's mean
of squares, in 19 of 20 random rows), and ``cos``/``sin``, which inductor computes with its own
vectorised functions (every row). So compiled decoding on the int8 kernel parted from eager
decoding at near-ties (``q4.py``). With these two parts swapped in, a row's bits are the same in
any tree size, eager or compiled (``tests/test_exact_parts.py``).

- ``RowRMSNorm``: HF's RMSNorm (``w * (x * rsqrt(mean(x^2) + eps))``, fp32) with the sum of squares
  in a fixed order a row, whatever the other rows: ``specblock_norm::rms_norm``. A norm module is
  swapped only where it computes that (checked on a random input at swap time: Gemma's
  ``(1 + w)`` is left alone).
- Eager prompts: HF leaves the mask out of a prompt without a past, so SDPA ran it, while the
  static cache's prefill passes its mask and runs the fused attention op: their keys and values
  differed in their last bits. Marked attention modules run such prompts through the op too
  (``grouped_rows.EXACT_PROMPT``).
- ``TableRotary``: cos/sin for every position up to the model's ``max_position_embeddings``,
  computed once by the model's own rotary module (so by ATen), then gathered by position id (an
  exact copy) in every forward. Only for rope types whose frequencies do not change with the
  sequence (not "dynamic" or "longrope"), and at most ``MAX_TABLE`` positions.

Used on models whose linears run on q4's int8 kernel (``target.load_causal_lm``), with their prompts;
and, for speed alone, on packed-fp16 targets, without the prompts' switch (stop 62): there they take
6-11% off each eager forward (``experiments/exact_parts_eager.py``: HF's RMSNorm is 8 ops, 61 times a
forward, and the rotary module 10 more) and move logits in their last bits only, as any change of
summation order does; decoding stays lossless against the same target's own greedy decoding, which
runs the same parts. ``SPECBLOCK_EXACT_PARTS=off`` keeps HF's parts there (the A/B of that experiment).
fp32 and bf16 targets keep HF's parts: fp32 is the reference the lossless runs compare against, and a
bf16 norm is not the fp32 formula the op computes.

Rotary's application (stop 63): where ``TableRotary`` feeds the attention, HF's ``apply_rotary_pos_emb``
(about 14 ops a layer) runs as one op, ``specblock_norm::rotary`` (``rotary.cpp``), with the same bits;
eager forwards of a ``TargetModel`` only (``use_rotary_op``, ``rotary_op``). ``SPECBLOCK_ROTARY_OP=off``
at load keeps HF's function (the A/B baseline)."""

from __future__ import annotations

import functools
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from specblock.flags import env_switch
from specblock.runtime import cext
from specblock.runtime.grouped_rows import mark_exact_prompts

SOURCE = cext.read_source(Path(__file__).parent / "rms_norm.cpp")  # with rotary.cpp
STATIC_ROPE = ("default", "linear", "llama3", "yarn")
MAX_TABLE = 65536  # positions: 32 MB of cos/sin at head dim 64
_STATE: dict[str, bool] = {}


def wanted() -> bool:
    """Whether a packed-fp16 target takes the parts for speed: where the op runs (AVX512F), unless
    ``SPECBLOCK_EXACT_PARTS=off``; q4's int8 kernel takes them whatever this says, as its exactness needs them."""
    return env_switch("SPECBLOCK_EXACT_PARTS") and runs_here()


def runs_here() -> bool:
    return {"avx512f", "fma"} <= cext.cpu_flags()


def wanted_for(dtype: str) -> bool:
    """Whether a target loaded at ``dtype`` (resolved) takes the parts: q4 and packed-q4-amx always
    (their kernels round activations), packed-fp16 and packed-q4 where ``wanted``; other dtypes keep HF's modules."""
    from specblock.runtime.packed import PACKED_FP16
    from specblock.runtime.q4 import PACKED_Q4, PACKED_Q4_AMX, Q4

    return dtype in (Q4, PACKED_Q4_AMX) or (dtype in (PACKED_FP16, PACKED_Q4) and wanted())


def start_building() -> None:
    """``load``'s build begun in the background where it would run, so that it overlaps the
    model's load (``target.load_causal_lm``): 8 s cold on this machine, on the critical path otherwise."""
    if runs_here():
        cext.start_build("specblock_norm", SOURCE, *cext.OPENMP)  # build_or_why's flags


def load() -> bool:
    """Build (or load) the norm op once per process; False, with one warning, where it cannot run."""
    if "ok" not in _STATE:
        why = None
        if not runs_here():
            why = "this CPU has no AVX512F"
        else:  # where it cannot be built: HF's norm, as before
            why = cext.build_or_why("specblock_norm", SOURCE, {
                "specblock_norm::rms_norm": lambda x, w, eps: torch.empty_like(x),
                "specblock_norm::rotary": lambda q, k, cos, sin: (torch.empty_like(q), torch.empty_like(k))})
        _STATE["ok"] = why is None
        if why is not None:
            warnings.warn(f"specblock: HF's RMSNorm stays ({why}); on q4's int8 kernel compiled and eager "
                          "forwards may then part", stacklevel=2)
    return _STATE["ok"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.ops.specblock_norm.rms_norm(x, weight, eps)


class RowRMSNorm(nn.Module):
    """An RMSNorm through ``specblock_norm::rms_norm``; keeps the module's own ``weight``."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}, fixed-order C++ op"


class TableRotary(nn.Module):
    """cos/sin by position from one table that the model's own rotary module filled once."""

    def __init__(self, rotary: nn.Module, positions: int) -> None:
        super().__init__()
        inv = rotary.inv_freq
        with torch.no_grad():
            cos, sin = rotary(torch.zeros(1, dtype=torch.float32, device=inv.device),
                              torch.arange(positions, device=inv.device)[None])
        self.register_buffer("cos", cos[0].contiguous(), persistent=False)  # [positions, head_dim]
        self.register_buffer("sin", sin[0].contiguous(), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[position_ids].to(x.dtype), self.sin[position_ids].to(x.dtype)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's ``apply_rotary_pos_emb(q, k, cos, sin)`` (q, k [B, H, n, D], cos and sin [B, n, D], fp32)
    as one op: the same bits (``rotary.cpp``)."""
    return torch.ops.specblock_norm.rotary.default(q, k, cos, sin)


def _rotary_op_for_tables(hf_apply: Callable) -> Callable:
    """``hf_apply`` (a modeling module's ``apply_rotary_pos_emb``) that runs ``rotary`` on fp32 inputs
    without autograd whose shapes and strides the op takes (it would raise on others); ``hf_apply``
    itself otherwise (traced code, a partial rotary). Only in place during an eager forward of a
    model whose rotary module is a ``TableRotary`` (``rotary_op``), so its cos and sin are the table's."""

    @functools.wraps(hf_apply)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if (not torch.compiler.is_compiling() and not args and not kwargs and q.dtype == torch.float32
                and k.dtype == torch.float32 and cos.dtype == torch.float32 and sin.dtype == torch.float32
                and q.dim() == 4 and k.dim() == 4 and cos.dim() == 3 and q.shape[-1] == cos.shape[-1]
                and q.stride(-1) == 1 and k.stride(-1) == 1
                and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad))):
            return rotary(q, k, cos, sin)
        return hf_apply(q, k, cos, sin, *args, **kwargs)

    return apply_rotary_pos_emb


def _applies_rotary_as_hf(fn: Callable) -> bool:
    """``fn(q, k, cos, sin)`` gives the op's bits on a random input (HF's half-split formula, not an
    interleaved or partial one), by behaviour, as ``_is_rms_norm`` checks a norm."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 3, 2, 8, generator=g), torch.randn(1, 1, 2, 8, generator=g)
    cos, sin = torch.randn(2, 1, 2, 8, generator=g).unbind(0)
    try:
        with torch.no_grad():
            got, want = fn(q, k, cos, sin), rotary(q, k, cos, sin)
        return all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    except Exception:  # noqa: BLE001 - another signature or shape rule: not HF's formula
        return False


#: Where ``use_rotary_op`` keeps a model's swaps: (modeling module, the wrapper of its function).
ROTARY_SWAPS = "_specblock_rotary_swaps"


def use_rotary_op(model: nn.Module) -> int:
    """Prepare ``model``'s eager forwards to apply rotary with the op: for each modeling module its
    layers come from whose ``apply_rotary_pos_emb`` computes HF's formula, a wrapper
    (``_rotary_op_for_tables``) that ``rotary_op`` puts in that function's place for the length of
    a forward. Returns how many modules.

    Why a module global: HF's attention calls that function by its global name (``kernels``, the hub
    mechanism that would swap it, is not installed and fetches from the hub), and forking the
    modeling code is what this project does not do. Why only during a forward: a global swapped for
    good would reach every model of the family in the process, and dynamo guards the function it
    traces (its defaults) in the graphs it saves, so a compiled model would trace another function in
    a process that also loaded a packed-fp16 target than in a fresh one (a warm helper's), and its
    saved graphs would not load (``tests/test_warm_helpers.py`` caught it)."""
    swaps = []
    for name in sorted({type(m).__module__ for m in model.modules()}):
        module = sys.modules.get(name)
        fn = getattr(module, "apply_rotary_pos_emb", None)
        if fn is not None and _applies_rotary_as_hf(fn):
            swaps.append((module, _rotary_op_for_tables(fn)))
    setattr(model, ROTARY_SWAPS, swaps)
    return len(swaps)


@contextmanager
def rotary_op(model: nn.Module) -> Iterator[None]:
    """``model``'s rotary wrappers (``use_rotary_op``) in their modules while the block runs (an
    eager forward: ``TargetModel.prefill`` and ``tree_forward``), what was there before after it."""
    swaps = getattr(model, ROTARY_SWAPS, None)
    if not swaps:
        yield
        return
    before = [(module, module.apply_rotary_pos_emb) for module, _ in swaps]
    for module, wrapper in swaps:
        module.apply_rotary_pos_emb = wrapper
    try:
        yield
    finally:
        for module, fn in before:
            module.apply_rotary_pos_emb = fn


def _is_rms_norm(mod: nn.Module) -> bool:
    """HF's RMSNorm formula in fp32 on the CPU, by behaviour on a random input."""
    w = getattr(mod, "weight", None)
    eps = getattr(mod, "variance_epsilon", None)
    if isinstance(mod, RowRMSNorm) or not (type(mod).__name__.endswith("RMSNorm") and isinstance(w, torch.Tensor) and w.dim() == 1
            and w.dtype == torch.float32 and w.device.type == "cpu" and isinstance(eps, float)):
        return False
    x = torch.randn(3, w.shape[0], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return torch.allclose(mod(x), rms_norm(x, w, eps), rtol=1e-5, atol=1e-6)


def use_exact_parts(model: nn.Module, prompts: bool = True) -> tuple[int, int]:
    """Swap ``model``'s RMSNorms for ``RowRMSNorm`` and its rotary module for ``TableRotary`` where
    they apply, and (``prompts``) send its eager prompts through the fused attention op
    (``grouped_rows.EXACT_PROMPT``: as the static cache's prefill; slower than SDPA on long prompts,
    so only where exactness needs it); returns (norms swapped, rotary modules swapped). Nothing
    where the op cannot run."""
    if not load():
        return 0, 0
    norms = rotaries = 0
    if prompts:
        mark_exact_prompts(model)  # eager prompts through the fused attention op too
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _is_rms_norm(child):
                setattr(parent, name, RowRMSNorm(child))
                norms += 1
            elif hasattr(child, "inv_freq") and getattr(child, "rope_type", None) in STATIC_ROPE:
                positions = int(getattr(getattr(child, "config", None), "max_position_embeddings", 0) or 0)
                if 0 < positions <= MAX_TABLE:
                    setattr(parent, name, TableRotary(child, positions))
                    rotaries += 1
    if rotaries and env_switch("SPECBLOCK_ROTARY_OP"):  # rotary's application as one op too (stop 63)
        use_rotary_op(model)
    return norms, rotaries
