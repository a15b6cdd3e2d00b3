"""Attention inside compiled CPU graphs: the query heads folded onto their key/value heads, written
as two matmuls and a softmax.

Why: HF's SDPA attention passes ``enable_gqa`` only without a mask; under ``torch.compile`` with a
tree mask it calls ``repeat_kv``, which copies every layer's keys and values over the whole
attention span once per query head (SmolLM2: 9 query heads on 3 key/value heads, 2 x 590 KB per
layer at a 256-slot span), and inductor's kernel profile of the real model's compiled 8-node step
put SDPA and those copies at about a third of the forward. So the graph does it itself: query
``[B, H, n, d]`` becomes ``[B, H_kv, g * n, d]`` (head-major: rows of one query head stay together),
one matmul against the cached keys read in place, the mask added to each group's rows, a softmax
in float32, one matmul against the values. Inductor fuses the mask and softmax into one kernel and
calls a BLAS matmul for the rest. The profile overstated the gain: calls interleaved against SDPA
(``KERNELS["sdpa"]``, the previous default: grouped heads in place with ``enable_gqa`` up to 4
rows, ``repeat_kv`` past that) were level at 1, 4 and 8 rows and 4% faster at 6
(``experiments/attention_kernels.py``, docs/compiled.md). It stays for the copies it never makes.

Scope: registered under its own name and switched on by the compiled CPU target only, and only
while dynamo traces: eager forwards of the same model (prefill, the eager target that shares its
weights in a bench) take the eager target's path (``runtime/grouped_rows.py``). A per-head mask,
softcapping, position bias, or several rows without a mask (HF's causal flag) go through HF's
function. On CUDA the graphs keep HF's attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from specblock.runtime import grouped_rows, tree_attention
from specblock.runtime.grouped_rows import sdpa_rows_forward, use_sdpa_variant

NAME = "specblock_math_gqa"
SDPA_NAME = "specblock_sdpa_gqa"
FUSED_NAME = "specblock_fused_gqa"
#: ``sdpa``'s limit: query rows up to which it read grouped heads in place (``compiled_speed_gqa.md``:
#: T(1) / T(2) / T(4) 6% / 6% / 3% faster than ``repeat_kv``, T(8) 4% slower).
SDPA_MAX_ROWS = 4


def _hf(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs):
    return sdpa_rows_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                             is_causal=is_causal, **kwargs)


def _traced_plain(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, kwargs: dict) -> bool:
    """Whether this call keeps HF's function: not traced, ungrouped heads, extras we do not model."""
    return (not torch.compiler.is_compiling() or query.shape[1] == key.shape[1]
            or any(kwargs.get(k) is not None for k in ("softcap", "position_bias", "s_aux"))
            or (mask is not None and (mask.dim() != 4 or mask.shape[1] != 1)))


def math_gqa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, n, d]
    key: torch.Tensor,  # [B, H_kv, kv, d]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,  # [B, 1, n, kv]: additive, or bool (True: visible); None: one row
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF's attention result, computed in a traced forward on the folded heads (see the module)."""
    if _traced_plain(query, key, attention_mask, kwargs) or dropout or (attention_mask is None and query.shape[2] > 1):
        return _hf(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    b, h, n, d = query.shape
    kv_heads, span = key.shape[1], key.shape[2]
    g = h // kv_heads
    scale = d**-0.5 if scaling is None else scaling
    f32 = query.dtype != torch.float32  # bf16 / fp16 graphs: scores and weights in float32, as SDPA keeps them
    q = query.reshape(b, kv_heads, g * n, d)
    k, v = (key.float(), value.float()) if f32 else (key, value)
    scores = torch.matmul(q.float() if f32 else q, k.transpose(-1, -2)).view(b, kv_heads, g, n, span) * scale
    if attention_mask is not None:
        mask = attention_mask[:, :, None]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    weights = torch.softmax(scores.float(), dim=-1).view(b, kv_heads, g * n, span)
    out = torch.matmul(weights.to(v.dtype), v).to(query.dtype)  # [B, H_kv, g * n, d]
    return out.view(b, h, n, d).transpose(1, 2).contiguous(), None


def sdpa_gqa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The previous default (the baseline of ``compiled_speed.py --sdpa-gqa-baseline``): a traced
    forward of at most ``SDPA_MAX_ROWS`` rows hands the grouped heads to SDPA, more rows take HF's
    ``repeat_kv``."""
    if _traced_plain(query, key, None, kwargs) or query.shape[2] > SDPA_MAX_ROWS:
        return _hf(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    causal = query.shape[2] > 1 and attention_mask is None and causal  # HF's rule, as in sdpa_attention_forward
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
                                         is_causal=causal, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def fused_gqa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """One C++ op a layer (``runtime/tree_attention.py``) where it applies (fp32, an additive
    mask); elsewhere the math kernel."""
    if _traced_plain(query, key, attention_mask, kwargs) or dropout or not tree_attention.applies(query, key, attention_mask):
        return math_gqa_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    return tree_attention.tree_attention(query, key, value, attention_mask, scaling), None


#: ``StaticTarget(gqa_kernel=...)``: the registered attention name and its function.
KERNELS = {"math": (NAME, math_gqa_forward), "sdpa": (SDPA_NAME, sdpa_gqa_forward),
           "fused": (FUSED_NAME, fused_gqa_forward)}


def default_kernel() -> str:
    """The fused op where it runs (its library built, an AVX512 CPU), else the math kernel."""
    return "fused" if tree_attention.load() else "math"


def use_gqa_attention(model: PreTrainedModel, kernel: str | None = None) -> bool:
    """Switch an SDPA model on CPU with grouped key/value heads (HF's, the eager target's grouped
    rows, which its eager calls keep, or another kernel's) to ``KERNELS[kernel]`` (None: the default)."""
    kernel = kernel or default_kernel()
    if kernel not in KERNELS:
        raise ValueError(f"unknown grouped-attention kernel {kernel!r}; choose one of {sorted(KERNELS)}")
    if kernel == "fused" and not tree_attention.load():  # it warned why
        kernel = "math"
    name, forward = KERNELS[kernel]
    others = tuple(n for n, _ in KERNELS.values() if n != name)
    return use_sdpa_variant(model, name, forward, (grouped_rows.NAME, *others))
