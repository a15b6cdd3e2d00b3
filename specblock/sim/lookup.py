"""Prompt lookup (n-gram) drafting in the sim: a replay of runtime traces.

Prompt lookup has no drafter network and no rank structure: a tree is the continuation(s) that
followed the last n-gram's earlier occurrence in the context, and whether it is accepted depends
on how repetitive the text is, not on a rank pmf. So instead of a synthetic acceptance model the
sim replays measured iterations: each simulated iteration draws one record of the domain's
runtime traces and takes its tree (parents) and per-node
correctness as they were, and its ``draft_s`` as the host time of the n-gram search. The target
forward and the glue are priced by the sim's latency model like every other method, so the
method meets the same verify cost curve; there is no drafter forward to price.

Records are drawn in shuffled rounds (every record once per round, a fresh permutation each
round) rather than independently: the simulated means then track the traces' means closely
after a few rounds instead of carrying bootstrap noise, and the engine's tree pool is bypassed
(``pooled = False``: a pool would be a second, noisier bootstrap of the same records).

What this can and cannot answer: tau and the tree-size distribution are the traces' own, so the
sim reproduces a domain's mean accepted length by construction; a what-if on
``lookup_depth`` can only shorten the replayed proposals (truncate at that depth), never lengthen
them; iterations are treated as independent (the runtime's are not: a long match tends to
continue), which changes per-request variance, not the means Spd and tau are made of.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specblock.policies.acceptance import accept_longest
from specblock.policies.tree import DraftTree
from specblock.sim.methods import Drafted, MethodModel
from specblock.sim.traces import read_traces


@dataclass
class TraceReplay:
    """Measured iterations of one domain: tree parents, per-node correctness, draft ms."""

    parents: list[np.ndarray]
    correct: list[np.ndarray]
    draft_ms: np.ndarray

    @classmethod
    def from_traces(cls, paths, domain: str | None = None) -> "TraceReplay":
        recs = read_traces(paths, domain)
        return cls(parents=[np.asarray(r.nodes.parent, dtype=np.int64) for r in recs],
                   correct=[np.asarray(r.nodes.correct, dtype=bool) for r in recs],
                   draft_ms=np.array([1e3 * r.draft_s for r in recs]))

    def __len__(self) -> int:
        return len(self.parents)

    def lift(self, f: float) -> "TraceReplay":
        """The engine's adaptation hook: a replay has no drafter to adapt."""
        if f:
            raise ValueError("lookup replays traces: there is no drafter to adapt (adapt.enabled must be false)")
        return self

    def mean_accepted(self) -> float:
        """Mean accepted draft tokens per iteration in the traces (tau - 1)."""
        return float(np.mean([_accepted(p, c) for p, c in zip(self.parents, self.correct)]))


def _accepted(parent: np.ndarray, correct: np.ndarray) -> int:
    tree = DraftTree.from_parents(np.zeros(parent.size, dtype=np.int64), parent)
    return accept_longest(tree, correct).accepted


@dataclass
class LookupReplay(MethodModel):
    """``lookup``: one replayed iteration per draft (see module doc). ``max_depth`` truncates the
    replayed trees; ``search_ms`` replaces each record's measured ``draft_s`` by a fixed cost."""

    max_depth: int | None = None
    search_ms: float | None = None
    name: str = "lookup"
    drafter: str | None = None
    pooled: bool = False  # the engine draws from the replay directly, not from a tree pool

    def __post_init__(self) -> None:
        self._order: dict[int, list[int]] = {}  # per replay: record indices left in this round
        self._built: dict[tuple[int, int], Drafted] = {}

    def draft(self, rng: np.random.Generator, replay: TraceReplay) -> Drafted:
        if not isinstance(replay, TraceReplay):
            raise TypeError("lookup needs acceptance.kind=traces (a replay of runtime lookup traces)")
        left = self._order.setdefault(id(replay), [])
        if not left:
            left.extend(rng.permutation(len(replay)).tolist())
        i = left.pop()
        key = (id(replay), i)
        if key not in self._built:
            self._built[key] = self._build(replay, i)
        return self._built[key]

    def _build(self, replay: TraceReplay, i: int) -> Drafted:
        parent, correct = replay.parents[i], replay.correct[i]
        tree = DraftTree.from_parents(np.arange(parent.size, dtype=np.int64), parent)
        if self.max_depth is not None and tree.max_depth > self.max_depth:
            tree, kept = tree.subtree(tree.depth <= self.max_depth)
            correct = correct[kept]
        host = float(replay.draft_ms[i]) if self.search_ms is None else self.search_ms
        return Drafted(tree, correct, accept_longest(tree, correct), [], host_ms=host)
