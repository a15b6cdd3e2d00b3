"""Tree rows attend on the key/value heads in place: no ``repeat_kv`` copy per tree forward.

Why: with one query token HF's SDPA attention folds the query heads that share a key/value head
into rows of that head (``pack_gqa``) and reads the cache in place. A tree forward carries a mask,
and there HF calls ``repeat_kv`` instead: every layer copies its keys and values over the whole
attention span once per query head (SmolLM2: 9 query heads on 3 key/value heads, 60 copies a
forward). The same fold works for n rows under a mask shared by all heads: query ``[B, H, n, d]``
becomes ``[B, H_kv, g * n, d]`` (head-major: rows of one query head stay together) and the mask is
tiled g times over its rows, so each folded row sees exactly its own row's mask.

Scope: eager CPU forwards of an SDPA model with grouped heads, up to ``MAX_ROWS`` query rows
(measured: ``experiments/tree_attention.py``); anything else (one row, a per-head mask, softcap,
position bias, tracing) goes through HF's own function unchanged. ``tests/test_grouped_rows.py``
holds the outputs to HF's path at fp32.

fp32 forwards (packed-fp16, q4, float32) take our fused op instead where it runs
(``runtime/tree_attention.py``, the compiled graphs' attention too), one row included: a row's
result then does not depend on which slots its visible keys sit in, so a tree's rows are their
tokens' own (q4's int8 kernel needs that to be lossless).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from specblock.runtime import tree_attention

NAME = "specblock_sdpa_rows"
#: fp32 forwards through the fused op where it runs (False: SDPA, the baseline of
#: ``experiments/tree_attention.py --impls rows_sdpa``).
USE_FUSED = True
#: Query rows up to which trees are folded onto the key/value heads.
MAX_ROWS = 64

# The last tiled mask: every layer of one forward gets the same mask object, so it is tiled once a
# forward, not once a layer. Keyed on the mask itself (held here, so its id cannot be reused), its
# version counter (an in-place change makes it stale) and the fold factor.
_tiled: tuple[torch.Tensor, int, int, torch.Tensor] | None = None


def tiled_mask(mask: torch.Tensor, g: int) -> torch.Tensor:
    """``mask`` ``[B, 1, n, kv]`` tiled g times over its rows, reused across the layers of a forward."""
    global _tiled
    if _tiled is not None and _tiled[0] is mask and _tiled[1] == mask._version and _tiled[2] == g:
        return _tiled[3]
    out = _tile(mask, g)
    _tiled = (mask, mask._version, g, out)
    return out


def _tile(mask: torch.Tensor, g: int) -> torch.Tensor:
    return mask.repeat(1, 1, g, 1)  # row r of query head j sits at j * n + r


def sdpa_rows_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, n, d]
    key: torch.Tensor,  # [B, H_kv, kv, d]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF's SDPA attention, except that fp32 rows go through our fused op where it runs
    (``runtime/tree_attention.py``) and a masked forward of 2..``MAX_ROWS`` other rows folds the
    query heads of each key/value head into its rows."""
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    exact_prompt = getattr(module, EXACT_PROMPT, False)
    fused = _fused(query, key, value, attention_mask, dropout, scaling, causal and exact_prompt, kwargs)
    if fused is not None:
        return fused, None
    b, h, n, d = query.shape
    g = h // key.shape[1]
    fold = (
        g > 1 and 1 < n <= MAX_ROWS and attention_mask is not None and attention_mask.dim() == 4
        and attention_mask.shape[1] == 1 and not torch.compiler.is_compiling()
        and all(kwargs.get(k) is None for k in ("softcap", "position_bias", "cache"))
    )
    if not fold:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    q = query.reshape(b, h // g, g * n, d)
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=tiled_mask(attention_mask, g), dropout_p=dropout, scale=scaling)
    return out.reshape(out.shape[0], h, n, d).transpose(1, 2).contiguous(), None


def _fused(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, dropout: float,
           scaling: float | None, causal_prompt: bool, kwargs: dict) -> torch.Tensor | None:
    """The fused op's output for an eager forward it applies to (fp32, one batch row, a mask, or
    none where HF leaves it out: one row; with ``causal_prompt``, a prompt without a past under
    HF's causal flag too), else None. The same op as compiled graphs, so eager trees are as
    layout-invariant as compiled ones."""
    n, kv = query.shape[2], key.shape[2]
    if not USE_FUSED or dropout or torch.compiler.is_compiling() \
            or any(kwargs.get(k) is not None for k in ("softcap", "position_bias", "cache", "s_aux")):
        return None
    if mask is None:
        if n == 1:
            mask = query.new_zeros(1, 1, 1, kv)
        elif causal_prompt and kv == n:  # HF's causal flag, which SDPA aligns top-left
            mask = query.new_full((1, 1, n, kv), torch.finfo(query.dtype).min).triu_(1)
        else:
            return None
    else:
        mask = mask[:, :, :, : key.shape[2]]
        if mask.dtype == torch.bool:
            mask = torch.where(mask, 0.0, torch.finfo(torch.float32).min).to(query.dtype)
    if not (tree_attention.applies(query, key, mask) and tree_attention.load()):
        return None
    return tree_attention.tree_attention(query, key, value, mask, scaling)


#: Set on an attention module whose eager prompts (no past, no mask: HF's causal flag) go through the
#: fused op too, not SDPA: they then leave the keys and values of the static cache's prefill, which
#: passes its mask. What q4's int8 kernel needs to be lossless across eager and compiled
#: (``exact_parts.use_exact_parts`` sets it); elsewhere SDPA stays, as the op is slower on long
#: prompts (``experiments/prompt_attention.py``: 1.19x SDPA's prefill at 1500 tokens, level at 512).
EXACT_PROMPT = "specblock_exact_prompt"


def mark_exact_prompts(model: torch.nn.Module, on: bool = True) -> None:
    """Set (or clear) ``EXACT_PROMPT`` on each of ``model``'s attention modules."""
    for mod in model.modules():
        if hasattr(mod, "is_causal") and hasattr(mod, "q_proj"):
            setattr(mod, EXACT_PROMPT, on)


def use_sdpa_variant(model: PreTrainedModel, name: str, forward, replaces: tuple[str, ...]) -> bool:
    """Switch an SDPA model on CPU with grouped key/value heads to ``forward``, registered as
    ``name`` (masks built the SDPA way), if its attention is ``sdpa`` or one of ``replaces``.
    Returns whether it did (other attention, devices or head layouts are left as they are)."""
    cfg = model.config
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    device = next(model.parameters()).device
    if device.type != "cpu" or kv_heads == heads or cfg._attn_implementation not in ("sdpa", name, *replaces):
        return False
    AttentionInterface.register(name, forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
    model.set_attn_implementation(name)
    return True


def use_grouped_rows(model: PreTrainedModel) -> bool:
    """Switch an eager SDPA model on CPU with grouped key/value heads to :func:`sdpa_rows_forward`."""
    return use_sdpa_variant(model, NAME, sdpa_rows_forward, ())


def use_hf_sdpa(model: PreTrainedModel) -> None:
    """Back to HF's own SDPA function (the baseline of ``experiments/tree_attention.py``)."""
    if model.config._attn_implementation == NAME:
        model.set_attn_implementation("sdpa")
