"""Grouped-query attention inside compiled CPU graphs without copying the keys per query head.

Why: HF's SDPA attention passes ``enable_gqa`` only without a mask, and folds the query heads
onto the key/value heads only for one eager token; under ``torch.compile`` with a tree mask it
calls ``repeat_kv``, which materialises every layer's keys and values over the whole attention
span once per query head (SmolLM2: 9 query heads on 3 key/value heads, 2 x 590 KB per layer at
a 256-slot span). In the real model's compiled one-token graph that copy, fused with the cache
write, was the largest kernel after the linears (profiled with inductor's kernel profile).
PyTorch's CPU SDPA takes ``enable_gqa`` with a mask and reads the shared key/value heads in
place; ``tests/test_compiled.py`` holds it to ``repeat_kv``'s result, and the lossless tests of
the compiled path run through it.

Scope: registered under its own name and switched on by the compiled CPU target only, and only
while dynamo traces: eager forwards of the same model (prefill, the eager target that shares its
weights in a bench) take the eager target's path (``runtime/grouped_rows.py``, HF's own function
for everything but multi-row masked forwards). On CUDA a masked ``enable_gqa`` falls back
to the math kernel, so CUDA graphs keep ``repeat_kv``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from specblock.runtime import grouped_rows
from specblock.runtime.grouped_rows import sdpa_rows_forward, use_sdpa_variant

NAME = "specblock_sdpa_gqa"
#: Query rows (the tree bucket) up to which the graph reads grouped heads in place. Measured on the
#: real model, compiled, interleaved against ``repeat_kv`` (``experiments/results/compiled_speed_gqa.md``,
#: 2 threads): T(1) / T(2) / T(4) 6% / 6% / 3% faster, T(8) 4% slower (at 8 rows SDPA's per-head
#: work outweighs the copies it saves), so larger trees keep HF's path.
MAX_ROWS = 4


def sdpa_gqa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, q, d]
    key: torch.Tensor,  # [B, H_kv, kv, d]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF's SDPA attention, except that a traced forward of at most ``MAX_ROWS`` query rows
    hands the grouped heads to SDPA."""
    plain = not torch.compiler.is_compiling() or any(kwargs.get(k) is not None for k in ("softcap", "position_bias"))
    if plain or query.shape[1] == key.shape[1] or query.shape[2] > MAX_ROWS:
        return sdpa_rows_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                 is_causal=is_causal, **kwargs)
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    causal = query.shape[2] > 1 and attention_mask is None and causal  # HF's rule, as in sdpa_attention_forward
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
                                         is_causal=causal, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def use_gqa_attention(model: PreTrainedModel) -> bool:
    """Switch an SDPA model on CPU with grouped key/value heads (HF's or the eager target's
    grouped rows, which its eager calls keep) to :func:`sdpa_gqa_forward`."""
    return use_sdpa_variant(model, NAME, sdpa_gqa_forward, (grouped_rows.NAME,))
