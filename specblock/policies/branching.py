"""Tree policies: how many of each parent's ranked draft candidates join the tree.

A drafter hands a policy plain arrays, for P parents at once: the parents' cumulative draft
log-prob, their top-k candidates' log-probs (sorted, best first) and, when the drafter has a rank
head, each position's predicted rank bucket. The policy answers with a width per parent: keep
candidates ``0 .. width-1``. Because candidates are sorted, any width vector keeps the tree
"prefix-closed", and the shared helpers below turn widths into tree nodes with one ``extend``.

The simulator feeds the same classes synthetic candidates, so nothing here imports torch.
Subclass :class:`TreePolicy` (override :meth:`TreePolicy.raw_widths`) to customise branching.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specblock.policies.seeds import SeedPolicy, TopScoreSeeds
from specblock.policies.tree import NUM_BUCKETS, DraftTree


class TreePolicy:
    """Base: decides widths per parent, fits them to the node budget, and reranks a whole tree."""

    name = "base"

    def raw_widths(
        self, parent_score: np.ndarray, cand_logprob: np.ndarray, bucket: np.ndarray | None
    ) -> np.ndarray:
        raise NotImplementedError

    def widths(
        self,
        parent_score: np.ndarray,
        cand_logprob: np.ndarray,
        bucket: np.ndarray | None,
        budget_left: int,
    ) -> np.ndarray:
        """Widths that respect ``budget_left``: the best candidates by cumulative log-prob win."""
        k = cand_logprob.shape[1]
        w = np.minimum(np.maximum(np.asarray(self.raw_widths(parent_score, cand_logprob, bucket)), 0), k).astype(np.int64)
        return fit_budget(w, parent_score, cand_logprob, budget_left)

    def block_widths(
        self,
        parent_score: np.ndarray,
        cand_logprob: np.ndarray,
        bucket: np.ndarray | None,
        budget_left: int,
        seed_ok: np.ndarray,
        bucket_prob: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Widths ``[S, K]`` for a whole drafted block (:func:`grow_block`), and where the policy
        itself ended a spine (``cut``, not the budget: traces carry it to the simulator).

        Inputs per seed row s and in-block position d: the parent's cumulative log-prob, the
        top-k candidates' log-probs ``[S, K, k]``, the predicted bucket and the rank head's
        probabilities ``[S, K, 4]`` (None without a rank head); ``seed_ok`` marks real seeds.
        Only the top-1 candidate continues a spine, so position d exists iff every width above
        it is >= 1. Default: :meth:`raw_widths` per position, the budget spent in depth order
        (what a per-depth loop would do: the depth where it runs out is trimmed by
        :func:`fit_budget`, deeper ones get nothing). Override it to decide a block jointly
        (:class:`specblock.policies.expected.ExpectedAcceptanceBranching`).
        """
        s, kd, k = cand_logprob.shape
        flat_b = None if bucket is None else np.asarray(bucket).reshape(-1)
        raw = np.asarray(self.raw_widths(parent_score.reshape(-1), cand_logprob.reshape(s * kd, k), flat_b))
        raw = np.minimum(np.maximum(raw.reshape(s, kd), 0), k).astype(np.int64)
        alive = spine_alive(raw, seed_ok)
        w = np.where(alive, raw, 0)
        cut = alive & (raw == 0)
        spent = np.cumsum(w.sum(axis=0))
        over = np.nonzero(spent > budget_left)[0]
        if over.size:  # the budget runs out at depth d*: trim it there, nothing deeper
            d = int(over[0])
            room = max(budget_left - (int(spent[d - 1]) if d else 0), 0)
            live = np.nonzero(alive[:, d])[0]
            w[live, d] = fit_budget(w[live, d], parent_score[live, d], cand_logprob[live, d], room)
            w[:, d + 1 :] = 0
            cut[:, d + 1 :] = False
        return w, cut

    def prune(self, tree: DraftTree, budget: int) -> DraftTree:
        """Final rerank of a finished tree to ``budget`` draft nodes (root excluded).

        Default: keep the ``budget`` nodes with the highest cumulative log-prob. Cumulative
        log-prob never increases down a path, so ties aside the kept set is ancestor-closed; the
        stable sort by (score, index) makes it so with ties too.
        """
        if tree.size - 1 <= budget:
            return tree
        score = tree.cum_logprob.astype(np.float64)
        score[0] = np.inf
        order = np.lexsort((np.arange(tree.size), -score))  # by score desc, then index asc
        keep = np.zeros(tree.size, dtype=bool)
        keep[order[: budget + 1]] = True
        keep = _ancestor_close(tree, keep)
        return tree.subtree(keep)[0]


def _ancestor_close(tree: DraftTree, keep: np.ndarray) -> np.ndarray:
    """Drop kept nodes whose ancestors were dropped (guards against exact score ties)."""
    return ~(tree.ancestor_mask & ~keep[None, :]).any(axis=1) & keep


def spine_alive(widths: np.ndarray, seed_ok: np.ndarray) -> np.ndarray:
    """``[S, K]``: position d of a block exists iff its seed is real and every width above it is
    >= 1 (only the top-1 candidate continues the spine)."""
    alive = np.ones(widths.shape, dtype=bool)
    alive[:, 0] = seed_ok
    if widths.shape[1] > 1:
        alive[:, 1:] = np.logical_and.accumulate(widths[:, :-1] > 0, axis=1) & alive[:, :1]
    return alive


def fit_budget(
    widths: np.ndarray, parent_score: np.ndarray, cand_logprob: np.ndarray, budget_left: int
) -> np.ndarray:
    """Trim ``widths`` so their sum is at most ``budget_left``, dropping the lowest-scoring
    candidates first. Candidates are sorted per parent, so what survives stays a prefix."""
    total = int(widths.sum())
    if total <= budget_left:
        return widths
    if budget_left <= 0:
        return np.zeros_like(widths)
    p, k = cand_logprob.shape
    allowed = np.arange(k)[None, :] < widths[:, None]
    score = np.where(allowed, parent_score[:, None] + cand_logprob, -np.inf).reshape(-1)
    best = np.argsort(-score, kind="stable")[:budget_left]
    chosen = np.zeros(p * k, dtype=bool)
    chosen[best] = True
    chosen = chosen.reshape(p, k)
    # Make each row a prefix (only matters under exact ties inside a row).
    return np.cumprod(chosen, axis=1).sum(axis=1).astype(np.int64)


@dataclass
class ChainBranching(TreePolicy):
    """One candidate per parent: a chain (SpS, lookup chains)."""

    name = "chain"

    def raw_widths(self, parent_score, cand_logprob, bucket):
        return np.ones(cand_logprob.shape[0], dtype=np.int64)


@dataclass
class TopKBranching(TreePolicy):
    """A fixed number of candidates per parent (the paper's 'fixed uniform top-k' ablation)."""

    k: int = 2
    name = "topk"

    def raw_widths(self, parent_score, cand_logprob, bucket):
        return np.full(cand_logprob.shape[0], self.k, dtype=np.int64)


@dataclass
class RankBucketBranching(TreePolicy):
    """SpecBlock's rank-guided widths: the predicted bucket b0..b3 sets the sibling count.

    ``widths[b]`` is how many candidates a position in bucket b keeps; a 0 ends the branch. The
    paper gives (2, 4, 10, 0) and (2, 4, 6, 4). Positions without a prediction use
    ``widths[unknown_bucket]`` (our choice; the paper always has a rank head).
    """

    widths_by_bucket: tuple[int, int, int, int] = (2, 4, 10, 0)
    unknown_bucket: int = 0
    name = "rank"

    def __post_init__(self) -> None:
        if len(self.widths_by_bucket) != NUM_BUCKETS or min(self.widths_by_bucket) < 0:
            raise ValueError("RankBucketBranching needs four non-negative widths (b0, b1, b2, b3)")

    def raw_widths(self, parent_score, cand_logprob, bucket):
        table = np.asarray(self.widths_by_bucket, dtype=np.int64)
        if bucket is None:
            return np.full(cand_logprob.shape[0], table[self.unknown_bucket], dtype=np.int64)
        b = np.asarray(bucket, dtype=np.int64)
        return table[np.where(b < 0, self.unknown_bucket, b)]


@dataclass
class DynamicBranching(TreePolicy):
    """EAGLE-2-style: each expanded parent offers its top ``top_k`` candidates; the frontier
    (which nodes expand next) is chosen by a seed policy, and :meth:`prune` reranks the finished
    tree to the node budget by cumulative log-prob."""

    top_k: int = 8
    name = "dynamic"

    def raw_widths(self, parent_score, cand_logprob, bucket):
        return np.full(cand_logprob.shape[0], self.top_k, dtype=np.int64)

    def widths(self, parent_score, cand_logprob, bucket, budget_left):
        # No per-step budget cut: EAGLE-2 grows generously and reranks once at the end.
        k = cand_logprob.shape[1]
        return np.minimum(self.raw_widths(parent_score, cand_logprob, bucket), k)


def drafter_budget(budget: int, chain: int, own: int | None) -> int:
    """The nodes a drafter gets in a tree of ``budget`` beside prompt lookup's chain of ``chain``
    tokens (``METHOD+lookup``, the runtime's and the simulator's one rule): what the chain leaves
    (shared, ``own`` None), and at most its own budget (the chain on top)."""
    left = budget - chain
    return left if own is None else min(own, left)


def rerank_limits(policy: TreePolicy, seeds: SeedPolicy, budget: int, *limits: int) -> tuple[int, ...]:
    """``limits`` (an EAGLE-2-style expansion's depth, frontier nodes per depth, children per
    node) cut to what it needs when its tree is then reranked to ``budget`` nodes.

    Why: the default rerank (:meth:`TreePolicy.prune`) keeps the ``budget`` nodes of highest
    cumulative log-prob, an ancestor-closed set. So no kept node lies deeper than ``budget``, a
    kept node's parent is among the ``budget`` best nodes of its depth, and a kept child is among
    its parent's ``budget`` best candidates: expanding past ``budget`` in any of them yields the
    same tree (exact score ties aside) for more drafter forwards. At EAGLE-3's served budget of 2
    that was 6 depths of up to 8 frontier nodes for 2 kept nodes. It holds for the default rerank
    with the top-score frontier; any other pair (a user's policy) keeps ``limits`` as given.
    """
    if type(policy).prune is not TreePolicy.prune or not isinstance(seeds, TopScoreSeeds) or \
            type(seeds).select is not TopScoreSeeds.select:
        return limits
    b = max(int(budget), 1)
    return tuple(min(x, b) for x in limits)


def add_candidates(
    tree: DraftTree,
    parents: np.ndarray,
    cand_tokens: np.ndarray,
    cand_logprob: np.ndarray,
    widths: np.ndarray,
    bucket: np.ndarray | None = None,
    block: int = 0,
) -> np.ndarray:
    """Add candidates ``0..widths[p]-1`` of each parent with one ``extend``.

    Returns ``[P, k]`` node indices, -1 where a candidate was not added.
    """
    p, k = cand_tokens.shape
    take = np.arange(k)[None, :] < np.asarray(widths)[:, None]
    rows, cols = np.nonzero(take)
    out = np.full((p, k), -1, dtype=np.int64)
    if rows.size == 0:
        return out
    new = tree.extend(
        parents=np.asarray(parents)[rows],
        tokens=cand_tokens[rows, cols],
        logprob=cand_logprob[rows, cols],
        rank=cols,
        bucket=None if bucket is None else np.asarray(bucket)[rows],
        block=block,
    )
    out[rows, cols] = new
    return out


def expand(
    tree: DraftTree,
    parents: np.ndarray,
    cand_tokens: np.ndarray,
    cand_logprob: np.ndarray,
    policy: TreePolicy,
    budget: int,
    bucket: np.ndarray | None = None,
    block: int = 0,
) -> np.ndarray:
    """One drafting step for every drafter: the policy's widths for ``parents`` under what is left
    of the node budget, added with one ``extend``. Returns ``[P, k]`` node ids (-1: not added)."""
    w = policy.widths(tree.cum_logprob[parents], cand_logprob, bucket, max(budget - (tree.size - 1), 0))
    return add_candidates(tree, parents, cand_tokens, cand_logprob, w, bucket, block)


def grow_block(
    tree: DraftTree,
    seeds: np.ndarray,
    cand_tokens: np.ndarray,
    cand_logprob: np.ndarray,
    bucket: np.ndarray | None,
    policy: TreePolicy,
    budget: int,
    block: int,
    bucket_prob: np.ndarray | None = None,
) -> np.ndarray:
    """Hang one drafted block under each seed (our reading of the paper, see DESIGN.md).

    ``cand_*`` are ``[S, K, k]``: for seed s and in-block position d, the top-k candidates. The
    block's forward conditioned position d on the drafter's top-1 belief at d-1, so the top-1
    candidate continues the *spine*; the other kept candidates are siblings, leaves of this block.
    A width of 0 (bucket b3 under (2, 4, 10, 0)) cuts the spine. Returns the spine ``[S, K]``
    (-1 where cut). ``tree.meta`` gets, for every node this block added, ``block_nodes`` (node
    id), ``block_rows`` (seed row s) and ``block_pos`` (in-block position d): a drafter finds the
    hidden state behind each node from them; and ``block_cuts`` (parent, bucket, block) for each
    position the policy itself gave width 0 (not the budget): traces carry them to the simulator.

    The widths of the whole block are decided at once by :meth:`TreePolicy.block_widths` (``bucket_prob``,
    the rank head's probabilities ``[S, K, 4]`` where the drafter has one, goes to it) and the nodes
    are added with one ``extend``. A policy that overrides :meth:`TreePolicy.widths` (its own
    budget rule) and not ``block_widths`` is driven depth by depth through :func:`expand` instead.
    """
    if type(policy).block_widths is TreePolicy.block_widths and type(policy).widths is not TreePolicy.widths:
        return _grow_block_stepwise(tree, seeds, cand_tokens, cand_logprob, bucket, policy, budget, block)
    seeds = np.asarray(seeds, dtype=np.int64)
    s, kd, k = cand_tokens.shape
    # Score of each position's parent: the seed's cumulative log-prob plus the spine above it
    # (float32, summed in the same order extend's incremental cum_logprob uses).
    score = np.empty((s, kd), dtype=np.float32)
    score[:, 0] = tree.cum_logprob[seeds]
    if kd > 1:
        score[:, 1:] = cand_logprob[:, : kd - 1, 0]
        score = np.cumsum(score, axis=1, dtype=np.float32)
    w, cut = policy.block_widths(score, cand_logprob, None if bucket is None else np.asarray(bucket),
                                 budget - (tree.size - 1), seeds >= 0, bucket_prob)
    # A policy's widths are held to the block's rules here, whoever wrote them.
    alive = spine_alive(np.asarray(w), seeds >= 0)
    w = np.where(alive, np.clip(np.asarray(w, dtype=np.int64), 0, k), 0)
    cut = np.asarray(cut, dtype=bool) & alive & (w == 0)
    if int(w.sum()) > max(budget - (tree.size - 1), 0):
        raise ValueError(f"{type(policy).__name__}.block_widths kept {int(w.sum())} nodes with "
                         f"{max(budget - (tree.size - 1), 0)} left in the budget")
    # Nodes in (depth, seed, candidate) order: parents (spine at d-1) come before children.
    take = np.arange(k)[None, None, :] < w.T[:, :, None]  # [K, S, k]
    dd, ss, cc = np.nonzero(take)
    n = dd.size
    spine = np.full((s, kd), -1, dtype=np.int64)
    if n:
        ids = tree.size + np.arange(n, dtype=np.int64)
        top = cc == 0
        spine[ss[top], dd[top]] = ids[top]
        parents = np.where(dd == 0, seeds[ss], spine[ss, np.maximum(dd - 1, 0)])
        bounds = np.searchsorted(dd, np.arange(kd + 1)).tolist()  # dd is sorted: levels are runs
        tree.extend(
            parents=parents,
            tokens=cand_tokens[ss, dd, cc],
            logprob=cand_logprob[ss, dd, cc],
            rank=cc,
            bucket=None if bucket is None else np.asarray(bucket)[ss, dd],
            block=block,
            levels=[slice(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a],
        )
    else:
        ids = np.zeros(0, dtype=np.int64)
    cs, cd = np.nonzero(cut)
    cut_parent = np.where(cd == 0, seeds[cs], spine[cs, np.maximum(cd - 1, 0)])
    tree.meta.update(
        block_nodes=ids, block_rows=ss, block_pos=dd,
        block_cuts=(cut_parent, np.full(cs.size, -1) if bucket is None else np.asarray(bucket)[cs, cd], block),
    )
    return spine


def _grow_block_stepwise(
    tree: DraftTree,
    seeds: np.ndarray,
    cand_tokens: np.ndarray,
    cand_logprob: np.ndarray,
    bucket: np.ndarray | None,
    policy: TreePolicy,
    budget: int,
    block: int,
) -> np.ndarray:
    """The depth-by-depth form of :func:`grow_block`, for policies with their own ``widths``
    (budget) rule. ``block_cuts`` stays empty here: fitted widths cannot tell a policy cut from a
    budget cut."""
    s, kdepth, _ = cand_tokens.shape
    spine = np.full((s, kdepth), -1, dtype=np.int64)
    parents = np.asarray(seeds, dtype=np.int64)
    nodes, rows, pos = [], [], []
    for d in range(kdepth):
        alive = np.nonzero(parents >= 0)[0]
        budget_left = budget - (tree.size - 1)
        if alive.size == 0 or budget_left <= 0:
            break
        b = None if bucket is None else bucket[alive, d]
        new = expand(tree, parents[alive], cand_tokens[alive, d], cand_logprob[alive, d], policy, budget, b, block)
        r, _ = np.nonzero(new >= 0)
        nodes.append(new[new >= 0])
        rows.append(alive[r])
        pos.append(np.full(r.size, d, dtype=np.int64))
        spine[alive, d] = new[:, 0]
        parents = spine[:, d]
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, dtype=np.int64)
    none = np.zeros(0, dtype=np.int64)
    tree.meta.update(block_nodes=cat(nodes), block_rows=cat(rows), block_pos=cat(pos), block_cuts=(none, none, block))
    return spine
