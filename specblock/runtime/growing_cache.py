"""HF's dynamic cache layer, with room to grow instead of a copy per update.

Why: ``DynamicLayer.update`` appends by ``torch.cat``, so every forward copies each layer's whole
cache twice (keys and values). On the real model's eager target at 150 positions those 60 copies
took 3.0 ms of a 33 ms token (``torch.profiler``: ``aten::cat``, 121 calls a forward, the largest
op after the linears), and they grow with the conversation. Here ``update`` writes the new rows
into storage with room for more and hands attention a view; the storage doubles when full
(by at most ``MAX_ROOM`` rows).

Everything else stays HF's: ``keys`` / ``values`` are the committed rows as views, so slicing
them (``TargetModel.commit``, calibration's rewind, the SpS drafter's crop) and writing into them
in place work as before. An update first checks that ``keys`` still views the storage and
re-seats it otherwise (a caller that assigned a fresh tensor loses nothing).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

GROW = 256  # rows added at least when the storage must grow (then doubled)
#: Rows of room at most after a growth: past this many cached positions the storage grows by this
#: many rows, not by doubling, so a long conversation holds at most this much unused storage (47 MB
#: on the real model in fp32, 46 KB a position; doubling could leave as many rows unused as used:
#: 92 MB at 2,000 positions); the copy this costs every MAX_ROOM positions is small beside the
#: forwards between two copies.
MAX_ROOM = 1024


def next_capacity(need: int, capacity: int, grow: int = GROW) -> int:
    """Rows for storage that must hold ``need`` and now holds ``capacity``: double it, with at
    least ``grow`` and at most ``MAX_ROOM`` rows of room past ``need``."""
    return max(need + grow, min(2 * capacity, need + MAX_ROOM))


class GrowingLayer(DynamicLayer):
    _k: torch.Tensor | None = None  # storage [B, H, capacity, d]; keys / values view its first rows
    _v: torch.Tensor | None = None

    def _seated(self) -> bool:
        k = self.keys
        return (self._k is not None and k.dim() == 4 and k.data_ptr() == self._k.data_ptr()
                and k.stride() == self._k.stride() and self.values.data_ptr() == self._v.data_ptr())

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, m = self.get_seq_length(), key_states.shape[-2]
        if not self._seated() or n + m > self._k.shape[-2]:
            cap = next_capacity(n + m, self._k.shape[-2] if self._k is not None else 0, GROW)
            k = key_states.new_empty(*key_states.shape[:2], cap, key_states.shape[-1])
            v = value_states.new_empty(*value_states.shape[:2], cap, value_states.shape[-1])
            if n:
                k[:, :, :n].copy_(self.keys)
                v[:, :, :n].copy_(self.values)
            self._k, self._v = k, v
        self._k[:, :, n : n + m].copy_(key_states)
        self._v[:, :, n : n + m].copy_(value_states)
        self.keys, self.values = self._k[:, :, : n + m], self._v[:, :, : n + m]
        return self.keys, self.values

    def reset(self) -> None:
        super().reset()
        self._k = self._v = None


def growing(cache: DynamicCache) -> DynamicCache:
    """``cache`` with its plain dynamic layers (made now, or as the model first updates them)
    growing in place; other layer kinds stay as HF made them."""
    if cache.layer_class_to_replicate is DynamicLayer:
        cache.layer_class_to_replicate = GrowingLayer
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
