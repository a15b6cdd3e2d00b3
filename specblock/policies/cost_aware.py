"""A tree as large as its expected acceptance pays for on this target (our policy; the paper fixes the budget).

Why: on a CPU without matrix tiles each verified row costs the target something, and unevenly:
the real model's packed-q4 kernel on a Zen 5 runs 1.16 / 1.28 / 1.33 / 1.46 T(1) at 2 / 3 / 4 / 5
rows (``latency_smollm2_zen5_dot_s71.json``). A fixed budget verifies 4 rows on a step where the
drafter is unsure of its first token as on one where it is sure of four. Here the drafter's block
is valued as in :class:`ExpectedAcceptanceBranching` (each node's chance of acceptance), and the
step keeps the ``n`` best nodes, ``n`` up to the budget, that maximise

    scale * (expected accepted drafts of the n nodes) - rate * row_cost[n]

``row_cost[n]``: the target's time to verify ``n + 1`` rows (root and ``n`` nodes) over its time for
one. ``rate``: the tokens per T(1) the method makes anyway; a node must earn ``rate`` times the
time it adds (maximising tokens minus ``rate`` times time is what maximises tokens per time when
``rate`` is the method's own; Dinkelbach). 1.0, plain decoding's, is the cautious choice.
``scale``: the served acceptance over the estimate (the rank head's estimates come from held-out
windows, the bench's prompts are other text).

The drafting is spent before the tree is sized, so its cost does not enter. Meant for one block
(``M = 1``): a block that stops short of the budget would let a second block run, whose forward
costs more than the rows it saves, and the rows of nodes another block or prompt lookup's branch
added are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from specblock.policies.expected import ExpectedAcceptanceBranching


@dataclass
class CostAwareBranching(ExpectedAcceptanceBranching):
    """Expected-acceptance widths, with as many nodes as pay for their rows (see the module)."""

    row_cost: list[float] = field(default_factory=list)
    rate: float = 1.0
    scale: float = 1.0
    name = "cost-aware"

    def __post_init__(self) -> None:
        super().__post_init__()
        c = np.asarray(self.row_cost, dtype=np.float64)
        if c.ndim != 1 or c.size < 2 or not np.all(np.isfinite(c)) or c[0] <= 0 or np.any(np.diff(c) < 0):
            raise ValueError("CostAwareBranching needs row_cost: T(n) / T(1) for n = 1, 2, ... rows, "
                             "at least two, positive and non-decreasing (from `specblock.runtime calibrate`)")
        if not (self.rate > 0 and self.scale > 0):
            raise ValueError("CostAwareBranching needs rate > 0 and scale > 0")
        self._cost = c

    def nodes_worth(self, values: np.ndarray, budget_left: int) -> int:
        """How many of the best nodes (``values``, any order) to keep under ``budget_left``."""
        n_max = min(max(int(budget_left), 0), self._cost.size - 1, values.size)
        best = np.sort(values.reshape(-1))[::-1][:n_max]
        gain = self.scale * np.concatenate([[0.0], np.cumsum(best)]) - self.rate * self._cost[: n_max + 1]
        return int(np.argmax(gain))  # ties: the smaller tree

    def block_widths(self, parent_score, cand_logprob, bucket, budget_left, seed_ok, bucket_prob=None):
        v = self.node_values(parent_score, cand_logprob, seed_ok, bucket_prob)
        return self.best_nodes(v, self.nodes_worth(v, budget_left))
