"""Trace-driven acceptance: fit a :class:`~specblock.sim.acceptance.RankModel` from runtime traces.

The runtime writes one JSON object per decoding iteration (:class:`TraceRecord`). Per tree node
(root at 0): ``parent``, ``depth``, ``rank`` (0-based among its parent's draft candidates, -1 at
the root), ``bucket`` (predicted b0..b3 or -1), ``block`` (-1 at the root), ``correct`` (token ==
target argmax at its parent). ``parent`` is required: without it sibling sets, and so censoring,
cannot be recovered. Optional ``cuts`` lists positions the policy gave width 0 (bucket b3 under
(2, 4, 10, 0)): invisible in ``nodes``, but they carry the rank head's b3 predictions.

What the fit estimates: for every expanded position whose parent is reachable (the whole chain to
it correct), the target's rank there. If a child is correct its rank is observed; otherwise the
rank is only known to be >= the number of candidates offered (right-censored), and a cut says
nothing about the rank at all. Rank pmf per (block, in-block position) and the bucket confusion
``P(pred | true bucket)`` are fitted jointly by EM, so censored positions count with their
posterior over ranks instead of being dropped (dropping them would bias top-1 upwards and the
confusion towards the diagonal).

Identifiability, a limit of any fit from such traces: the confusion row of a true bucket is known
only as far as the offered widths reveal ranks. Under (2, 4, 10, 0) a b3 prediction offers no
candidate, so which true buckets it came from is not identifiable; under (2, 4, 6, 4) no width
reaches rank 10, so b2 and b3 are never told apart. The rank pmf and the b0/b1 rows are fine;
tau from a refitted model matches (tested). To pin the rest, the runtime can log, on a small
random share of positions, whether the target's token is anywhere in the drafter's top 16.
Confidence concentration ``kappa`` is not identifiable without
draft log-probs in the trace; it keeps its default.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, model_validator

from specblock.policies.tree import NUM_BUCKETS
from specblock.sim.acceptance import R, RankModel, _BUCKET_OF, default_confusion


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


def read_traces(paths, domain: str | None = None) -> list[TraceRecord]:
    recs = []
    for path in [paths] if isinstance(paths, (str, Path)) else paths:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"trace file {p} not found")
        for i, line in enumerate(p.read_text().splitlines()):
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


def observations(recs: list[TraceRecord]) -> dict[str, np.ndarray]:
    """One row per expanded position under a reachable parent: key (block, pos), whether the rank
    is observed, the rank or censoring point, and the predicted bucket (-1 when none)."""
    kb, kp, obs, val, pred = [], [], [], [], []
    for r in recs:
        nd = r.nodes
        par, rank, bkt, blk, cor = (np.asarray(x) for x in (nd.parent, nd.rank, nd.bucket, nd.block, nd.correct))
        n = par.size
        reach = np.zeros(n, bool)
        pos = np.zeros(n, np.int64)
        reach[0] = True
        for i in range(1, n):
            p = par[i]
            reach[i] = reach[p] and bool(cor[i])
            pos[i] = pos[p] + 1 if p > 0 and blk[p] == blk[i] else 0
        groups: dict[tuple, list[int]] = {}
        for i in range(1, n):
            if reach[par[i]]:
                groups.setdefault((par[i], blk[i], pos[i]), []).append(i)
        for (_, b, q), kids in groups.items():
            kids = np.asarray(kids)
            hit = kids[cor[kids] == 1]
            kb.append(b), kp.append(q), pred.append(int(bkt[kids[0]]))
            if hit.size:
                obs.append(True), val.append(int(min(rank[hit].min(), R)))
            else:
                obs.append(False), val.append(int(min(rank[kids].max() + 1, R)))
        if r.cuts is not None:
            for p, b, blk_c in zip(r.cuts.parent, r.cuts.bucket, r.cuts.block):
                if reach[p]:
                    kb.append(blk_c), kp.append(pos[p] + 1 if p > 0 and blk[p] == blk_c else 0)
                    obs.append(False), val.append(0), pred.append(b)
    return {k: np.asarray(v, dtype=np.int64 if k != "obs" else bool)
            for k, v in (("block", kb), ("pos", kp), ("obs", obs), ("value", val), ("pred", pred))}


def fit_rank_model(o: dict[str, np.ndarray], iters: int = 40, prior: float = 1.0, kappa: float = 2.0) -> RankModel:
    """EM over censored ranks and the bucket confusion (see module doc)."""
    if o["block"].size == 0:
        raise ValueError("traces hold no expanded position under a reachable parent")
    nb, npos = int(o["block"].max()) + 1, int(o["pos"].max()) + 1
    r = np.arange(R + 1)
    support = np.where(o["obs"][:, None], r[None, :] == o["value"][:, None], r[None, :] >= o["value"][:, None])
    has_pred = o["pred"] >= 0
    pred = np.where(has_pred, o["pred"], 0)
    pmf = np.tile(0.5 ** (r + 1.0), (nb, npos, 1))
    pmf /= pmf.sum(-1, keepdims=True)
    conf = default_confusion(0.7)
    for _ in range(iters):
        like = np.where(has_pred[:, None], conf[_BUCKET_OF][:, pred].T, 1.0)  # [obs, R+1]
        post = support * pmf[o["block"], o["pos"]] * like
        post /= np.maximum(post.sum(1, keepdims=True), 1e-300)
        counts = np.zeros_like(pmf)
        np.add.at(counts, (o["block"], o["pos"]), post)
        pooled = counts.sum((0, 1)) + 1e-9
        counts += prior * pooled / pooled.sum()  # shrink sparse keys towards the pooled pmf
        pmf = counts / counts.sum(-1, keepdims=True)
        cc = np.zeros((NUM_BUCKETS, NUM_BUCKETS))
        tb = post[has_pred] @ np.eye(NUM_BUCKETS)[_BUCKET_OF]  # [obs, true bucket]
        np.add.at(cc.T, pred[has_pred], tb)
        cc += prior * 0.01
        conf = cc / cc.sum(1, keepdims=True)
    return RankModel(pmf=pmf, confusion=conf, kappa=kappa)


def fit_traces(paths, method: str | None = None, domain: str | None = None) -> RankModel:
    """Read JSONL traces and fit the acceptance model (``method`` is informational)."""
    return fit_rank_model(observations(read_traces(paths, domain)))


def describe(rm: RankModel) -> dict:
    return {"blocks": rm.pmf.shape[0], "positions": rm.pmf.shape[1],
            "top1": np.round(rm.pmf[..., 0], 4).tolist(),
            "confusion": np.round(rm.confusion, 4).tolist(), "kappa": rm.kappa}
