"""Random trees for tests: any drafter, however wrong, must leave the output unchanged."""

from __future__ import annotations

import numpy as np

from specblock.policies.tree import DraftTree
from specblock.runtime.drafters.base import DraftRequest, Drafter


class RandomDrafter(Drafter):
    """Trees of ``budget`` nodes with uniform random parents and tokens from ``vocab``.

    With a tiny vocabulary many random tokens match, so long accepted paths do occur.
    """

    name = "random"

    def __init__(self, vocab_size: int, seed: int = 0, budget: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.budget = budget
        self.seed = seed
        self.rng = np.random.default_rng(seed)

    def reset(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    def propose(self, req: DraftRequest) -> DraftTree:
        n = 1 + int(self.rng.integers(0, (self.budget or req.budget) + 1))
        parent = np.concatenate([[-1], (self.rng.random(n - 1) * np.arange(1, n)).astype(np.int64)])
        tokens = self.rng.integers(0, self.vocab_size, n)
        tokens[0] = req.tokens[-1]
        tree = DraftTree.from_parents(tokens, parent, rank=np.zeros(n, dtype=np.int64))
        if tree.max_depth > req.max_depth:
            tree = tree.subtree(tree.depth <= req.max_depth)[0]
        return tree
