"""The drafter interface: propose a tree, then learn what was accepted.

As HF's ``CandidateGenerator`` does, proposing and learning are separate calls, so the engine
can time them apart and a drafter can keep its own cache in step with the target's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specblock.policies.tree import DraftTree
from specblock.runtime.target import TargetOutput
from specblock.runtime.verify import Verdict


@dataclass
class DraftRequest:
    """What a drafter may read when it proposes."""

    tokens: np.ndarray  # every committed token; the last one is the tree's root
    budget: int  # at most this many draft nodes (root excluded)
    max_depth: int  # deepest allowed node (the context limit); 0 means root only


class Drafter:
    """Base class. ``needs_features`` asks the target for hidden-state taps on every forward."""

    name = "base"
    needs_features = False

    def reset(self) -> None:
        """Forget everything about the previous prompt."""

    def prefill(self, prompt: np.ndarray, features: TargetOutput | None) -> None:
        """Called once per prompt after the target processed ``prompt[:-1]``."""

    def propose(self, req: DraftRequest) -> DraftTree:
        raise NotImplementedError

    def accept(self, tree: DraftTree, verdict: Verdict, features: TargetOutput | None) -> None:
        """Told which nodes were accepted, with the target's outputs at exactly those nodes."""

    def max_tree(self, budget: int) -> int:
        """The most nodes, root included, a proposal can hold under ``budget``: the tree sizes a
        compiled target compiles before it serves (``Engine.warm_compiled``)."""
        return budget + 1

    def tree_sizes(self, budget: int) -> tuple[int, ...]:
        """The tree sizes (root included) worth a compiled graph of their own before a server
        listens: every size up to ``max_tree`` here. A drafter whose trees take one shape away from
        the context's end names that size alone; a tree of another size then pads up to the next
        size warmed (``StaticTarget.warm``): a few padded rows now and then, no compile mid-request,
        and fewer graphs to compile on a first start (EAGLE-3 at q4: 1 instead of 3)."""
        return tuple(range(1, self.max_tree(budget) + 1))


class ARDrafter(Drafter):
    """No draft at all: every iteration is one target forward of one token (the baseline)."""

    name = "ar"

    def propose(self, req: DraftRequest) -> DraftTree:
        return DraftTree.root_only(int(req.tokens[-1]))

    def max_tree(self, budget: int) -> int:
        return 1  # a server of plain decoding compiles one graph, not every bucket of the budget
