"""Longest accepted path: the one acceptance rule that the runtime and the simulator share.

The runtime decides which nodes are "correct" from the target's logits (greedy verification);
the simulator samples it from an acceptance model. Both then call :func:`accept_longest`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specblock.policies.tree import DraftTree


@dataclass(frozen=True)
class Acceptance:
    path: np.ndarray  # node indices from the root to the last accepted node (root included)

    @property
    def accepted(self) -> int:
        """Number of accepted *draft* tokens (the root is not a draft)."""
        return int(self.path.shape[0]) - 1

    @property
    def last(self) -> int:
        return int(self.path[-1])


def reachable(tree: DraftTree, correct: np.ndarray) -> np.ndarray:
    """Nodes whose whole root-to-node chain is correct (root counted correct).

    Vectorised over the ancestor mask: a node is reachable iff no ancestor (itself included) is
    incorrect.
    """
    correct = np.asarray(correct, dtype=bool).copy()
    correct[0] = True
    return ~(tree.ancestor_mask & ~correct[None, :]).any(axis=1)


def accept_longest(tree: DraftTree, correct: np.ndarray) -> Acceptance:
    """The longest root-to-node chain of correct nodes.

    Ties between equally deep chains (possible only when siblings repeat a token) go to the
    lowest node index, i.e. the candidate the drafter ranked first.
    """
    ok = reachable(tree, correct)
    depth = np.where(ok, tree.depth, -1)
    best = int(np.argmax(depth))  # argmax returns the first maximum: lowest index
    return Acceptance(path=tree.path_to(best))
