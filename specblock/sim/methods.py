"""Method models: each drafts one synthetic tree per iteration with the runtime's own policy objects.

Candidates are synthetic (token ids are candidate ranks; only structure and log-probs matter); the
acceptance model (``acceptance.RankModel``) draws, for every expanded position, the rank of the
target's token, and a child is correct iff its candidate rank equals it. Trees are built with the
shared ``specblock.policies`` functions (``add_candidates``, ``grow_block``, ``TreePolicy.widths``,
``TreePolicy.prune``, ``SeedPolicy.select``), exactly the calls the runtime makes, and accepted with
the shared ``accept_longest``.

Drafting cost is reported as the list of drafter forwards with their query positions (and, for
drafters without a network, host milliseconds); the engine prices forwards with the latency model.
Prompt lookup has no synthetic model: it replays runtime traces (``lookup.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from specblock.policies.acceptance import Acceptance, accept_longest
from specblock.policies.branching import (
    ChainBranching,
    DynamicBranching,
    TreePolicy,
    add_candidates,
    grow_block,
    rerank_limits,
)
from specblock.policies.seeds import DeepestConfidentSeeds, SeedPolicy, TopScoreSeeds
from specblock.policies.static_tree import static_tree
from specblock.policies.tree import DraftTree
from specblock.sim.acceptance import R, RankModel


@dataclass
class Drafted:
    """One iteration's draft: the tree, per-node correctness, its acceptance, drafter forwards."""

    tree: DraftTree
    correct: np.ndarray
    acceptance: Acceptance
    forwards: list[int]  # query positions of each drafter forward, in order
    cuts: list[tuple[int, int, int]] | None = None  # (parent, predicted bucket, block) given width 0
    host_ms: float = 0.0  # drafting work outside any drafter forward (lookup's n-gram search)


class _RankBook:
    """Target rank per expanded parent node (the tree's future correctness), grown with the tree."""

    def __init__(self) -> None:
        self.rank = np.full(64, -1, dtype=np.int64)

    def set(self, parents: np.ndarray, ranks: np.ndarray) -> None:
        top = int(parents.max(initial=-1)) + 1
        if top > self.rank.size:
            self.rank = np.concatenate([self.rank, np.full(max(top, 2 * self.rank.size), -1)])
        self.rank[parents] = ranks

    def correct(self, tree: DraftTree) -> np.ndarray:
        if tree.size > self.rank.size:
            self.rank = np.concatenate([self.rank, np.full(tree.size, -1)])
        c = np.ones(tree.size, dtype=bool)
        c[1:] = tree.rank[1:] == self.rank[tree.parent[1:]]
        return c

    def reachable(self, tree: DraftTree) -> np.ndarray:
        """Nodes whose whole root path is correct (the target would walk through them)."""
        reach = self.correct(tree)
        for d in range(1, tree.max_depth + 1):  # parents come before children: one pass per depth
            at = np.nonzero(tree.depth == d)[0]
            reach[at] &= reach[tree.parent[at]]
        return reach


def _finish(tree: DraftTree, book: _RankBook, forwards: list[int], policy: TreePolicy | None,
            budget: int | None) -> Drafted:
    correct = book.correct(tree)
    if policy is not None and budget is not None and tree.size - 1 > budget:
        tree.tokens = np.arange(tree.size, dtype=np.int64)  # synthetic ids: remember old indices
        tree = policy.prune(tree, budget)
        correct = correct[tree.tokens]
    return Drafted(tree, correct, accept_longest(tree, correct), forwards)


class MethodModel:
    """Base: ``drafter`` names the latency model's drafter; :meth:`draft` builds one tree."""

    name = "base"
    drafter: str | None = None

    def draft(self, rng: np.random.Generator, rm: RankModel) -> Drafted:
        raise NotImplementedError


@dataclass
class Autoregressive(MethodModel):
    """Plain decoding: the tree is its root; one target forward per token."""

    name = "ar"

    def draft(self, rng, rm):
        tree = DraftTree.root_only(0)
        c = np.ones(1, dtype=bool)
        return Drafted(tree, c, accept_longest(tree, c), [])


@dataclass
class DepthwiseDrafter(MethodModel):
    """Expands the tree one depth at a time: ``depth`` steps, each offering ``n_cand`` candidates
    under every frontier node, widths from ``policy``, next frontier from ``seeds`` (at most
    ``max_frontier``), final rerank with ``policy.prune`` to ``budget`` draft nodes.

    * SpS: ChainBranching, one drafter forward per depth (``forward_per_depth``);
    * EAGLE-3: DynamicBranching + TopScoreSeeds (EAGLE-2's dynamic tree), one forward per depth;
    * with a position pool in the rank model (traces that log positions, ``pool.py``), each
      expanded position draws a logged row of its depth and reachability instead of the
      parametric confidence;
    * Medusa with a user's ``policy_class`` (``config.build_method``): all positions from one
      forward of the heads (depth = heads), the frontier grown by that policy. Plain Medusa is
      :class:`StaticTreeDrafter`.
    """

    policy: TreePolicy = field(default_factory=DynamicBranching)
    seeds: SeedPolicy = field(default_factory=TopScoreSeeds)
    depth: int = 7
    n_cand: int = 10
    max_frontier: int = 10
    budget: int = 60
    forward_per_depth: bool = True
    drafter: str = "eagle3"
    name: str = "eagle3"

    def draft(self, rng, rm):
        tree = DraftTree.root_only(0)
        book = _RankBook()
        frontier = np.zeros(1, dtype=np.int64)
        forwards: list[int] = []
        k = min(self.n_cand, R)
        f = self.max_frontier
        pool = rm.pool
        if pool is None:
            pos = np.repeat(np.arange(self.depth), f)
            all_rank, all_logp, _ = rm.sample(rng, 0, pos, k, pos.size)  # every position it may need
        # The runtime's limits (policies.branching.rerank_limits): same tree, fewer forwards. The
        # draws above stay those of the full expansion, so a seed gives the same tree either way.
        depth, kw, fw = rerank_limits(self.policy, self.seeds, self.budget, self.depth, k, f)
        for d in range(depth):
            p = frontier.size
            if pool is None:
                rank, logp = all_rank[d * f: d * f + p], all_logp[d * f: d * f + p]
            else:  # logged positions of this depth, as reachable as the frontier node (pool.py)
                live = book.reachable(tree)[frontier] if d else np.ones(1, bool)
                rank, logp = pool.sample(rng, d, live, k, R)
            book.set(frontier, rank)
            if self.forward_per_depth:
                forwards.append(p)
            w = self.policy.widths(tree.cum_logprob[frontier], logp[:, :kw], None, self.budget - (tree.size - 1))
            tokens = np.broadcast_to(np.arange(kw), (p, kw))
            new = add_candidates(tree, frontier, tokens, logp[:, :kw], w, None, block=0)
            new = new[new >= 0]
            if new.size == 0:
                break
            frontier = self.seeds.select(tree, new, fw)
        if not self.forward_per_depth:
            forwards.append(1)
        return _finish(tree, book, forwards, self.policy, self.budget)


@dataclass
class StaticTreeDrafter(MethodModel):
    """Medusa: one forward of the heads, verified on Medusa's static tree (``policies.static_tree``,
    the runtime's own function), chosen per budget from an accuracy table ``acc[head, rank]``.

    The table is ``rank_acc`` when given (the runtime drafter's calibrated table, so the sim
    verifies the very tree the runtime did), else the acceptance model's own rank pmf by depth:
    the accuracies Medusa would measure on held-out data if the model were the drafter. Every
    internal node is a position whose target rank the model draws (key ``(0, depth)``); a child is
    correct iff its head rank equals it, as in :class:`DepthwiseDrafter`.
    """

    heads: int = 4
    top_k: int = 10
    budget: int = 63
    rank_acc: np.ndarray | None = None
    drafter: str = "medusa"
    name: str = "medusa"
    _cached: tuple | None = field(default=None, repr=False)  # (source of the table, tree, inner nodes)

    def tree_for(self, rm: RankModel) -> tuple[DraftTree, np.ndarray]:
        """The static tree and its internal nodes, built once per table (``rank_acc``, or ``rm``'s)."""
        src = self.rank_acc if self.rank_acc is not None else rm
        if self._cached is not None and self._cached[0] is src:
            return self._cached[1], self._cached[2]
        if self.rank_acc is not None:
            acc = np.asarray(self.rank_acc, dtype=np.float64)[: self.heads, : self.top_k]
        else:
            b, p = rm._key(0, np.arange(self.heads))
            acc = rm.pmf[b, p, : min(self.top_k, R)]
        parent, depth, rank = static_tree(np.clip(acc, 1e-6, 1.0), self.budget)  # the runtime clips so too
        logprob = np.where(depth > 0, np.log(np.clip(acc[depth - 1, rank.clip(0)], 1e-9, 1)), 0)
        tree = DraftTree.from_parents(rank.clip(0), parent, rank=rank, block=np.where(depth > 0, 0, -1), logprob=logprob)
        inner = np.unique(parent[1:])
        self._cached = (src, tree, inner)
        return tree, inner

    def draft(self, rng, rm):
        tree, inner = self.tree_for(rm)
        book = _RankBook()
        rank, _, _ = rm.sample(rng, 0, tree.depth[inner], 1, inner.size)
        book.set(inner, rank)
        correct = book.correct(tree)
        return Drafted(tree, correct, accept_longest(tree, correct), [1])


@dataclass
class SpecBlockDrafter(MethodModel):
    """SpecBlock: ``M`` blocks of ``K`` positions, one drafter forward per block (all seeds
    batched). Block m grows under its seeds with ``grow_block`` (spine + rank-bucket siblings);
    the next block's seeds are chosen by ``seeds`` among this block's *leaf* nodes (a node that
    already has a drafted continuation from its own block would only get duplicate candidates),
    at most ``max_seeds``: the runtime's ``SpecBlockDrafter.propose`` step for step.
    ``use_rank_head=False`` hides the predicted buckets from the policy (the digest's fixed top-k
    ablation uses TopKBranching).

    Forwards are counted in query positions as the runtime runs them: a later block with S seeds
    is one forward over S rows of [seed, K queries] = ``S * (K + 1)`` positions; the first block
    is [root, K queries] = ``K + 1`` (our simplification: the runtime's first block also carries
    the previous iteration's other accepted positions, tau - 1 on average, which a CPU forward
    of this size does not feel). Predicted buckets come from the rank model's reachable joint
    while a row's parent chain is correct and from its unreachable table after (``acceptance``).
    """

    policy: TreePolicy = field(default_factory=lambda: _rank_policy())
    seeds: SeedPolicy = field(default_factory=DeepestConfidentSeeds)
    K: int = 4
    M: int = 2
    max_seeds: int = 4
    budget: int = 48
    use_rank_head: bool = True
    drafter: str = "specblock"
    name: str = "specblock"

    def draft(self, rng, rm):
        tree = DraftTree.root_only(0)
        book = _RankBook()
        seeds = np.zeros(1, dtype=np.int64)
        forwards: list[int] = []
        cuts: list[tuple[int, int, int]] = []
        k = min(max(_max_width(self.policy), 1), R)
        ms, kd = self.max_seeds, self.K
        blk = np.repeat(np.arange(self.M), ms * kd)
        pos = np.tile(np.arange(kd), self.M * ms)
        all_rank, all_logp, all_pred = rm.sample(rng, blk, pos, k, blk.size)  # one call per tree
        off_pred = rm.sample_pred_off(rng, blk, pos, blk.size)
        all_rank, all_pred = all_rank.reshape(self.M, ms, kd), all_pred.reshape(self.M, ms, kd)
        off_pred = None if off_pred is None else off_pred.reshape(self.M, ms, kd)
        all_logp = all_logp.reshape(self.M, ms, kd, k)
        pool = rm.pool if rm.pool is not None and rm.pool.block_size is not None else None
        for m in range(self.M):
            s = seeds.size
            if pool is not None:  # logged positions (traces with SpecBlock positions): see _from_pool
                rank, pred, logp = _from_pool(pool, rng, m, book.reachable(tree)[seeds] if m else np.ones(1, bool), kd, k)
            else:
                rank, pred, logp = all_rank[m, :s], all_pred[m, :s], all_logp[m, :s]
            if off_pred is not None and pool is None:  # a row's position k is reachable iff its seed is and ranks 0..k-1 are 0
                live = (book.reachable(tree)[seeds] if m else np.ones(1, bool))[:, None]
                live = live & np.concatenate([np.ones((s, 1), bool), np.cumprod(rank[:, :-1] == 0, axis=1) > 0], axis=1)
                pred = np.where(live, pred, off_pred[m, :s])
            forwards.append(s * (kd + 1))
            tokens = np.broadcast_to(np.arange(k), (s, kd, k))
            bucket = pred if self.use_rank_head else None
            bucket_prob = rm.bucket_posterior(m, pred) if self.use_rank_head else None
            spine = grow_block(tree, seeds, tokens, logp, bucket, self.policy, self.budget, block=m, bucket_prob=bucket_prob)
            parents = np.concatenate([seeds[:, None], spine[:, :-1]], axis=1)
            ok = parents >= 0
            book.set(parents[ok], rank[ok])
            cut_parent, cut_bucket, _ = tree.meta["block_cuts"]  # width 0 from the policy, not the budget
            cuts.extend(zip(cut_parent.tolist(), cut_bucket.tolist(), [m] * len(cut_parent)))
            if m + 1 == self.M or tree.size - 1 >= self.budget:
                break
            cand = tree.meta["block_nodes"]
            cand = cand[tree.is_leaf[cand]]
            seeds = np.asarray(self.seeds.select(tree, cand, ms), dtype=np.int64)[:ms]
            if seeds.size == 0:
                break
        d = _finish(tree, book, forwards, None, None)
        d.cuts = cuts
        return d


def _from_pool(pool, rng: np.random.Generator, m: int, live: np.ndarray, kd: int, k: int):
    """Rank ``[S, K]``, predicted bucket ``[S, K]`` and candidate log-probs ``[S, K, k]`` for one
    block of S rows, each position a whole logged row of its (block, position) key drawn with the
    position's own reachability: position d of a row is reachable iff its seed is and the spine
    above it (ranks 0..d-1) is correct, so the draw walks the K positions in order."""
    s = live.size
    rank = np.empty((s, kd), np.int64)
    pred = np.empty((s, kd), np.int64)
    logp = np.empty((s, kd, k))
    live = live.copy()
    for d in range(kd):
        idx = pool.draw(rng, pool.key_of(m, d), live)
        rank[:, d], logp[:, d] = pool.take(idx, k, R)
        pred[:, d] = pool.pred[idx] if pool.pred is not None else -1
        live &= rank[:, d] == 0
    return rank, pred, logp


def _rank_policy() -> TreePolicy:
    from specblock.policies.branching import RankBucketBranching

    return RankBucketBranching()


def _max_width(policy: TreePolicy) -> int:
    """How many candidates per position the drafter must offer the policy (a user's policy
    declares ``max_width``; without any of these it is offered R)."""
    for attr in ("widths_by_bucket", "k", "top_k", "max_width"):
        v = getattr(policy, attr, None)
        if v is not None:
            return int(max(v)) if isinstance(v, (tuple, list)) else int(v)
    return 1 if isinstance(policy, ChainBranching) else R


def sps(gamma: int = 5, budget: int | None = None) -> DepthwiseDrafter:
    """SpS's chain of ``gamma`` tokens, cut to the node ``budget`` as the runtime cuts it (a chain
    of 4 at budget 2 drafts 2 tokens, not 4)."""
    return DepthwiseDrafter(policy=ChainBranching(), seeds=TopScoreSeeds(), depth=gamma, n_cand=1,
                            max_frontier=1, budget=gamma if budget is None else min(gamma, budget),
                            drafter="sps", name="sps")


def medusa(heads: int = 4, top_k: int = 10, budget: int = 63, rank_acc=None) -> StaticTreeDrafter:
    """Medusa-1 on its static tree (defaults: 4 heads, top-10 per head as the runtime's config,
    63 draft nodes as Medusa's released tree)."""
    return StaticTreeDrafter(heads=heads, top_k=top_k, budget=budget,
                             rank_acc=None if rank_acc is None else np.asarray(rank_acc, dtype=np.float64))


def eagle3(depth: int = 7, top_k: int = 10, budget: int = 60) -> DepthwiseDrafter:
    """EAGLE-3 with EAGLE-2's dynamic tree (defaults: depth 7 as in the digest, top-k 10,
    60 draft tokens as in EAGLE-3's released configs)."""
    return DepthwiseDrafter(policy=DynamicBranching(top_k=top_k), seeds=TopScoreSeeds(), depth=depth,
                            n_cand=top_k, max_frontier=top_k, budget=budget, drafter="eagle3", name="eagle3")
