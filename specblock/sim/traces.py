"""Trace-driven acceptance: fit a :class:`~specblock.sim.acceptance.RankModel` from runtime traces.

The runtime writes one JSON object per decoding iteration (:class:`TraceRecord`). Per tree node
(root at 0): ``parent``, ``depth``, ``rank`` (0-based among its parent's draft candidates, -1 at
the root), ``bucket`` (predicted b0..b3 or -1), ``block`` (-1 at the root), ``correct`` (token ==
target argmax at its parent). ``parent`` is required: without it sibling sets, and so censoring,
cannot be recovered. ``cuts`` (SpecBlock, runtime commit 3dfd240 on) lists the positions the
policy gave width 0 (bucket b3 under (2, 4, 10, 0)): they have a parent but no node, so they are
invisible in ``nodes``; each is an observation of the rank head's prediction at that position.

A *position* is (parent node, block, in-block position): the children a drafter offered there,
or a cut. Its parent is *reachable* when the whole chain from the root to it is correct.

What the fit estimates, per position key (block, in-block position):

* at reachable positions, the joint ``P(rank, pred)`` of the target's rank and the predicted
  bucket. If a child is correct the rank is observed; otherwise it is only known to be >= the
  number of candidates offered (right-censored), and a cut says nothing about the rank. EM over
  the censored ranks, so censored positions count with their posterior instead of being dropped
  (dropping them would bias top-1 upwards and the buckets towards the diagonal). Sparse keys are
  shrunk towards the table pooled over keys (one pseudo-observation, ``prior``);
* at unreachable positions, ``P(pred)``: these positions only shape the tree, and they are most
  positions (see ``acceptance.py`` for why they get their own table).

Why cuts matter: without them the fit sees only positions that survived, so ``P(pred = b3)`` is
estimated as ~0 and the simulated spines never end; traces written before the runtime logged cuts
(:func:`has_cuts` is False for a rank-headed drafter) overestimate tree size and tau.

Identifiability, a limit of any fit from such traces: ``P(rank | pred)`` is known only as far as
the offered widths reveal ranks. Under (2, 4, 10, 0) a b3 prediction offers no candidate, so the
ranks behind it keep the EM's starting point (``_start_joint``: b3 means a deep rank); under
(2, 4, 6, 4) no width reaches rank 10, so b2 and b3 are never told apart. That is harmless for
the widths the traces were taken with, and an assumption for what-ifs with other widths: the
fixed top-2 traces of the lab drafter (which expand b3 positions too) show its b3 predictions
hide the target's top-1 token 21-35% of the time, far from what b3 should mean. To pin it, the
runtime can log, on a small random share of positions, whether the target's token is in the
drafter's top 16. Confidence concentration ``kappa`` is not identifiable without draft log-probs
in the trace; it keeps its default. EAGLE-3's traces do log them (``positions``: per expanded
node its whole top-k and the target's rank among it), and depth-by-depth methods then draw
whole logged positions instead of a Beta confidence (:func:`position_pool`, ``pool.py``).
SpecBlock's drafter logs them too, at every block position with a parent on the tree, with the
block, in-block position and predicted bucket: the sim's SpecBlock model then draws whole rows
by (block, position) and reachability, so a policy that reads the drafter's confidence (not only
the rank head's buckets, which the fit above already takes from the traces) is simulated on the
drafter's own confidence. Traces without them keep the Beta confidence.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, model_validator

from specblock.policies.tree import NUM_BUCKETS
from specblock.sim.acceptance import R, RankModel, _BUCKET_OF, default_confusion
from specblock.sim.pool import MISSING_LOGP, PositionPool


class TraceNodes(BaseModel):
    parent: list[int]
    depth: list[int]
    rank: list[int]
    bucket: list[int]
    block: list[int]
    correct: list[int]

    @model_validator(mode="after")
    def _same_length(self) -> "TraceNodes":
        n = len(self.parent)
        if any(len(getattr(self, f)) != n for f in ("depth", "rank", "bucket", "block", "correct")):
            raise ValueError("trace nodes: every per-node list must have the same length")
        return self


class TraceCuts(BaseModel):
    parent: list[int]
    bucket: list[int]
    block: list[int]


class TracePositions(BaseModel):
    """Per expanded node (EAGLE-3 traces): the drafter's whole top-k there and the target's rank
    among it (-1: not among them), logged before the rerank cut any candidate (``pool.py``)."""

    node: list[int]
    logp: list[list[float]]
    target_rank: list[int]
    # SpecBlock traces: each position's block, in-block position and predicted bucket (the node is
    # the position's parent: the seed, or the spine node above it)
    block: list[int] | None = None
    pos: list[int] | None = None
    bucket: list[int] | None = None

    @model_validator(mode="after")
    def _same_length(self) -> "TracePositions":
        n = len(self.node)
        if not n == len(self.logp) == len(self.target_rank) or \
                any(v is not None and len(v) != n for v in (self.block, self.pos, self.bucket)):
            raise ValueError("trace positions: node, logp, target_rank (block, pos, bucket) must have the same length")
        return self


class TraceRecord(BaseModel):
    """One decoding iteration of one request (times in seconds)."""

    model_config = ConfigDict(extra="ignore")
    iter: int
    ctx: int
    tree_size: int
    depth: int
    accepted: int
    draft_s: float
    verify_s: float
    commit_s: float
    domain: str | None = None
    nodes: TraceNodes
    cuts: TraceCuts | None = None
    positions: TracePositions | None = None


def read_traces(paths, domain: str | None = None) -> list[TraceRecord]:
    recs = []
    for path in [paths] if isinstance(paths, (str, Path)) else paths:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"trace file {p} not found")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{p}: not a JSONL trace file (a non-UTF-8 byte at offset {e.start})") from None
        for i, line in enumerate(text.splitlines()):
            if line.strip():
                try:
                    r = TraceRecord.model_validate_json(line)
                except ValueError as e:
                    raise ValueError(f"{p}:{i + 1}: not a trace record ({str(e).splitlines()[0]})") from None
                if domain is None or r.domain in (None, domain):
                    recs.append(r)
    if not recs:
        raise ValueError(f"no trace records in {paths}")
    return recs


def has_cuts(recs: list[TraceRecord]) -> bool:
    """Whether the traces log rank-head cuts: True when any record has a ``cuts`` field (even
    empty) or no node carries a predicted bucket (no rank head, nothing to cut)."""
    return any(r.cuts is not None for r in recs) or not any(max(r.nodes.bucket, default=-1) >= 0 for r in recs)


#: Methods the sim models depth by depth (``methods.DepthwiseDrafter``): key ``(0, depth - 1)``.
BY_DEPTH = frozenset({"sps", "medusa", "eagle3"})
#: SpecBlock position pools key (block, in-block position) as ``block * KEYS_PER_BLOCK + position``
#: (K is at most 16: ``MethodCfg.K``)
KEYS_PER_BLOCK = 16


def _walk(par: np.ndarray, cor: np.ndarray, blk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per node of a logged tree (parents precede children): whether its whole root chain is
    correct, and its in-block position (0 for a block's first node)."""
    reach = np.zeros(par.size, bool)
    pos = np.zeros(par.size, np.int64)
    reach[0] = True
    for i in range(1, par.size):
        p = par[i]
        reach[i] = reach[p] and bool(cor[i])
        pos[i] = pos[p] + 1 if p > 0 and blk[p] == blk[i] else 0
    return reach, pos


def observations(recs: list[TraceRecord], by_depth: bool = False) -> dict[str, np.ndarray]:
    """One row per drafted position (children offered under one parent in one block, or a cut):
    key (block, pos), whether its parent is reachable, whether the rank is observed, the rank or
    censoring point (0 for a cut: nothing known) and the predicted bucket (-1 when none).

    ``by_depth`` (the methods in ``BY_DEPTH``): every drafted node counts as block 0, so the key
    is ``(0, depth - 1)`` as the sim's depth-by-depth model reads it. The runtime's EAGLE-3 and
    SpS number each depth's forward as its own block; read as blocks, every depth would be keyed
    like depth 1."""
    cols: dict[str, list[int]] = {k: [] for k in ("block", "pos", "reach", "obs", "value", "pred")}

    def add(b: int, q: int, re: bool, ob: bool, v: int, pr: int) -> None:
        for k, x in zip(cols, (b, q, re, ob, v, pr)):
            cols[k].append(x)

    for r in recs:
        nd = r.nodes
        par, rank, bkt, blk, cor = (np.asarray(x) for x in (nd.parent, nd.rank, nd.bucket, nd.block, nd.correct))
        if by_depth:
            blk = np.minimum(blk, 0)
        n = par.size
        reach, pos = _walk(par, cor, blk)
        groups: dict[tuple, list[int]] = {}
        for i in range(1, n):
            groups.setdefault((par[i], blk[i], pos[i]), []).append(i)
        for (p, b, q), kids in groups.items():
            kids = np.asarray(kids)
            hit = kids[cor[kids] == 1]
            if hit.size:
                add(b, q, reach[p], True, int(min(rank[hit].min(), R)), int(bkt[kids[0]]))
            else:
                add(b, q, reach[p], False, int(min(rank[kids].max() + 1, R)), int(bkt[kids[0]]))
        if r.cuts is not None:
            for p, b, blk_c in zip(r.cuts.parent, r.cuts.bucket, r.cuts.block):
                if 0 <= p < n:
                    add(blk_c, pos[p] + 1 if p > 0 and blk[p] == blk_c else 0, reach[p], False, 0, b)
    return {k: np.asarray(v, dtype=bool if k in ("reach", "obs") else np.int64) for k, v in cols.items()}


def fit_rank_model(o: dict[str, np.ndarray], iters: int = 40, prior: float = 1.0, kappa: float = 2.0) -> RankModel:
    """EM for the reachable joint ``P(rank, pred | key)`` over censored ranks; counts for the
    unreachable ``P(pred | key)`` (see module doc).

    Positions are independent given their key here. The lab drafter's buckets are also
    correlated across a tree: in its code traces a seed whose own row was cut right after it had
    its next block cut at once 89% of the time (38 seeds), a seed at its row's end 43% (60). The
    fit does not model that, so later blocks come out up to ~1 node too large on average (code:
    tree 6.3-6.5 nodes simulated vs 5.65 measured; tau within 2%, and a node moves the verify cost
    by well under 1% here). A latent per-iteration class (2-4 classes, EM) was tried and did not
    separate that structure. Keying later blocks by the seed's class (a seed that ended a full
    block vs an earlier one) was tried on the shipped drafter's bench traces and changed the
    simulated tau by no more than the sim's own noise (6,000 trees per domain: code -3.6%
    pooled vs -4.8% split, other domains within 2% either way), so it was left out.
    """
    reach = o.get("reach", np.ones(o["block"].size, bool))
    if not reach.any():
        raise ValueError("traces hold no drafted position under a reachable parent")
    nb, npos = int(o["block"].max()) + 1, int(o["pos"].max()) + 1
    rows = np.stack([o["block"], o["pos"], o["obs"], o["value"], o["pred"]], axis=1)[reach]
    rows, w = np.unique(rows, axis=0, return_counts=True)  # positions repeat a lot: EM on distinct rows
    b, q, obs, val, pred = rows.T
    r = np.arange(R + 1)
    support = np.where(obs[:, None] == 1, r[None, :] == val[:, None], r[None, :] >= val[:, None])
    like = np.where(pred[:, None] >= 0, np.arange(NUM_BUCKETS)[None, :] == pred[:, None], True)
    joint = np.tile(_start_joint(), (nb, npos, 1, 1))
    seen = None
    for _ in range(iters):
        post = support[:, :, None] * like[:, None, :] * joint[b, q]  # [rows, R + 1, 4]
        post /= np.maximum(post.sum((1, 2), keepdims=True), 1e-300)
        counts = np.zeros_like(joint)
        np.add.at(counts, (b, q), post * w[:, None, None])
        seen = counts.copy()
        pooled = counts.sum((0, 1)) + 1e-12
        counts += prior * pooled / pooled.sum()  # shrink sparse keys towards the pooled table
        joint = counts / counts.sum((2, 3), keepdims=True)
    # The confusion pooled over keys: a summary (describe) and the fallback for ranks without mass.
    cc = np.zeros((NUM_BUCKETS, NUM_BUCKETS))
    np.add.at(cc, _BUCKET_OF, seen.sum((0, 1)))
    rowsum = cc.sum(1, keepdims=True)
    conf = np.where(rowsum > 1e-9, cc / np.maximum(rowsum, 1e-300), default_confusion(0.7))
    off = ~reach & (o["pred"] >= 0)
    pred_off = None
    if off.any():
        oc = np.zeros((nb, npos, NUM_BUCKETS))
        np.add.at(oc, (o["block"][off], o["pos"][off], o["pred"][off]), 1.0)
        pooled = oc.sum((0, 1))
        pred_off = oc + prior * pooled / pooled.sum()
        pred_off /= pred_off.sum(-1, keepdims=True)
    return RankModel(pmf=joint.sum(-1), confusion=conf, kappa=kappa, joint=joint, pred_off=pred_off)


def _start_joint() -> np.ndarray:
    """EM's starting ``P(rank, pred)`` ``[R + 1, 4]``, which is also what the fit keeps wherever the
    traces cannot speak (the ranks behind a b3 under a width-0 policy): buckets equally likely,
    and a predicted bucket right about the rank's bucket with probability 0.7 (the default
    confusion read as ``P(true | pred)``), ranks geometric (1/2) inside a bucket. Why this way
    round: a b3 prediction should mean "the target's token is deep", so the unidentified rows
    keep top-1 acceptance low (5%) instead of the ~44% that ``P(pred | true)`` with a geometric
    rank pmf would imply."""
    within = np.zeros((NUM_BUCKETS, R + 1))
    for t in range(NUM_BUCKETS):
        at = _BUCKET_OF == t
        within[t, at] = 0.5 ** np.arange(at.sum())
        within[t] /= within[t].sum()
    rank_given_pred = default_confusion(0.7) @ within  # [pred, R + 1]
    return rank_given_pred.T / NUM_BUCKETS


def specblock_forwards(rec: TraceRecord, K: int, M: int, max_seeds: int, budget: int) -> list[int]:
    """The drafter forwards (query positions) a SpecBlock iteration ran, from its trace record and
    the runtime's rule (``SpecBlockDrafter.propose``): block 1 is [root, K queries]; block m + 1
    runs while the tree is under budget, with one row of [seed, K queries] per seed, seeds being
    at most ``max_seeds`` of block m's leaves. Exact unless the engine cut the tree afterwards."""
    blk, par = np.asarray(rec.nodes.block), np.asarray(rec.nodes.parent)
    out = [K + 1]
    for m in range(1, M):
        prev = np.nonzero(blk == m - 1)[0]
        if prev.size == 0 or int(((blk >= 0) & (blk < m)).sum()) >= budget:
            break
        has_child = np.zeros(blk.size, bool)
        has_child[par[prev]] = True  # a parent with a child in its own block is no leaf then
        seeds = min(max_seeds, int((~has_child[prev]).sum()))
        if seeds == 0:
            break
        out.append(seeds * (K + 1))
    return out


def position_pool(recs: list[TraceRecord]) -> PositionPool | None:
    """The logged positions of ``recs`` as a :class:`~specblock.sim.pool.PositionPool` (key = the
    expanded node's depth; for SpecBlock traces, which log block and in-block position, key =
    ``block * KEYS_PER_BLOCK + pos`` with the predicted bucket kept per row; reachable = the parent's whole
    chain correct), or None when none are logged."""
    logged = [r for r in recs if r.positions and r.positions.node]
    if not logged:
        return None
    blocks = all(r.positions.block is not None and r.positions.pos is not None for r in logged)
    K = KEYS_PER_BLOCK if blocks else None  # fixed: a short trace need not reach a block's last position
    key, reach, rank, logp, pred = [], [], [], [], []
    width = max(len(row) for r in logged for row in r.positions.logp)
    for r in logged:
        ok, _ = _walk(np.asarray(r.nodes.parent), np.asarray(r.nodes.correct), np.asarray(r.nodes.block))
        node = np.asarray(r.positions.node)
        if blocks:
            key.append(np.asarray(r.positions.block) * K + np.asarray(r.positions.pos))
            pred.append(np.asarray(r.positions.bucket if r.positions.bucket is not None else [-1] * node.size))
        else:
            key.append(np.asarray(r.nodes.depth)[node])
        reach.append(ok[node])
        rank.append(r.positions.target_rank)
        logp.extend(row + [MISSING_LOGP] * (width - len(row)) for row in r.positions.logp)
    return PositionPool(key=np.concatenate(key), reach=np.concatenate(reach), rank=np.concatenate(rank),
                        logp=np.asarray(logp), pred=np.concatenate(pred) if blocks else None, block_size=K)


def fit_acceptance(recs: list[TraceRecord], method: str | None = None) -> RankModel:
    """The acceptance model of ``method`` from its traces: keys by depth for ``BY_DEPTH``, and the
    position pool where the traces log positions (depth-by-depth drafters draw from it)."""
    by_depth = method in BY_DEPTH
    rm = fit_rank_model(observations(recs, by_depth=by_depth))
    pool = position_pool(recs)
    if by_depth or (pool is not None and pool.block_size is not None):
        rm.pool = pool  # SpecBlock: its positions carry block, in-block position and bucket
    return rm


def fit_traces(paths, method: str | None = None, domain: str | None = None) -> RankModel:
    """Read JSONL traces and fit the acceptance model of ``method``."""
    return fit_acceptance(read_traces(paths, domain), method)


def describe(rm: RankModel) -> dict:
    out = {"blocks": rm.pmf.shape[0], "positions": rm.pmf.shape[1],
           "top1": np.round(rm.pmf[..., 0], 4).tolist(),
           "confusion": np.round(rm.confusion, 4).tolist(), "kappa": rm.kappa,
           "pred_reachable": np.round(rm.joint_table.sum(-2), 4).tolist()}
    if rm.pred_off is not None:
        out["pred_unreachable"] = np.round(rm.pred_off, 4).tolist()
    if rm.pool is not None:
        out["position_pool"] = rm.pool.summary()
    return out
