"""Prompt lookup's guess as one more branch of any drafter's tree (``METHOD+lookup``; our
addition, the paper drafts from the network alone).

Why: on the bench's own text, the drafters and prompt lookup are right at different positions.
Teacher-forced 3-token chains on the real model accept 0.588 drafts for SpecBlock, 0.784 for
EAGLE-3 and 0.571 for lookup. With lookup's chain beside them, counting the longer of the two,
they accept 1.046 and 1.164 (``python experiments/served_gap.py ... --lookup``,
``experiments/results/served_gap_lookup_smollm2.md``). One verification checks both guesses.

Where the budget is the drafter's measured one (``serving.json``), the drafter keeps it whatever
lookup finds and the chain (its most recent match, up to ``nodes`` tokens) comes on top: the tree
grows only where lookup has a guess, which costs nothing to propose. A budget the user gives is
the whole tree's and shared: the chain takes what it needs and the drafter gets the rest, so where
lookup finds nothing the drafter drafts all of it; ``on_top`` (``--lookup-on-top``) makes a given
budget the drafter's own too. Sharing was the rule for every budget until it was measured against
on top, which won in both dtypes: eager packed-fp16 1.37x against 1.29x for EAGLE-3 and 1.31x
against 1.28x for SpecBlock, compiled q4 2.29x against 2.07x for SpecBlock (docs/real_model.md,
"Cross-block training again, and prompt lookup's branch on top"; docs/compiled.md, "The lookup
branch on top"). Where the chain starts like one of the drafter's branches, it follows
that branch and adds only the tokens that differ. The drafters learn only
from the committed tokens and the target's features at them (``accept``), so a path the lookup
branch won teaches them as well as their own.
"""

from __future__ import annotations

import numpy as np

from specblock.policies.branching import drafter_budget
from specblock.policies.tree import DraftTree
from specblock.runtime.drafters.base import DraftRequest, Drafter
from specblock.runtime.drafters.datastore import Datastore
from specblock.runtime.drafters.lookup import first_match
from specblock.runtime.target import TargetOutput
from specblock.runtime.verify import Verdict

SUFFIX = "+lookup"
#: Lookup's share of the budget unless set (``--set METHOD+lookup:lookup_nodes=N``): the chain
#: length measured above.
DEFAULT_NODES = 3


def has_lookup(method: str) -> bool:
    """Whether a bench method name asks for the branch (``eagle3+lookup``, ``eagle3+lookup@b4``;
    after ``@`` comes a free label)."""
    return method.split("@")[0].endswith(SUFFIX)


def graft(tree: DraftTree, chain: np.ndarray) -> int:
    """Add ``chain`` (tokens below the root, in depth order) as a branch of ``tree``, in place:
    it follows the tree while a child carries its next token, and the rest goes below the last
    node it shares. Returns how many nodes were added (at most ``len(chain)``: a loop of that
    many steps, not one per tree node)."""
    node = 0
    for i, tok in enumerate(chain.tolist()):
        kids = tree.children(node)
        same = kids[tree.tokens[kids] == tok]
        if same.size == 0:
            rest = np.asarray(chain[i:], dtype=np.int64)
            parents = np.concatenate([[node], tree.size + np.arange(rest.size - 1)])
            tree.extend(parents=parents, tokens=rest)
            return int(rest.size)
        node = int(same[0])
    return 0


class LookupBranch(Drafter):
    """``inner``'s tree with prompt lookup's chain grafted on. Lossless like any drafter: only the
    tree changes, never the verification."""

    def __init__(self, inner: Drafter, nodes: int = DEFAULT_NODES, max_ngram: int = 3,
                 inner_budget: int | None = None, datastore: Datastore | None = None) -> None:
        if nodes < 1:
            raise ValueError(f"lookup_nodes must be at least 1 (got {nodes})")
        if inner_budget is not None and inner_budget < 0:
            raise ValueError(f"the drafter's own budget must be at least 0 (got {inner_budget})")
        self.inner, self.nodes, self.max_ngram = inner, nodes, max_ngram
        self.inner_budget = inner_budget  # None: shared (the drafter gets what the chain leaves)
        # where the prompt has no match, the chain comes from the target's own answers (datastore.py):
        # one chain either way, so the tree's sizes and the budget stay lookup's
        self.datastore = datastore
        self.name = f"{inner.name}{SUFFIX}"
        self.needs_features = inner.needs_features
        self.tap_layers = getattr(inner, "tap_layers", None)

    def reset(self) -> None:
        self.inner.reset()

    def prefill(self, prompt: np.ndarray, features: TargetOutput | None) -> None:
        self.inner.prefill(prompt, features)

    def propose(self, req: DraftRequest) -> DraftTree:
        room = min(self.nodes, req.budget, req.max_depth)
        guess = first_match(req.tokens, self.max_ngram, 1, room)
        if not guess.size and self.datastore is not None:
            guess = self.datastore.chain(req.tokens, room)
        tree = self.inner.propose(DraftRequest(req.tokens, drafter_budget(req.budget, guess.size, self.inner_budget),
                                               req.max_depth))
        if guess.size:
            graft(tree, guess.astype(np.int64))
        return tree

    def accept(self, tree: DraftTree, verdict: Verdict, features: TargetOutput | None) -> None:
        self.inner.accept(tree, verdict, features)

    def tree_sizes(self, budget: int) -> tuple[int, ...]:
        """A chain of ``g`` tokens leaves the drafter ``budget - g`` nodes and grafts 0 to ``g`` of
        its own: the drafter's sizes at each such budget, plus 0..g (SpecBlock's shipped settings
        with the branch: 4 to 7 nodes, three buckets instead of every one up to 8)."""
        sizes = set()
        for g in range(min(self.nodes, budget) + 1):
            for s in self.inner.tree_sizes(drafter_budget(budget, g, self.inner_budget)):
                sizes.update(range(s, s + g + 1))
        return tuple(sorted(x for x in sizes if x <= self.max_tree(budget)))


def with_branch(drafter: Drafter, budget: int, nodes: int, budget_given: bool,
                on_top: bool = False, datastore: Datastore | None = None) -> tuple[LookupBranch, int]:
    """``drafter`` with the branch, and the engine's node budget for it (the CLI's and the bench's
    one rule): the drafter's measured budget stays its own and the chain comes on top; a budget
    the user gave is the whole tree's, shared, unless ``on_top`` makes it the drafter's own too."""
    if on_top or not budget_given:
        return LookupBranch(drafter, nodes, inner_budget=budget, datastore=datastore), budget + nodes
    return LookupBranch(drafter, nodes, datastore=datastore), budget
