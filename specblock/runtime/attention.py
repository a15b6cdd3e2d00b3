"""Which attention each layer of an HF target does, and the tree mask each layer type gets.

Full-attention layers see every committed position and the node's tree ancestors. Sliding-window
layers (Mistral's ``sliding_window``; Gemma 2/3, Qwen2, Cohere2, ... with ``layer_types``) see
only keys less than ``window`` *positions* behind the query, HF's rule (``kv > q - window``). In
a tree, a node's position is ``past + depth``, so a sibling branch never shifts what the window
covers: the window is applied to position ids, on top of the ancestor mask.

The cache: HF's ``DynamicSlidingWindowLayer`` keeps only the last ``window - 1`` keys after each
update, so a tree forward's rejected branches would push out keys that the accepted path still
needs, and each layer would expect a mask of its own length. Here every layer keeps every key
(a plain ``DynamicLayer``) and the window lives in the mask alone: exactly what the window
layers compute, at the price of attending over (masked) keys the window no longer covers.

Models whose layers are of two types read ``attention_mask`` as a dict with one mask per layer
type (``causal_mask_mapping``); one of a single type takes a single tensor. Layer types other
than these two (chunked, linear or recurrent layers) are refused with one line.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import get_layer_types_and_kwargs

from specblock.errors import SpecBlockError
from specblock.policies.tree import DraftTree
from specblock.runtime.growing_cache import growing

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class Layout:
    types: tuple[str, ...]  # the layer types present, sorted (FULL and/or SLIDING)
    window: int | None  # the sliding window in positions; None without sliding layers

    @property
    def sliding(self) -> bool:
        return self.window is not None

    def new_cache(self, config) -> DynamicCache:
        """A cache that keeps every key of every layer (see the module docstring), growing in
        place rather than by a copy per forward (``growing_cache.py``)."""
        return growing(DynamicCache() if self.sliding else DynamicCache(config=config))


def attention_layout(model: PreTrainedModel) -> Layout:
    """The layer types as HF's own cache would see them, checked for tree verification."""
    cfg = model.config.get_text_config(decoder=True)
    try:
        types, kwargs = get_layer_types_and_kwargs(cfg)
    except Exception as e:  # noqa: BLE001 - a config this version cannot read per layer
        raise SpecBlockError(f"cannot tell the attention of each layer of {type(model).__name__} ({e})") from None
    present = tuple(sorted(set(types)))
    other = sorted(set(present) - {FULL, SLIDING})
    if other:
        raise SpecBlockError(f"{type(model).__name__} has {', '.join(other)} layers; tree verification supports "
                             "full and sliding-window attention only")
    windows = {int(k["sliding_window"]) for t, k in zip(types, kwargs) if t == SLIDING}
    if len(windows) > 1:
        raise SpecBlockError(f"{type(model).__name__} has sliding windows of {sorted(windows)} positions in different "
                             "layers; tree verification supports one window size")
    if len(present) > 1 and not _takes_mask_mapping(model):
        raise SpecBlockError(f"{type(model).__name__} mixes full and sliding-window layers but takes one attention mask "
                             "for all of them, so a tree cannot be verified exactly; use another model")
    return Layout(present, windows.pop() if windows else None)


def _takes_mask_mapping(model: PreTrainedModel) -> bool:
    """Whether the decoder reads ``attention_mask`` as a dict by layer type. transformers has no
    flag for it; every such model in 5.23 tests ``isinstance(..., dict)`` in its forward."""
    try:
        src = inspect.getsource(type(model.get_decoder()).forward)
    except (OSError, TypeError, AttributeError):
        return False
    return "attention_mask, dict)" in src


def tree_masks(layout: Layout, tree: DraftTree, past_len: int, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor | dict[str, torch.Tensor]:
    """Float additive masks ``[1, 1, N, past + N]`` for one tree forward: one tensor, or one per
    layer type when the model has both."""
    n = tree.size
    lo = torch.finfo(dtype).min
    anc = torch.as_tensor(tree.ancestor_mask, device=device)
    full = torch.zeros((1, 1, n, past_len + n), dtype=dtype, device=device)
    full[0, 0, :, past_len:].masked_fill_(~anc, lo)
    if not layout.sliding:
        return full
    depth = torch.as_tensor(np.asarray(tree.depth), device=device, dtype=torch.long)
    q = past_len + depth
    k = torch.cat([torch.arange(past_len, device=device), q])
    sliding = full.masked_fill((q[:, None] - k[None, :] >= layout.window)[None, None], lo)
    if len(layout.types) == 1:
        return sliding
    return {FULL: full, SLIDING: sliding}
