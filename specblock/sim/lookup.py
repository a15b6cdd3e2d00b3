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
from specblock.policies.branching import drafter_budget
from specblock.policies.tree import DraftTree
from specblock.sim.methods import Autoregressive, Drafted, MethodModel
from specblock.sim.traces import TraceRecord, read_traces


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


# --------------------------------------------------------------------------- METHOD+lookup
# The runtime's lookup branch (``runtime/drafters/lookup_branch.py``) grafts prompt lookup's chain
# onto a drafter's tree. In the sim the drafter's tree stays synthetic and the chain is replayed:
# where a chain is right does not depend on the drafter but on the text (lookup reads only the
# context, and every method emits the same text), so a trace gives it exactly as it was.
#
# Traces: a ``METHOD+lookup`` run logs the branch's nodes with rank -1 below the root (a drafter
# node always has its candidate rank: checked on every real-model trace of this repo), and a
# ``lookup`` run logs nothing else. The chain of a record is the path to its deepest such node.
#
# Combining, per iteration: the chain's first ``correct`` tokens are the target's own, so they
# follow the drafter's accepted path as far as that goes (``graft`` follows matching children),
# and its other tokens are new nodes; a wrong lookup token that happens to equal a wrong drafter
# token is not modelled (it would share a node). Accepted = the longer of the two. Iterations are
# independent draws, like the replay above; on this repo's real-model traces of
# ``specblock+lookup`` and ``eagle3+lookup`` the accepted length computed this way from each
# record's two parts equals the logged one, and pairing the parts independently moved a file's
# mean tau by at most 2.4% (``experiments/lookup_branch_split.py``).


def lookup_nodes(rec: TraceRecord) -> np.ndarray:
    """The nodes of ``rec`` that prompt lookup drafted (rank -1 below the root)."""
    m = np.asarray(rec.nodes.rank) == -1
    m[0] = False
    return m


def chain_of(rec: TraceRecord) -> tuple[int, int]:
    """(length, correct prefix) of the lookup chain in ``rec``: the path to its deepest lookup node
    (shared drafter nodes included), and how many of its first tokens were right; (0, 0) when
    lookup found no match (or its whole chain fell on drafter nodes, invisible in a trace)."""
    lk = np.flatnonzero(lookup_nodes(rec))
    if lk.size == 0:
        return 0, 0
    depth, parent, correct = (np.asarray(x) for x in (rec.nodes.depth, rec.nodes.parent, rec.nodes.correct))
    node = int(lk[np.argmax(depth[lk])])
    path = []
    while node > 0:
        path.append(node)
        node = int(parent[node])
    ok = correct[path[::-1]].astype(bool)
    return len(path), int(ok.size if ok.all() else np.argmin(ok))


def drafter_part(rec: TraceRecord) -> TraceRecord:
    """``rec`` without its lookup nodes: what the drafter alone proposed, for fitting its
    acceptance model (a lookup node read as a drafter's candidate would be a rank-less guess)."""
    drop = lookup_nodes(rec)
    if not drop.any():
        return rec
    keep = np.flatnonzero(~drop)
    remap = np.full(drop.size, -1, dtype=np.int64)
    remap[keep] = np.arange(keep.size)
    nd = rec.nodes
    cols = {k: np.asarray(getattr(nd, k))[keep] for k in ("parent", "depth", "rank", "bucket", "block", "correct")}
    cols["parent"] = np.where(cols["parent"] >= 0, remap[np.maximum(cols["parent"], 0)], -1)
    tree = DraftTree.from_parents(np.zeros(keep.size, dtype=np.int64), cols["parent"])
    update = {"nodes": nd.model_copy(update={k: v.tolist() for k, v in cols.items()}), "tree_size": int(keep.size),
              "depth": int(cols["depth"].max()), "accepted": accept_longest(tree, cols["correct"].astype(bool)).accepted}
    if rec.cuts is not None:
        update["cuts"] = rec.cuts.model_copy(update={"parent": remap[np.asarray(rec.cuts.parent, dtype=np.int64)].tolist()})
    if rec.positions is not None:
        update["positions"] = rec.positions.model_copy(
            update={"node": remap[np.asarray(rec.positions.node, dtype=np.int64)].tolist()})
    return rec.model_copy(update=update)


@dataclass
class Chains:
    """Lookup chains of one domain's traces: length and correct prefix per record."""

    size: np.ndarray
    correct: np.ndarray

    @classmethod
    def from_records(cls, recs: list[TraceRecord]) -> "Chains":
        pairs = np.array([chain_of(r) for r in recs], dtype=np.int64).reshape(-1, 2)
        return cls(size=pairs[:, 0], correct=pairs[:, 1])

    @classmethod
    def from_traces(cls, paths) -> "Chains":
        return cls.from_records(read_traces(paths))


@dataclass
class BranchSource:
    """What a ``METHOD+lookup`` iteration draws from: the drafter's rank model and the chains."""

    rm: object  # RankModel
    chains: Chains

    def lift(self, f: float) -> "BranchSource":
        """Adaptation moves the drafter; the chains are the text's."""
        return BranchSource(self.rm.lift(f), self.chains)


def graft_chain(d: Drafted, size: int, correct: int, host_ms: float = 0.0) -> Drafted:
    """``d`` with a lookup chain of ``size`` tokens, the first ``correct`` of them right (see above)."""
    shared = min(correct, d.acceptance.accepted)
    new = size - shared
    if new <= 0:
        return Drafted(d.tree, d.correct, d.acceptance, d.forwards, d.cuts, d.host_ms + host_ms)
    tree, _ = d.tree.subtree(np.ones(d.tree.size, dtype=bool))  # a copy: a drafted tree may be pooled
    below = int(d.acceptance.path[shared])
    parents = np.concatenate([[below], tree.size + np.arange(new - 1)])
    tree.extend(parents=parents, tokens=np.full(new, -1), block=0)  # rank -1: a lookup node, as the runtime logs it
    ok = np.concatenate([d.correct, np.arange(shared, size) < correct])
    return Drafted(tree, ok, accept_longest(tree, ok), d.forwards, d.cuts, d.host_ms + host_ms)


#: Drafters whose propose runs its first forward whatever the budget (``_drafted``): SpecBlock's
#: block 1, EAGLE-3's flush, SpS's feed of the new tokens (Medusa's heads read the target's features)
FIRST_FORWARD_ALWAYS = frozenset({"specblock", "eagle3", "sps"})


@dataclass
class LookupBranchModel(MethodModel):
    """``METHOD+lookup``: the inner drafter's tree with a replayed lookup chain grafted on.

    ``budget`` is the whole tree's, as the runtime shares it: the chain (at most ``nodes``) takes
    what it needs and the drafter is built for the rest (``inner(budget)``, one model per budget);
    ``inner_budget`` (the runtime's ``lookup_on_top``) caps the drafter at its own budget whatever
    the chain leaves.
    A chain longer than ``nodes`` in the traces is cut to ``nodes``; a shorter ``nodes`` than the
    traced runs can be asked, a longer one cannot (the traces never saw those tokens)."""

    inner: object  # Callable[[int], MethodModel]: the drafter's model at a node budget
    nodes: int
    budget: int
    search_ms: float = 0.0
    inner_budget: int | None = None
    name: str = "lookup-branch"
    drafter: str | None = None

    def __post_init__(self) -> None:
        self._inner: dict[int, MethodModel] = {}
        self.drafter = self._at(self.budget).drafter
        self.name = f"{self._at(self.budget).name}+lookup"

    def _at(self, budget: int) -> MethodModel:
        if budget not in self._inner:
            self._inner[budget] = self.inner(budget) if budget > 0 else Autoregressive()
        return self._inner[budget]

    def _drafted(self, rng: np.random.Generator, rm, budget: int) -> Drafted:
        """The drafter's tree at ``budget``. At 0 (lookup's chain took every node) it drafts nothing,
        but SpecBlock, EAGLE-3 and SpS still run their first forward, which takes in the tokens just
        committed. Measured for SpecBlock at budget 3 with lookup's 3-token chains, compiled: a median
        of 2.54-2.75 ms of drafting per domain where the chain left it no node, 2.45-2.72 where it
        drafted (``experiments/results/lookup_branch_split_compiled_budgets.md``). Without this the
        sim priced those iterations' drafting at nothing and ranked budget 3 first, where the bench
        measured it last of 3 / 5 / 6."""
        if budget > 0 or self.drafter not in FIRST_FORWARD_ALWAYS:
            return self._at(budget).draft(rng, rm)
        first = self._at(1).draft(rng, rm).forwards[:1]
        root = self._at(0).draft(rng, rm)
        return Drafted(root.tree, root.correct, root.acceptance, first)

    def draft(self, rng: np.random.Generator, src: BranchSource) -> Drafted:
        if not isinstance(src, BranchSource):
            raise TypeError("METHOD+lookup needs acceptance.kind=traces (its lookup chains are replayed)")
        i = int(rng.integers(src.chains.size.size))
        size = int(min(src.chains.size[i], self.nodes, self.budget))
        correct = int(min(src.chains.correct[i], size))
        d = self._drafted(rng, src.rm, drafter_budget(self.budget, size, self.inner_budget))
        return graft_chain(d, size, correct, self.search_ms)  # the search runs whether it matches or not
