"""A KV cache with one preallocated buffer for every layer, written in place.

Why not HF's ``StaticCache``: in transformers 5.23 its layers write at an internal running
counter (``cumulative_length``) and hand attention the whole ``max_cache_len`` every step. A tree
needs neither: after verification only the accepted path stays, so the write position jumps
back, and attention should read only the span it needs (a bucket of the context, not the model's
full window). So this cache keeps one fixed-address tensor ``[1, kv_heads, cap, hd]`` per layer
for keys and one for values (as CUDA graphs need), writes at explicit positions with
``index_copy_``, and commits a path with a gather in each. Separate tensors, not views of one
buffer: inductor functionalizes an in-place write into a view by copying the whole base, which
made every compiled step copy the entire cache (measured: 5x slower than eager on the lab model).

HF's attention calls ``update(keys, values, layer_idx)`` only; the write positions and the span of
the current forward are set on the cache just before the forward (``begin``).
"""

from __future__ import annotations

import torch


class TreeStaticCache:
    """Duck-typed stand-in for an HF ``Cache``: the model forward only calls ``update`` and,
    when it has no position ids, ``get_seq_length`` (we always pass position ids)."""

    is_compileable = True

    def __init__(
        self, layers: int, kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.capacity = capacity
        shape = (1, kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        for t in self.keys + self.values:  # in-place writes then mutate fixed buffers (CUDA graphs need it)
            torch._dynamo.mark_static_address(t)
        self.write_pos: torch.Tensor | None = None  # [n] cache slots of the current forward's tokens
        self.span = 0  # attention reads slots [0, span) in the current forward

    def begin(self, write_pos: torch.Tensor, span: int) -> None:
        self.write_pos, self.span = write_pos, span

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k.index_copy_(2, self.write_pos, key_states)
        v.index_copy_(2, self.write_pos, value_states)
        return k[:, :, : self.span], v[:, :, : self.span]

    def get_seq_length(self, layer_idx: int = 0) -> int:  # pragma: no cover - position ids are always given
        raise RuntimeError("TreeStaticCache needs explicit position ids")

    def keep(self, first: int, src: torch.Tensor) -> None:
        """Move the slots ``src`` to ``first, first + 1, ...`` in every layer."""
        end = first + src.numel()
        for t in self.keys + self.values:
            t[:, :, first:end] = t.index_select(2, src)
