"""Prompt-lookup drafting (Saxena 2023; HF's ``prompt_lookup_num_tokens``).

Find earlier occurrences of the context's last n tokens (n from ``max_ngram`` down to
``min_ngram``) and propose what followed them. ``branches > 1`` merges the continuations of the
most recent distinct matches into a trie, so the target checks several guesses at once.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from specblock.policies.tree import DraftTree
from specblock.runtime.drafters.base import DraftRequest, Drafter


def find_continuations(tokens: np.ndarray, ngram: int, depth: int, limit: int) -> np.ndarray:
    """Up to ``limit`` continuations (most recent match first) of the last ``ngram`` tokens,
    each ``depth`` long, padded with -1 where the context ends."""
    n = len(tokens)
    if n <= ngram or depth <= 0:
        return np.zeros((0, depth), dtype=np.int64)
    windows = sliding_window_view(tokens[:-1], ngram)  # windows ending before the last token
    hits = np.nonzero((windows == tokens[-ngram:]).all(axis=1))[0][::-1]  # most recent first
    starts = hits + ngram
    if starts.size == 0:
        return np.zeros((0, depth), dtype=np.int64)
    idx = starts[:, None] + np.arange(depth)[None, :]
    cont = np.where(idx < n, tokens[np.minimum(idx, n - 1)], -1)
    _, first = np.unique(cont, axis=0, return_index=True)  # drop duplicate continuations
    return cont[np.sort(first)][:limit]


def first_match(tokens: np.ndarray, max_ngram: int, min_ngram: int, depth: int) -> np.ndarray:
    """What followed the most recent earlier occurrence of the context's last n tokens (the
    longest n from ``max_ngram`` down that has one), up to ``depth`` tokens: the first row of
    ``find_continuations`` without its padding. Why a second function: lookup's branch and
    ``branches=1`` want only this row, and the dedup and the trie behind several rows
    (``np.unique`` over rows) were most of the host time the branch added to a step."""
    n = len(tokens)
    for g in range(max_ngram, min_ngram - 1, -1):
        if n <= g or depth <= 0:
            continue
        hits = np.flatnonzero((sliding_window_view(tokens[:-1], g) == tokens[-g:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + g
            return tokens[start : start + depth]
    return tokens[:0]


def trie_from_paths(root: int, paths: np.ndarray, budget: int) -> DraftTree:
    """Merge token paths (rows, -1 padded) into a tree, one vectorised step per depth."""
    tree = DraftTree.root_only(root)
    if paths.size == 0 or budget <= 0:
        return tree
    node_of = np.zeros(paths.shape[0], dtype=np.int64)  # each path's current node
    alive = np.ones(paths.shape[0], dtype=bool)
    for d in range(paths.shape[1]):
        alive &= paths[:, d] >= 0
        if not alive.any():
            break
        keys = np.stack([node_of[alive], paths[alive, d]], axis=1)
        uniq, first, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
        order = np.argsort(first)  # keep the most recent match's branch first
        room = budget - (tree.size - 1)
        if room <= 0:
            break
        order = order[:room]
        new = tree.extend(parents=uniq[order, 0], tokens=uniq[order, 1], block=0)
        slot = np.full(uniq.shape[0], -1, dtype=np.int64)
        slot[order] = new
        mapped = slot[inverse.reshape(-1)]
        idx = np.nonzero(alive)[0]
        node_of[idx] = np.maximum(mapped, 0)
        alive[idx[mapped < 0]] = False
    return tree


class LookupDrafter(Drafter):
    name = "lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, depth: int = 8, branches: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("lookup needs 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram, self.depth, self.branches = max_ngram, min_ngram, depth, branches

    def propose(self, req: DraftRequest) -> DraftTree:
        tokens = req.tokens
        depth = min(self.depth, req.max_depth)
        if self.branches == 1:  # one chain: no trie to merge
            chain = first_match(tokens, self.max_ngram, self.min_ngram, min(depth, req.budget))
            tree = DraftTree.root_only(int(tokens[-1]))
            if chain.size:
                tree.extend(parents=np.arange(chain.size), tokens=chain.astype(np.int64), block=0)
            return tree
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            cont = find_continuations(tokens, n, depth, self.branches)
            if cont.shape[0]:
                return trie_from_paths(int(tokens[-1]), cont, req.budget)
        return DraftTree.root_only(int(tokens[-1]))
