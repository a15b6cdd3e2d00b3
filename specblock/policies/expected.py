"""Widths chosen for a block's expected accepted drafts (our policy; the paper sets widths per position).

Why: the paper's rank widths decide each position alone, from its argmax bucket, and the budget is
spent in depth order. At the node budgets a CPU target affords (3 nodes for the real model's
SpecBlock drafter) that is a poor use of them: when the first position is a likely b0 a chain of
three pays more than two siblings and a grandchild, and when it is likely b3 one node there is
still worth more than none. This policy values every candidate node by the chance that the target
accepts it, and keeps the most valuable ones the budget allows.

The estimate for candidate c at in-block position d, given that the spine above d was accepted:
with a rank head, b0's probability for the top-1 candidate, b1's spread over candidates 2-4 and
b2's over 5-10 in proportion to their draft probabilities (our choice: the rank head says how
likely each band is, the draft distribution how it splits inside a band); without one, the draft
probability itself. A node's value is that estimate times the chance its spine is reached (the
top-1 estimates above it, times the seed's own draft probability). Values are made
non-increasing from a node to its descendants and its lower-ranked siblings, so the best
``budget`` nodes are a valid tree (ancestors first on ties).

Measured on held-out windows of the real model (``experiments/expected_widths_offline.py``; stop 60 in
``docs/real_model.md``): at a budget of 3 block-1 nodes, 1.20 accepted drafts per block against 1.04
for the rank widths (2, 4, 10, 0) and 1.12 for a chain.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specblock.policies.branching import TreePolicy
from specblock.policies.tree import BUCKET_UPPER, NUM_BUCKETS


def candidate_probs(cand_logprob: np.ndarray, bucket_prob: np.ndarray | None) -> np.ndarray:
    """``[..., k]`` estimated chance that the target's token is each candidate (see the module)."""
    p = np.exp(cand_logprob.astype(np.float64))
    if bucket_prob is None:
        return p
    k = p.shape[-1]
    bp = np.asarray(bucket_prob, dtype=np.float64)
    out = np.zeros_like(p)
    lo = 0
    for b, hi in enumerate(BUCKET_UPPER[: NUM_BUCKETS - 1]):  # bands of 0-based ranks [lo, hi)
        top = min(hi, k)
        if lo < top:
            band = p[..., lo:top]
            out[..., lo:top] = bp[..., b : b + 1] * band / np.maximum(band.sum(-1, keepdims=True), 1e-30)
        lo = hi
    return out


def falling(p: np.ndarray) -> np.ndarray:
    """The non-increasing sequence nearest to ``p`` along its last axis (least squares, equal
    weights: pool adjacent violators), by the min-max formula over run means. A run of candidates
    worth little alone but much together (a rank head sure of b1 and not of b0) keeps its sum."""
    k = p.shape[-1]
    c = np.concatenate([np.zeros(p.shape[:-1] + (1,)), np.cumsum(p, axis=-1)], axis=-1)
    r = np.arange(k)
    j, e = r[:, None], r[None, :]
    mean = (c[..., None, 1:] - c[..., :-1, None]) / np.maximum(e - j + 1, 1)  # [..., j, e]: mean of p[j..e]
    # f(i) = min over j <= i of max over e >= i of mean(j..e)
    reach = (e[None] >= r[:, None, None]) & (j[None] <= e[None])  # [i, j, e]
    inner = np.where(reach, mean[..., None, :, :], -np.inf).max(axis=-1)  # [..., i, j]
    return np.where(r[None, :] <= r[:, None], inner, np.inf).min(axis=-1)


@dataclass
class ExpectedAcceptanceBranching(TreePolicy):
    """Keep the candidate nodes of highest expected acceptance, up to the budget.

    ``min_value``: a node whose value is below it is not drafted even when the budget has room
    (0: fill the budget). ``max_width``: candidates considered per position.
    """

    min_value: float = 0.0
    max_width: int = 10
    name = "expected"

    def __post_init__(self) -> None:
        if self.max_width < 1 or not 0.0 <= self.min_value <= 1.0:
            raise ValueError("ExpectedAcceptanceBranching needs max_width >= 1 and 0 <= min_value <= 1")

    def raw_widths(self, parent_score, cand_logprob, bucket):
        """Per-position use (drafters that grow a depth at a time): the candidates worth
        ``min_value``; the base class then fits them to the budget by cumulative log-prob."""
        v = np.exp(np.asarray(parent_score, dtype=np.float64))[:, None] * np.exp(cand_logprob[:, : self.max_width])
        return (np.minimum.accumulate(v, axis=1) >= self.min_value).sum(axis=1)

    def node_values(self, parent_score, cand_logprob, seed_ok, bucket_prob=None) -> np.ndarray:
        """``[S, K, k']`` each candidate node's value (see the module), ``k' = min(k, max_width)``."""
        s, kd, k = cand_logprob.shape
        k = min(k, self.max_width)
        p = candidate_probs(cand_logprob[..., :k], bucket_prob)
        reach = np.ones((s, kd))
        if kd > 1:
            reach[:, 1:] = np.cumprod(p[:, :-1, 0], axis=1)
        reach *= np.where(seed_ok, np.exp(np.asarray(parent_score[:, 0], dtype=np.float64)), 0.0)[:, None]
        # Candidates of a position are kept as a prefix: pooled so that worth falls with rank, each
        # pooled run worth what its nodes are together. No node then outranks an ancestor (the top-1
        # above it is worth its reach at least), so the best ``budget`` nodes form a tree.
        return reach[..., None] * falling(p)

    def block_widths(self, parent_score, cand_logprob, bucket, budget_left, seed_ok, bucket_prob=None):
        return self.best_nodes(self.node_values(parent_score, cand_logprob, seed_ok, bucket_prob), budget_left)

    def best_nodes(self, v: np.ndarray, budget_left: int) -> tuple[np.ndarray, np.ndarray]:
        """Widths ``[S, K]`` (and no cuts) keeping the ``budget_left`` most valuable of nodes ``v``."""
        s, kd, k = v.shape
        flat = v.reshape(-1)
        order = np.argsort(-flat, kind="stable")[: max(int(budget_left), 0)]  # ties: (seed, depth, rank) order
        order = order[flat[order] >= max(self.min_value, np.finfo(np.float64).tiny)]
        chosen = np.zeros(flat.size, dtype=bool)
        chosen[order] = True
        # A prefix per position, and (values falling down the spine, ties to the shallower node) a
        # kept node's spine is kept too: grow_block's own check finds nothing to drop.
        w = np.cumprod(chosen.reshape(s, kd, k), axis=2).sum(axis=2).astype(np.int64)
        return w, np.zeros((s, kd), dtype=bool)
