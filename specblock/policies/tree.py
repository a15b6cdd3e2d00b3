"""The draft tree: flat arrays, root at index 0, parents before children.

Why flat arrays: the target verifies the whole tree in one forward, so what it needs (an ancestor
mask and position ids) must come out of a few vectorised numpy operations, not a walk over node
objects. The simulator builds the same trees without torch, so nothing here imports it.

The root is the last committed token that the target has not yet processed (the previous
iteration's bonus token, or the last prompt token). It is always "correct"; drafted nodes hang
below it. A tree with only the root is plain autoregressive decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

#: Rank buckets of the paper: b0 = rank 1, b1 = ranks 2-4, b2 = ranks 5-10, b3 = rank > 10.
#: Upper bounds (inclusive, 1-based rank) of b0..b2; anything above is b3.
BUCKET_UPPER = (1, 4, 10)
NUM_BUCKETS = 4
NO_BUCKET = -1


def rank_to_bucket(rank: np.ndarray | int) -> np.ndarray:
    """Map 0-based ranks (0 = top-1) to buckets b0..b3."""
    r = np.asarray(rank) + 1
    return np.searchsorted(np.asarray(BUCKET_UPPER), r, side="left").astype(np.int64)


@dataclass
class DraftTree:
    """A token tree. Stored: tokens, parent, depth and per-node draft statistics.

    Derived on demand and cached (never stored twice): the ancestor mask, children lists, leaves,
    root-to-node paths. Trees are grown with :meth:`extend`, which keeps parents before children
    by construction (a parent index must already exist).
    """

    tokens: np.ndarray
    parent: np.ndarray
    depth: np.ndarray
    logprob: np.ndarray  # draft log-prob of the node's token given its parent (0 at the root)
    rank: np.ndarray  # 0-based rank among its parent's draft candidates (-1 when unknown)
    bucket: np.ndarray  # predicted rank bucket b0..b3 of the position (NO_BUCKET when none)
    block: np.ndarray  # block iteration that drafted the node (-1 at the root)
    # Drafter-private per-tree data (e.g. hidden states). One key is shared: ``meta["positions"]``,
    # per expanded node the drafter's whole candidate list there (``node`` [E] plus [E, ...] arrays,
    # e.g. ``ids`` and ``logp``), which engine traces log with the target's rank among them; it is
    # the one meta entry :meth:`subtree` remaps (rows of dropped nodes go).
    meta: dict = field(default_factory=dict)

    # ----------------------------------------------------------------- construction
    @classmethod
    def root_only(cls, token: int) -> "DraftTree":
        return cls(
            tokens=np.array([token], dtype=np.int64),
            parent=np.array([-1], dtype=np.int64),
            depth=np.array([0], dtype=np.int64),
            logprob=np.zeros(1, dtype=np.float32),
            rank=np.array([-1], dtype=np.int64),
            bucket=np.array([NO_BUCKET], dtype=np.int64),
            block=np.array([-1], dtype=np.int64),
        )

    @classmethod
    def from_parents(cls, tokens: np.ndarray, parent: np.ndarray, **stats: np.ndarray) -> "DraftTree":
        """Build a whole tree at once from a parent array (parents before children).

        Depth comes from pointer jumping: one vectorised step per tree level, not per node.
        """
        parent = np.asarray(parent, dtype=np.int64)
        n = parent.shape[0]
        if n == 0 or parent[0] != -1 or (n > 1 and ((parent[1:] < 0) | (parent[1:] >= np.arange(1, n))).any()):
            raise ValueError("from_parents: node 0 must be the root and parents must precede children")
        depth = np.zeros(n, dtype=np.int64)
        anc = parent.copy()
        while (anc >= 0).any():
            live = anc >= 0
            depth += live
            anc = np.where(live, parent[np.maximum(anc, 0)], -1)
        full = lambda key, default, dtype: np.asarray(stats.get(key, np.full(n, default)), dtype=dtype)
        return cls(
            tokens=np.asarray(tokens, dtype=np.int64),
            parent=parent,
            depth=depth,
            logprob=full("logprob", 0.0, np.float32),
            rank=full("rank", -1, np.int64),
            bucket=full("bucket", NO_BUCKET, np.int64),
            block=full("block", 0, np.int64),
        )

    def extend(
        self,
        parents: np.ndarray,
        tokens: np.ndarray,
        logprob: np.ndarray | None = None,
        rank: np.ndarray | None = None,
        bucket: np.ndarray | None = None,
        block: int | np.ndarray = 0,
        levels: list[slice] | None = None,
    ) -> np.ndarray:
        """Append nodes; returns their new indices. A parent is an existing node or a node
        earlier in this same batch (so a whole drafted block goes in with one call).

        The arrays are concatenated once per call; depth and the cached derived arrays are filled
        one batch level at a time (a node's level is its distance from the existing tree), never
        node by node. ``levels`` lets a caller that knows them (``grow_block`` adds a block depth
        by depth) skip finding them; a wrong hint fails the depth check below.
        """
        parents = np.asarray(parents, dtype=np.int64).reshape(-1)
        n_new = parents.shape[0]
        start = self.size
        if n_new == 0:
            return np.arange(start, start, dtype=np.int64)
        if parents.min() < 0 or (parents >= start + np.arange(n_new)).any():
            raise ValueError("extend: every parent must be an existing node or come earlier in the batch")

        def col(x, default, dtype):
            if x is None:
                return np.full(n_new, default, dtype=dtype)
            a = np.asarray(x, dtype=dtype)
            return a if a.shape == (n_new,) else np.broadcast_to(a, (n_new,))  # broadcast_to is slow

        hinted = levels is not None
        if levels is None:
            levels = _batch_levels(parents, start)
        depth = np.concatenate([self.depth, np.full(n_new, -1, dtype=np.int64)])
        for idx in levels:
            depth[start:][idx] = depth[parents[idx]] + 1
        if hinted and (depth[start:] != depth[parents] + 1).any():
            raise ValueError("extend: the levels hint does not match the parents")
        self.tokens = np.concatenate([self.tokens, col(tokens, 0, np.int64)])
        self.parent = np.concatenate([self.parent, parents])
        self.depth = depth
        self.logprob = np.concatenate([self.logprob, col(logprob, 0.0, np.float32)])
        self.rank = np.concatenate([self.rank, col(rank, -1, np.int64)])
        self.bucket = np.concatenate([self.bucket, col(bucket, NO_BUCKET, np.int64)])
        self.block = np.concatenate([self.block, col(block, 0, np.int64)])
        self._grow_caches(start, parents, levels)
        return np.arange(start, start + n_new, dtype=np.int64)

    def subtree(self, keep: np.ndarray) -> tuple["DraftTree", np.ndarray]:
        """Keep the nodes in ``keep`` (bool mask or indices; must be ancestor-closed).

        Returns the new tree and, for each kept node, its old index. Used to cut a tree to a
        node budget or to the context limit.
        """
        keep = np.asarray(keep)
        if keep.dtype == bool:
            idx = np.nonzero(keep)[0]
        else:
            idx = np.unique(keep.astype(np.int64))
        if idx.size == 0 or idx[0] != 0:
            raise ValueError("subtree: the root must be kept")
        remap = np.full(self.size, -1, dtype=np.int64)
        remap[idx] = np.arange(idx.size)
        old_parent = self.parent[idx]
        new_parent = np.where(old_parent >= 0, remap[np.maximum(old_parent, 0)], -1)
        if (new_parent[1:] < 0).any():
            raise ValueError("subtree: kept nodes must be ancestor-closed")
        t = DraftTree(
            tokens=self.tokens[idx],
            parent=new_parent,
            depth=self.depth[idx],
            logprob=self.logprob[idx],
            rank=self.rank[idx],
            bucket=self.bucket[idx],
            block=self.block[idx],
            meta=dict(self.meta),
        )
        pos = self.meta.get("positions")
        if pos is not None:
            node = np.asarray(pos["node"], dtype=np.int64)
            live = remap[node] >= 0
            t.meta["positions"] = {k: (remap[node[live]] if k == "node" else np.asarray(v)[live])
                                   for k, v in pos.items()}
        return t, idx

    # ----------------------------------------------------------------- derived views
    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def max_depth(self) -> int:
        return int(self.depth.max())

    def _invalidate(self) -> None:
        for name in ("ancestor_mask", "cum_logprob", "is_leaf"):
            self.__dict__.pop(name, None)

    def _grow_caches(self, start: int, parents: np.ndarray, levels: list) -> None:
        """Extend already-computed derived arrays for nodes ``start..`` instead of rebuilding
        them: drafters read cum_logprob after every step. Filled level by level so a parent is
        always done first. The ancestor mask is dropped, not grown: it is needed once per tree
        (the verify mask), and one level-wise build then costs less than growing it per call."""
        d = self.__dict__
        d.pop("ancestor_mask", None)
        if "cum_logprob" in d:
            cum = np.concatenate([d["cum_logprob"], self.logprob[start:]])
            for idx in levels:
                cum[start:][idx] += cum[parents[idx]]
            d["cum_logprob"] = cum
        if "is_leaf" in d:
            leaf = np.concatenate([d["is_leaf"], np.ones(self.size - start, dtype=bool)])
            leaf[parents] = False
            d["is_leaf"] = leaf

    @cached_property
    def ancestor_mask(self) -> np.ndarray:
        """``[N, N]`` bool: ``mask[i, j]`` iff j is i or an ancestor of i (the attention pattern).

        Built one depth level at a time (a handful of vectorised steps), never node by node.
        """
        n = self.size
        mask = np.zeros((n, n), dtype=bool)
        mask[0, 0] = True
        for d in range(1, self.max_depth + 1):
            nodes = np.nonzero(self.depth == d)[0]
            mask[nodes] = mask[self.parent[nodes]]
            mask[nodes, nodes] = True
        return mask

    @cached_property
    def cum_logprob(self) -> np.ndarray:
        """Sum of draft log-probs from the root to each node (EAGLE-2's ranking score)."""
        cum = self.logprob.astype(np.float32)  # a copy
        for d in range(1, self.max_depth + 1):  # level by level, the order extend adds in
            nodes = np.nonzero(self.depth == d)[0]
            cum[nodes] += cum[self.parent[nodes]]
        return cum

    @cached_property
    def is_leaf(self) -> np.ndarray:
        has_child = np.zeros(self.size, dtype=bool)
        has_child[self.parent[1:]] = True
        return ~has_child

    def position_ids(self, past_len: int) -> np.ndarray:
        """Position of each node in the sequence: the root sits at ``past_len``."""
        return past_len + self.depth

    def path_to(self, node: int) -> np.ndarray:
        """Indices from the root to ``node`` inclusive, in depth order.

        Parents precede children, so ascending index order along an ancestor chain is depth order.
        """
        return np.nonzero(self.ancestor_mask[node])[0]

    def leaf_paths(self) -> list[np.ndarray]:
        return [self.path_to(int(i)) for i in np.nonzero(self.is_leaf)[0]]

    def children(self, node: int) -> np.ndarray:
        return np.nonzero(self.parent == node)[0]

    def check(self) -> None:
        """Validate the structural invariants (for tests and for trees from users' drafters)."""
        n = self.size
        for name in ("parent", "depth", "logprob", "rank", "bucket", "block"):
            if getattr(self, name).shape != (n,):
                raise ValueError(f"DraftTree.{name} has shape {getattr(self, name).shape}, want ({n},)")
        if self.parent[0] != -1 or self.depth[0] != 0:
            raise ValueError("DraftTree: node 0 must be the root (parent -1, depth 0)")
        if n > 1:
            p = self.parent[1:]
            if (p < 0).any() or (p >= np.arange(1, n)).any():
                raise ValueError("DraftTree: every parent must come before its child")
            if (self.depth[1:] != self.depth[p] + 1).any():
                raise ValueError("DraftTree: depth must be parent depth + 1")


def _batch_levels(parents: np.ndarray, start: int) -> list[np.ndarray]:
    """Batch positions grouped by level: 0 = parent already in the tree, l = parent at level
    l - 1 of the same batch. One vectorised pass per level."""
    inner = parents >= start
    if not inner.any():
        return [np.arange(parents.shape[0])]
    up = np.where(inner, parents - start, 0)
    level = np.zeros(parents.shape[0], dtype=np.int64)
    while True:
        nxt = np.where(inner, level[up] + 1, 0)
        if (nxt == level).all():
            break
        level = nxt
    return [np.nonzero(level == lv)[0] for lv in range(int(level.max()) + 1)]
