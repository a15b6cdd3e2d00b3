"""A drafter's KV cache of committed positions, in storage with room to grow.

Why not ``torch.cat``: appending by concatenation copies the whole cache at every step, for each
layer's keys and values, and the block attention concatenated it once more with the block's own
keys. At a few hundred positions those copies were a sixth of SpecBlock's drafting time on a CPU
(``torch.profiler``: ``aten::cat`` 0.72 of 4.6 ms per iteration, the largest op after the
linears). Here an append writes its rows in place, and a forward *stages* its own keys in the
free rows after the context (:class:`KVSlot`), so attention reads one view of the storage.

A cache is a value: :meth:`commit` and :meth:`reserve` return a new one, which may share the
storage. Rows are only ever written past a cache's ``n``, so a cache kept aside (calibration
restores one again and again) still reads its own rows, as long as only the latest cache of a
storage is written to (writing through an older one overwrites what the newer ones added).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specblock.runtime.growing_cache import next_capacity

GROW = 256  # rows added at least when the storage must grow (then doubled): few reallocations per conversation


@dataclass(frozen=True)
class KVCache:
    keys: tuple[torch.Tensor, ...]  # per layer [1, H, capacity, d]; rows 0..n-1 committed
    values: tuple[torch.Tensor, ...]
    n: int

    @classmethod
    def empty(cls, layers: int, heads: int, head_dim: int, like: torch.Tensor) -> "KVCache":
        """No rows and no room (``reserve`` makes it); dtype and device ``like``'s."""
        new = lambda: tuple(like.new_zeros(1, heads, 0, head_dim) for _ in range(layers))
        return cls(new(), new(), 0)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[-2]

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s committed keys and values, ``[1, H, n, d]`` views (the tuple form that
        every attention here takes as context)."""
        return self.keys[layer][:, :, : self.n], self.values[layer][:, :, : self.n]

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def view(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``0..end-1``: the committed ones and whatever was written after them."""
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def write(self, layer: int, at: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Rows ``k``, ``v`` (``[1, H, m, d]``) at ``at..at+m-1``, in place; ``reserve`` made room."""
        m = k.shape[-2]
        if at < self.n or at + m > self.capacity:
            raise IndexError(f"rows {at}..{at + m - 1} outside the free rows {self.n}..{self.capacity - 1}")
        self.keys[layer][:, :, at : at + m].copy_(k)
        self.values[layer][:, :, at : at + m].copy_(v)

    def reserve(self, extra: int) -> "KVCache":
        """A cache with room for ``extra`` rows past ``n`` (this one, or a copy in larger storage)."""
        need = self.n + extra
        if need <= self.capacity:
            return self
        cap = next_capacity(need, self.capacity, GROW)
        grow = lambda ts: tuple(torch.cat([t[:, :, : self.n], t.new_zeros(*t.shape[:2], cap - self.n, t.shape[-1])], -2)
                                for t in ts)
        return KVCache(grow(self.keys), grow(self.values), self.n)

    def commit(self, m: int) -> "KVCache":
        """The first ``m`` rows written past ``n`` join the committed context."""
        if self.n + m > self.capacity:
            raise IndexError(f"cannot commit {m} rows past {self.n} of {self.capacity}")
        return KVCache(self.keys, self.values, self.n + m)

    def append(self, kvs: list[tuple[torch.Tensor, torch.Tensor]]) -> "KVCache":
        """Each layer's ``(k, v)`` rows (``[1, H, m, d]``) committed after the others."""
        m = kvs[0][0].shape[-2]
        cache = self.reserve(m)
        for layer, (k, v) in enumerate(kvs):
            cache.write(layer, cache.n, k, v)
        return cache.commit(m)

    @classmethod
    def of(cls, kvs: list[tuple[torch.Tensor, torch.Tensor]]) -> "KVCache":
        """A cache holding ``kvs`` (per layer ``[1, H, m, d]``), with room to grow."""
        k = kvs[0][0]
        return cls.empty(len(kvs), k.shape[1], k.shape[-1], k).append(kvs)

    def slot(self, layer: int) -> "KVSlot":
        return KVSlot(self, layer)


@dataclass(frozen=True)
class KVSlot:
    """One layer's cache, for a forward of one causal row (the block and its new context
    positions): its keys are staged after the committed rows and attention runs over one view."""

    cache: KVCache
    layer: int

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q``, ``k``, ``v``: ``[1, H, m, d]``, causal among themselves and seeing every committed
        row. Writes ``k``, ``v`` at rows ``n..n+m-1`` (a later ``commit`` may keep some of them)."""
        c, m = self.cache.n, q.shape[-2]
        self.cache.write(self.layer, c, k, v)
        keys, values = self.cache.view(self.layer, c + m)
        mask = torch.ones(m, c + m, dtype=torch.bool, device=q.device).tril(c)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
