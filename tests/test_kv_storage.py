"""Caches that grow in place (the drafters' KVCache, the target's GrowingLayer) hold exactly what
appending by concatenation held, across growth, commits, rewinds and staged rows."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from transformers.cache_utils import DynamicLayer

from specblock.policies.tree import DraftTree
from specblock.runtime import growing_cache
from specblock.runtime.drafters import kvcache
from specblock.runtime.drafters.kvcache import KVCache
from specblock.runtime.drafters.layers import DecoderLayer
from specblock.runtime.growing_cache import GrowingLayer
from specblock.runtime.target import TargetModel
from tiny import tiny_model

H, D = 3, 4


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), min_size=1, max_size=12), st.integers(0, 10**6))
def test_kvcache_appends_like_cat(steps, seed):
    """Each step stages ``m`` rows and commits the first ``keep`` of them (a first block's new
    positions, then its queries): the committed rows are the concatenation of what was kept."""
    g = torch.Generator().manual_seed(seed)
    before, kvcache.GROW = kvcache.GROW, 0  # no slack: the storage grows (doubling) whenever a step needs it
    try:
        _appends_like_cat(steps, g)
    finally:
        kvcache.GROW = before


def _appends_like_cat(steps, g):
    cache = KVCache.empty(2, H, D, torch.zeros(1))
    ref_k, ref_v = [torch.zeros(1, H, 0, D)] * 2, [torch.zeros(1, H, 0, D)] * 2
    for m, keep in steps:
        keep = min(keep, m)
        cache = cache.reserve(m)
        for layer in range(2):
            k, v = torch.randn(1, H, m, D, generator=g), torch.randn(1, H, m, D, generator=g)
            cache.write(layer, cache.n, k, v)
            ref_k[layer] = torch.cat([ref_k[layer], k[:, :, :keep]], -2)
            ref_v[layer] = torch.cat([ref_v[layer], v[:, :, :keep]], -2)
        cache = cache.commit(keep)
        for layer in range(2):
            assert torch.equal(cache[layer][0], ref_k[layer]) and torch.equal(cache[layer][1], ref_v[layer])


def test_kvcache_kept_aside_still_reads_its_rows():
    """Calibration restores an older cache again and again: later writes land past its rows."""
    cache = KVCache.empty(1, H, D, torch.zeros(1)).reserve(3)
    cache.write(0, 0, torch.ones(1, H, 3, D), torch.ones(1, H, 3, D))
    old = cache.commit(3)
    newer = old.reserve(2)
    newer.write(0, 3, torch.full((1, H, 2, D), 2.0), torch.full((1, H, 2, D), 2.0))
    newer = newer.commit(2)
    assert torch.equal(old[0][0], torch.ones(1, H, 3, D)) and newer[0][0].shape[-2] == 5
    with pytest.raises(IndexError):
        old.write(0, 2, torch.ones(1, H, 1, D), torch.ones(1, H, 1, D))  # over its committed rows


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 12), st.integers(1, 6), st.integers(0, 10**6))
def test_staged_attention_matches_the_context_copy(c, m, seed):
    """A layer over a KVSlot (keys staged after the context) computes what it computed over the
    context's views, where the block attention concatenated context and own keys."""
    torch.manual_seed(seed)
    layer = DecoderLayer(H * D, H, 16, 10000.0).eval()
    x = torch.randn(1, 1, m, H * D)
    pos = torch.arange(c, c + m)[None, None]
    cache = KVCache.empty(1, H, D, x).reserve(c + m)
    cache.write(0, 0, torch.randn(1, H, c, D), torch.randn(1, H, c, D))
    cache = cache.commit(c)
    with torch.no_grad():
        want, (k_want, _) = layer(x, pos, cache[0] if c else None)
        got, _ = layer(x, pos, cache.slot(0))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.view(0, c + m)[0][:, :, c:], k_want[:, :, 0])  # staged, not committed
    assert cache.n == c


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 7), st.integers(0, 7)), min_size=1, max_size=10), st.integers(0, 10**6))
def test_growing_layer_matches_dynamic_layer(steps, seed):
    """Updates of ``m`` rows, each followed by a commit-like cut to ``keep`` of them with one
    row moved in place (``TargetModel.commit``'s two operations), leave the same keys in both."""
    g = torch.Generator().manual_seed(seed)
    ref, mine = DynamicLayer(), GrowingLayer()
    before = growing_cache.GROW, growing_cache.MAX_ROOM
    growing_cache.GROW, growing_cache.MAX_ROOM = 1, 3  # grow on almost every update, by 3 rows at most past 3
    try:
        for m, keep in steps:
            k, v = torch.randn(1, H, m, D, generator=g), torch.randn(1, H, m, D, generator=g)
            out = [layer.update(k, v) for layer in (ref, mine)]
            assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
            end = ref.get_seq_length() - m + min(keep, m)
            for layer in (ref, mine):
                if end >= 2:
                    layer.keys[..., end - 1 : end, :] = layer.keys.index_select(-2, torch.tensor([end - 2]))
                layer.keys, layer.values = layer.keys[..., :end, :], layer.values[..., :end, :]
            assert torch.equal(ref.keys, mine.keys) and torch.equal(ref.values, mine.values)
        mine.keys, mine.values = mine.keys.clone(), mine.values.clone()  # a fresh tensor: re-seated, nothing lost
        k = torch.randn(1, H, 2, D, generator=g)
        assert torch.equal(mine.update(k, k)[0], ref.update(k, k)[0])
    finally:
        growing_cache.GROW, growing_cache.MAX_ROOM = before


@given(st.integers(1, 10**6), st.integers(0, 10**6), st.integers(0, 512))
def test_storage_doubles_while_small_and_then_grows_by_at_most_max_room(need, capacity, grow):
    cap = growing_cache.next_capacity(need, capacity, grow)
    assert cap >= need + grow  # at least ``grow`` rows of room
    assert cap - need <= max(grow, growing_cache.MAX_ROOM)  # never more than MAX_ROOM unused (or grow)
    assert cap >= min(2 * capacity, need + growing_cache.MAX_ROOM)  # doubling until the room would pass MAX_ROOM


def test_target_decodes_across_growth(monkeypatch):
    """The target's cache grows while it verifies trees and commits paths; the next logits are a
    fresh forward's over the committed tokens."""
    monkeypatch.setattr(growing_cache, "GROW", 1)
    model = tiny_model("qwen3", vocab=32, seed=2)
    target = TargetModel(model)
    rng = np.random.default_rng(0)
    committed = list(rng.integers(0, 32, 5))
    target.prefill(np.array(committed[:-1]))
    for _ in range(12):
        n = int(rng.integers(1, 6))
        parent = np.concatenate([[-1], (rng.random(n - 1) * np.arange(1, n)).astype(np.int64)])
        tokens = rng.integers(0, 32, n)
        tokens[0] = committed[-1]
        tree = DraftTree.from_parents(tokens, parent)
        target.tree_forward(tree)
        path = tree.path_to(int(rng.integers(0, n)))
        target.commit(path)
        committed = committed[:-1] + list(tree.tokens[path]) + [int(rng.integers(0, 32))]
    got = target.tree_forward(DraftTree.root_only(committed[-1])).logits[-1]
    with torch.no_grad():
        want = model(torch.tensor(committed)[None]).logits[0, -1]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert isinstance(target.cache.layers[0], GrowingLayer)


def test_append_and_of():
    """``append`` (ParallelSpec's and Falcon's commits) adds rows after the others, layer by layer."""
    a = [(torch.ones(1, H, 2, D), torch.zeros(1, H, 2, D)), (torch.full((1, H, 2, D), 3.0), torch.ones(1, H, 2, D))]
    cache = KVCache.of(a).append([(k * 2, v * 2) for k, v in a])
    assert cache.n == 4 and len(list(cache)) == 2
    for (k, v), (k0, v0) in zip(cache, a):
        assert torch.equal(k, torch.cat([k0, 2 * k0], -2)) and torch.equal(v, torch.cat([v0, 2 * v0], -2))
