"""Medusa's static tree, shared by the runtime's Medusa drafter and the simulator's Medusa model.

A static tree is chosen once per node budget from a table ``acc[head, rank]``: how often head
``head``'s rank-``rank`` candidate is the target's token, measured on held-out data. Node = a
path of per-head ranks; the runtime fills it with each head's candidates whatever the parent's
token. The simulator builds the same tree from the same table (the drafter's ``rank_acc``, or its
acceptance model's rank pmf), so both verify the same shape.
"""

from __future__ import annotations

import heapq

import numpy as np


def static_tree(acc: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Best-first choice of ``budget`` rank paths by product accuracy (Medusa's tree search).

    Returns (parent, depth, rank) with the root at index 0 and parents before children. A path
    scores no more than its prefix, so taking the best paths first keeps the tree prefix-closed.
    Run once per budget and table (callers cache it), not per step.
    """
    acc = np.asarray(acc, dtype=np.float64)
    if acc.ndim != 2 or acc.size == 0:
        raise ValueError("static_tree: acc must be a non-empty [heads, top_k] table")
    heads, k = acc.shape
    parent, depth, rank = [-1], [0], [-1]
    heap = [(-acc[0, r], 0, r, 1) for r in range(k)]  # (-score, parent node, rank, depth)
    heapq.heapify(heap)
    while heap and len(parent) <= budget:
        neg, par, r, d = heapq.heappop(heap)
        node = len(parent)
        parent.append(par), depth.append(d), rank.append(r)
        if d < heads:
            for r2 in range(k):
                heapq.heappush(heap, (neg * acc[d, r2], node, r2, d + 1))
    return np.asarray(parent, np.int64), np.asarray(depth, np.int64), np.asarray(rank, np.int64)
