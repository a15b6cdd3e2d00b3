"""Position pools: the sim draws whole logged draft positions instead of a parametric confidence.

Why. A depth-by-depth drafter's tree is shaped by its confidence: EAGLE-2's frontier and final
rerank keep the nodes of highest cumulative draft log-prob. The parametric model (``acceptance``:
top-1 confidence ``q0 ~ Beta(a kappa, (1 - a) kappa)``, calibrated by construction) fitted to
EAGLE-3's traces got ``a`` from positions the runtime had already selected for being confident
(0.94-0.98 at depths 4-5, where the target walks on only 47-66% of the time), and then selected
again with its own, far too confident, draws: simulated tau came out 25-69% high.

What. The runtime's EAGLE-3 traces log, per expanded node, the drafter's whole top-k (log-probs)
and the target's rank among it (``positions``; the target's token is known at every verified node,
so the rank is uncensored even where the rerank dropped the candidate). A pool keeps those rows
by key (position depth) and by whether the position's parent is reachable. At each expanded
position of a simulated tree the sim draws one row of the same key and reachability: its log-probs
become the candidates', its target rank decides correctness. Confidence, calibration and their
joint spread are then the drafter's own, not a model's.

SpecBlock's traces log every position of every block the same way (the whole top-k at a position
whose parent is on the tree, whatever the policy kept), with its block, in-block position and the
rank head's predicted bucket: the key is then ``block * block_size + position`` and a row also
gives the bucket, so confidence, rank and bucket come jointly from the drafter. Why: a policy that
reads the drafter's confidence (``examples/custom_branching.py``) shapes trees the Beta model
cannot predict (issue 18: its simulated tau was 5-14% high from the Beta confidence).

What it does not capture: positions are independent given (depth, reachable), so a confident
parent does not make a confident child more likely, as it does in the drafter. The rows are the
positions the runtime expanded, so their depth-by-depth mix is that of the runtime's selection.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

#: log-prob given to candidate columns a pool row lacks (the sim asks for more candidates than the
#: runtime logged): low enough that no policy ranks them above a logged candidate
MISSING_LOGP = -30.0


@dataclass
class PositionPool:
    """Logged positions: ``key`` [N] (depth of the expanded node), ``reach`` [N] (its parent chain
    correct), ``rank`` [N] (target's 0-based rank among the logged candidates, ``n_logged`` or more
    when absent) and ``logp`` [N, k] (sorted, best first). SpecBlock pools add ``pred`` [N] (the
    predicted bucket) and ``block_size`` (keys are ``block * block_size + position``)."""

    key: np.ndarray
    reach: np.ndarray
    rank: np.ndarray
    logp: np.ndarray
    pred: np.ndarray | None = None
    block_size: int | None = None
    _groups: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.key = np.asarray(self.key, np.int64)
        self.reach = np.asarray(self.reach, bool)
        self.rank = np.asarray(self.rank, np.int64)
        self.logp = np.asarray(self.logp, np.float64)
        n = self.key.size
        if n == 0 or self.logp.ndim != 2 or self.logp.shape[0] != n or self.reach.size != n or self.rank.size != n:
            raise ValueError("position pool: key, reach, rank and logp [N, k] must describe the same N >= 1 rows")
        if not self.reach.any():
            raise ValueError("position pool: no logged position under a reachable parent")
        if self.pred is not None:
            self.pred = np.asarray(self.pred, np.int64)
            if self.pred.size != n:
                raise ValueError("position pool: pred must have one bucket per row")
        self.depths = int(self.key.max()) + 1
        for d in range(self.depths):
            for r in (True, False):
                self._groups[d, r] = np.nonzero((self.key == d) & (self.reach == r))[0]

    def rows(self, key: int, reach: bool) -> np.ndarray:
        """Row indices for (key, reach); an empty group falls back to the same key's other class,
        then to shallower keys (deep keys the runtime rarely reached)."""
        for d in range(min(key, self.depths - 1), -1, -1):
            for r in (reach, not reach):
                g = self._groups[d, r]
                if g.size:
                    return g
        raise AssertionError("unreachable: the pool has rows")

    def key_of(self, block: int, pos: int) -> int:
        """A SpecBlock pool's key for (block, in-block position); blocks and positions beyond the
        logged ones reuse the last logged (as the rank model's tables do)."""
        blocks = -(-self.depths // self.block_size)
        return min(block, blocks - 1) * self.block_size + min(pos, self.block_size - 1)

    def draw(self, rng: np.random.Generator, key: int, reach: np.ndarray) -> np.ndarray:
        """Row indices, one per position, drawn among the rows of ``key`` with the same reachability."""
        reach = np.asarray(reach, bool)
        idx = np.empty(reach.size, np.int64)
        for r in (True, False):
            at = np.nonzero(reach == r)[0]
            if at.size:
                g = self.rows(key, r)
                idx[at] = g[rng.integers(0, g.size, at.size)]
        return idx

    def sample(self, rng: np.random.Generator, key: int, reach: np.ndarray, n_cand: int,
               beyond: int) -> tuple[np.ndarray, np.ndarray]:
        """Ranks and candidate log-probs ``[len(reach), n_cand]`` for positions at depth ``key``;
        a rank at or beyond ``n_cand`` (or absent from the log) comes back as ``beyond``."""
        return self.take(self.draw(rng, key, reach), n_cand, beyond)

    def take(self, idx: np.ndarray, n_cand: int, beyond: int) -> tuple[np.ndarray, np.ndarray]:
        """Ranks and candidate log-probs of rows ``idx`` (see :meth:`sample`)."""
        k = self.logp.shape[1]
        logp = self.logp[idx, :n_cand] if n_cand <= k else np.concatenate(
            [self.logp[idx], np.full((idx.size, n_cand - k), MISSING_LOGP)], axis=1)
        rank = self.rank[idx]
        return np.where((rank < 0) | (rank >= min(n_cand, k)), beyond, rank), logp

    def summary(self) -> dict:
        """Per key, reachable rows: how many, mean top-1 probability, and top-1 accuracy."""
        out = {"rows": int(self.key.size), "by_depth": []}
        for d in range(self.depths):
            g = self._groups[d, True]
            out["by_depth"].append({"depth": d, "reachable_rows": int(g.size),
                                    "mean_top1_prob": round(float(np.exp(self.logp[g, 0]).mean()), 4)
                                    if g.size else None,
                                    "top1_acc": round(float((self.rank[g] == 0).mean()), 4) if g.size else None})
        return out
