"""Seed policies: which nodes of the tree so far start the next drafting step.

For SpecBlock these are the roots of the next block; for EAGLE-2-style drafters they are the
frontier that the next depth expands. Subclass :class:`SeedPolicy` and override :meth:`select`.
Torch-free: the simulator uses the same classes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specblock.policies.tree import DraftTree


class SeedPolicy:
    name = "base"

    def select(self, tree: DraftTree, candidates: np.ndarray, max_seeds: int) -> np.ndarray:
        """Return at most ``max_seeds`` node ids out of ``candidates`` (any order)."""
        raise NotImplementedError


@dataclass
class TopScoreSeeds(SeedPolicy):
    """The ``max_seeds`` candidates with the highest cumulative draft log-prob (EAGLE-2 frontier)."""

    name = "top-score"

    def select(self, tree, candidates, max_seeds):
        candidates = np.asarray(candidates, dtype=np.int64)
        if candidates.size == 0 or max_seeds <= 0:
            return candidates[:0]
        score = tree.cum_logprob[candidates]
        order = np.argsort(-score, kind="stable")[:max_seeds]
        return candidates[order]


@dataclass
class DeepestConfidentSeeds(SeedPolicy):
    """Deepest first, then most confident: nodes whose cumulative draft probability is at least
    ``min_prob``, ordered by depth (deeper first) then cumulative log-prob.

    Why deepest first: a seed deep in the tree extends the longest candidate path, which is what
    raises tau; ``min_prob`` keeps the next block from growing under nodes the drafter itself
    doubts. This is our rule; the paper says only "high-quality nodes".
    """

    min_prob: float = 0.0
    name = "deepest-confident"

    def select(self, tree, candidates, max_seeds):
        candidates = np.asarray(candidates, dtype=np.int64)
        if candidates.size == 0 or max_seeds <= 0:
            return candidates[:0]
        score = tree.cum_logprob[candidates]
        ok = score >= np.log(max(self.min_prob, 1e-30))
        candidates, score = candidates[ok], score[ok]
        order = np.lexsort((-score, -tree.depth[candidates]))[:max_seeds]
        return candidates[order]
