"""The SpS draft model on static shapes (issue 16, item 2): the small causal LM behind the same
``StaticTarget`` as the target (a preallocated cache, forwards padded to a bucket, one compiled
graph per bucket and span, saved for later starts), so each of SpS's sequential draft forwards is
one graph call instead of a few hundred dispatched ops.

Chains only (``top_k = 1``, SpS's classic form and what ships): each drafted token is committed
into the draft model's static cache as it is drafted, so the next one sees it, and the proposal
ends by moving the cache's end back to the committed tokens (the drafted slots are stale and
masked from then on). The tree form (``top_k > 1``) needs each node to see only its own drafted
ancestors, which a committed cache cannot express; it stays eager (``compile_drafter`` leaves it).
"""

from __future__ import annotations

import numpy as np
import torch

from specblock.compiled.target import StaticTarget
from specblock.policies.tree import DraftTree
from specblock.runtime.drafters.sps import SpsDrafter

#: Buckets of the draft model's forwards: one token while drafting, the accepted path plus the
#: new root when feeding (larger feeds pad to a multiple of the last bucket).
BUCKETS = (1, 2, 4, 8)


class StaticSpsDrafter(SpsDrafter):
    """An ``SpsDrafter`` (chain) whose draft model runs on a ``StaticTarget``: compiled
    (``compile=True``) or the same padded steps eagerly (the tests' check)."""

    def __init__(self, drafter: SpsDrafter, compile: bool = True) -> None:
        if drafter.top_k != 1:
            raise ValueError(f"the static SpS step drafts chains (top_k 1), not trees (top_k {drafter.top_k})")
        super().__init__(drafter.model, drafter.gamma, 1, drafter.policy, drafter.seed_policy)
        self.static = StaticTarget(drafter.model, compile=compile, buckets=BUCKETS)
        self.compiled = compile

    def reset(self) -> None:
        super().reset()
        if getattr(self, "static", None) is not None:
            self.static.reset()

    def warm(self) -> list[int]:
        """Compile (or load) the draft model's buckets a proposal can meet (a feed of up to gamma + 1
        tokens, single drafted tokens) before a server listens. Returns the buckets warmed."""
        return self.static.warm(self.gamma + 1)

    def _feed(self, tokens: np.ndarray) -> torch.Tensor:
        new = np.asarray(tokens[self.n_cached :], dtype=np.int64)
        st = self.static
        if self.n_cached == 0:  # the prompt: one uncompiled forward of any length
            return st.prefill(new).logits[-1:]
        out = st.tree_forward(DraftTree.from_parents(new, np.arange(-1, new.size - 1)))
        st.commit(np.arange(new.size))
        return out.logits[-1:]

    def _draft_forward(self, tree: DraftTree, frontier: np.ndarray, expanded: np.ndarray, pos: int) -> torch.Tensor:
        if frontier.size != 1 or self.static.past_len != pos:  # a chain: one node a depth, right after the last
            raise RuntimeError(f"the static SpS step drafts one chain node at a time (got {frontier.size} at {pos})")
        out = self.static.tree_forward(DraftTree.root_only(int(tree.tokens[frontier[0]])))
        self.static.commit(np.zeros(1, dtype=np.int64))
        return out.logits

    def _crop(self, n: int) -> None:
        self.static.past_len = n  # drafted slots past the committed tokens are stale, masked from now on
