"""Regional compilation: one compiled decoder-layer step, reused by every layer.

Why: compiling the whole forward traces and builds every layer's code again for each (bucket,
span) shape, so cold compile time grows with depth (measured 209 s for the 6-layer lab model,
1,754 s for the 30-layer SmolLM2). PyTorch's "regional compilation" recipe compiles the repeated
block instead: with ``torch._dynamo.config.inline_inbuilt_nn_modules`` (default since 2.5) a
layer's parameters are graph *inputs*, so structurally identical layers share one graph per
shape. Two things would break the sharing and are kept out of the compiled region:

- HF attention calls ``cache.update(k, v, self.layer_idx)``, and dynamo guards on that int, so
  indexing a per-model cache by it would recompile per layer. The region instead gets this
  layer's key/value buffers as tensor arguments, in a one-layer cache (``_LayerCache``) that
  ignores the index.
- The embedding, rotary tables and tree mask (``inputs``), and the final norm and LM head
  (``head``) run once per forward: two more small compiled regions (eager, their ~40 aten calls
  cost more than the layers' guard checks).

The layer is called as HF's own model forward calls it (same mask, position embeddings and cache
protocol), and hidden states are collected as HF's ``capture_outputs`` does (embeddings, each
layer's output, the last one after the final norm), so logits and taps equal the whole forward's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from transformers import PreTrainedModel

from specblock.errors import SpecBlockError
from specblock.runtime.packed import PackedLinear
from specblock.runtime.q4 import Int4Linear, Int8Linear


class _LayerCache:
    """One layer's static key/value buffers behind HF's ``Cache.update`` (the index is ignored)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, span: int) -> None:
        self.keys, self.values, self.slots, self.span = keys, values, slots, span

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.keys.index_copy_(2, self.slots, key_states)
        self.values.index_copy_(2, self.slots, value_states)
        return self.keys[:, :, : self.span], self.values[:, :, : self.span]


def layer_step(
    layer: torch.nn.Module, hidden: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    position_ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, span: int,
) -> torch.Tensor:
    """One decoder layer on the static buffers: the region that is compiled (once per shape)."""
    return layer(
        hidden, attention_mask=mask, position_ids=position_ids, past_key_values=_LayerCache(keys, values, slots, span),
        use_cache=True, position_embeddings=(cos, sin),
    )


def embed(model: PreTrainedModel, ids: torch.Tensor, positions: torch.Tensor):
    """Token embeddings ``[1, B, H]`` and the rotary tables, as HF's decoder forward makes them."""
    hidden = model.model.embed_tokens(ids[None])
    cos, sin = model.model.rotary_emb(hidden, position_ids=positions)
    return hidden, cos, sin


def head(model: PreTrainedModel, hidden: torch.Tensor, last_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Final norm and LM head: the normed hidden state and logits ``[B or 1, V]``."""
    hidden = model.model.norm(hidden)
    return hidden, model.lm_head(hidden[:, -1:] if last_only else hidden)[0]


@dataclass(frozen=True)
class RegionFns:
    """The regional forward's pieces, compiled or eager: ``inputs(ids, depth, anc, past, span)``
    gives ``mask, slots, positions, hidden, cos, sin``; ``layer`` is ``layer_step``'s signature,
    ``head`` is ``head``'s."""

    inputs: Callable
    layer: Callable = layer_step
    head: Callable = head


def check_regional(model: PreTrainedModel) -> None:
    """Regions call the model's parts directly: only the plain decoder-only layout (Llama, Qwen2/3,
    Mistral, SmolLM2 ...) is supported; anything that scales or caps outside the layers is refused."""
    inner = getattr(model, "model", None)
    parts = ("embed_tokens", "layers", "norm", "rotary_emb")
    if inner is None or not hasattr(model, "lm_head") or any(not hasattr(inner, p) for p in parts):
        raise SpecBlockError(f"{type(model).__name__}: regional compilation needs model.{{{','.join(parts)}}} and "
                             "lm_head; use the whole-model compile mode")
    if any(isinstance(m, (PackedLinear, Int4Linear, Int8Linear)) for m in model.modules()):
        # Each packed or q4 linear names its weights by an int key (packed.packed_linear,
        # q4_kernel.linear_key), which dynamo specialises: one shared layer step would compile once per layer.
        raise SpecBlockError("regional compilation does not support --dtype packed-fp16 or q4; use --compile-mode whole")
    cfg = model.config
    for extra in ("final_logit_softcapping", "logit_scale", "embedding_multiplier", "logits_scaling"):
        if getattr(cfg, extra, None) not in (None, 1, 1.0):
            raise SpecBlockError(f"{type(model).__name__} has {extra}; use the whole-model compile mode")


def regional_forward(
    model: PreTrainedModel, fns: RegionFns, keys: list[torch.Tensor], values: list[torch.Tensor],
    ids: torch.Tensor, depth: torch.Tensor, anc: torch.Tensor, past: torch.Tensor, span: int,
    want: bool, last_only: bool,
) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """HF's decoder forward from ``fns``' pieces, ``fns.layer`` once per layer. Returns logits
    ``[B or 1, V]`` and, if ``want``, the hidden states as HF's ``output_hidden_states``."""
    mask, slots, positions, hidden, cos, sin = fns.inputs(ids, depth, anc, past, span)
    states = [hidden] if want else None
    for i, layer in enumerate(model.model.layers[: model.config.num_hidden_layers]):
        hidden = fns.layer(layer, hidden, mask, cos, sin, positions, keys[i], values[i], slots, span)
        if want:
            states.append(hidden)
    normed, logits = fns.head(model, hidden, last_only)
    if want:
        states[-1] = normed  # HF ties the last hidden state to the normed one
    return logits, states
