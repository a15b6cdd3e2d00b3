"""Acceptance models: where the target's token sits among the drafter's candidates.

At every expanded draft position (a parent node whose children a drafter proposes) the sim draws
the 0-based rank ``r`` of the target's greedy token among that position's candidates, from a
distribution by *position key* ``(block m, in-block position k)`` and *domain*; for
autoregressive drafters the key is ``(0, depth - 1)``. ``r == R`` means "not among the top R".
A child with candidate rank ``c`` is then correct iff ``c == r``: exactly the runtime's greedy
rule, so the sim can call the same ``policies.acceptance.accept_longest``.

The distribution is *conditional on the parent being correct*: only then does the position's rank
matter for acceptance (the trace fitter estimates exactly this conditional).

Beyond the rank, tree policies look at the drafter's confidence (cumulative log-prob ranks
EAGLE-2's frontier and prune) and at the rank head's bucket. Our choices, where the paper is
silent:

* top-1 confidence ``q0 ~ Beta(a * kappa, (1 - a) * kappa)`` with ``a = P(r = 0)``, and
  ``P(r = 0 | q0) = q0``: a calibrated drafter whose marginal top-1 acceptance is exactly ``a``;
  ``kappa`` sets how informative confidence is (small = sharp, informative);
* lower candidates' log-probs are the mean conditional rank probabilities times ``1 - q0``;
* the rank head's predicted bucket is drawn from a confusion matrix ``P(pred | true bucket)``
  over b0..b3, conditionally independent of ``q0`` given the true rank.

Models fitted from runtime traces (``traces.py``) replace the shared confusion by a joint table
``P(rank, pred | key)`` per position key, and add ``P(pred | key)`` at positions whose parent is
*not* reachable (some ancestor wrong). Why: the predicted bucket sets the tree's shape at every
position, but most positions of a real tree hang under a wrong parent (top-1 acceptance of the
shipped drafter is 12-23%), and there the rank head does not behave as at the few positions the
target walks through. On the lab drafter's traces, buckets drawn from the reachable table alone
give trees of 2.9 nodes for code (measured 5.65) and 9.6 for chat (7.6); with the unreachable
table, 6.5 and 8.2. (The 3-6x too-large trees of issue 7 came from traces without cuts, see
``traces.py``.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from specblock.policies.tree import NUM_BUCKETS, rank_to_bucket
from specblock.sim.pool import PositionPool

#: Ranks 0..R-1 are modelled one by one; index R lumps every rank >= R (bucket b3).
R = 16
_BUCKET_OF = rank_to_bucket(np.arange(R + 1))


def default_confusion(accuracy: float = 0.7) -> np.ndarray:
    """A rank head that is right with ``accuracy`` and, when wrong, errs towards neighbouring
    buckets (weights 1/|i-j|). Our assumption: the digest gives no rank-head accuracy."""
    c = np.zeros((NUM_BUCKETS, NUM_BUCKETS))
    for i in range(NUM_BUCKETS):
        w = np.array([0.0 if j == i else 1.0 / abs(i - j) for j in range(NUM_BUCKETS)])
        c[i] = (1 - accuracy) * w / w.sum()
        c[i, i] = accuracy
    return c


@dataclass
class RankModel:
    """Rank pmfs ``pmf[m, k, 0..R]`` for one domain, a bucket confusion and the confidence
    concentration. Keys beyond the table reuse its last block / position (deep positions).

    Optional (trace fits): ``joint[m, k, r, j] = P(rank r, pred j | key, parent reachable)``; when
    given, ``pmf`` is its rank marginal and the predicted bucket is drawn from ``P(pred | rank,
    key)`` instead of the shared ``confusion``. ``pred_off[m, k, j] = P(pred j | key, parent not
    reachable)``: the bucket at positions the target never reaches, which only shape the tree;
    without it every position draws its bucket given its own rank (the parametric models)."""

    pmf: np.ndarray  # [blocks, positions, R + 1]
    confusion: np.ndarray = field(default_factory=default_confusion)  # [4, 4] P(pred | true)
    kappa: float = 2.0
    joint: np.ndarray | None = None  # [blocks, positions, R + 1, 4]
    pred_off: np.ndarray | None = None  # [blocks, positions, 4]
    pool: PositionPool | None = None  # trace fits: depth-by-depth drafters draw logged positions
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.confusion = np.asarray(self.confusion, dtype=np.float64)
        if self.joint is not None:
            self.joint = np.asarray(self.joint, dtype=np.float64)
            if self.joint.ndim != 4 or self.joint.shape[2:] != (R + 1, NUM_BUCKETS):
                raise ValueError(f"joint must be [blocks, positions, {R + 1}, {NUM_BUCKETS}]")
            self.pmf = self.joint.sum(-1)
        self.pmf = np.asarray(self.pmf, dtype=np.float64)
        if self.pmf.ndim != 3 or self.pmf.shape[2] != R + 1:
            raise ValueError(f"pmf must be [blocks, positions, {R + 1}]")
        if (self.pmf < 0).any() or not np.allclose(self.pmf.sum(-1), 1.0, atol=1e-6):
            raise ValueError("every rank pmf must be non-negative and sum to 1")
        if self.pred_off is not None:
            self.pred_off = np.asarray(self.pred_off, dtype=np.float64)
            if self.pred_off.shape != self.pmf.shape[:2] + (NUM_BUCKETS,):
                raise ValueError("pred_off must be [blocks, positions, 4], like pmf's keys")
        top1 = np.clip(self.pmf[..., 0], 1e-6, 1 - 1e-6)
        rest = self.pmf[..., 1:] / np.maximum(1.0 - self.pmf[..., :1], 1e-12)  # P(r=c | r>=1)
        self._top1 = top1
        self._rest_cdf = np.cumsum(rest, axis=-1)
        self._rest_cdf[..., -1] = 1.0
        self._rest_logp = np.log(np.maximum(rest[..., : R - 1], 1e-12))  # candidates 1..R-1
        shared = self.confusion[_BUCKET_OF]  # [R + 1, 4]: P(pred | rank) from the confusion
        if self.joint is None:
            cond = np.broadcast_to(shared, self.pmf.shape + (NUM_BUCKETS,))
        else:  # P(pred | rank, key); ranks the joint gives no mass fall back to the confusion
            mass = self.joint.sum(-1, keepdims=True)
            cond = np.where(mass > 1e-12, self.joint / np.maximum(mass, 1e-300), shared)
        self._pred_cdf = np.cumsum(cond, axis=-1)
        self._pred_cdf[..., -1] = 1.0
        if self.pred_off is not None:
            self._off_cdf = np.cumsum(self.pred_off / self.pred_off.sum(-1, keepdims=True), axis=-1)
            self._off_cdf[..., -1] = 1.0

    @property
    def joint_table(self) -> np.ndarray:
        """``P(rank, pred | key, parent reachable)`` ``[blocks, positions, R + 1, 4]``."""
        if self.joint is not None:
            return self.joint
        return self.pmf[..., None] * self.confusion[_BUCKET_OF]

    @property
    def off_table(self) -> np.ndarray:
        """``P(pred | key)`` at unreachable positions (the bucket marginal when not fitted)."""
        return self.joint_table.sum(-2) if self.pred_off is None else self.pred_off

    @cached_property
    def _posterior(self) -> np.ndarray:
        """``[blocks, positions, pred, true]``: P(true bucket | predicted bucket, key, parent reachable)."""
        byb = np.einsum("mprj,rb->mpjb", self.joint_table, np.eye(NUM_BUCKETS)[_BUCKET_OF])
        mass = byb.sum(-1, keepdims=True)
        return np.where(mass > 1e-12, byb / np.maximum(mass, 1e-300), np.eye(NUM_BUCKETS))  # never predicted: trust it

    def bucket_posterior(self, block: int, pred: np.ndarray) -> np.ndarray:
        """``[S, K, 4]`` for buckets ``pred`` ``[S, K]`` of one block: how likely each true bucket is
        given the prediction at that key. The simulator hands it to tree policies in place of the
        rank head's probabilities, which it does not model (the runtime's differ position by
        position; the sim knows how far each kind of prediction is to be trusted)."""
        b, pos = self._key(block, np.arange(np.shape(pred)[-1]))
        return self._posterior[b, pos, np.asarray(pred)]

    def top1(self, block: int, pos: int) -> float:
        return float(self._top1[self._key(block, pos)])

    def _key(self, block, pos):
        b = np.minimum(np.asarray(block), self.pmf.shape[0] - 1)
        p = np.minimum(np.asarray(pos), self.pmf.shape[1] - 1)
        return b, p

    def sample(
        self, rng: np.random.Generator, block: np.ndarray | int, pos: np.ndarray | int, n_cand: int, size: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Draw ``size`` positions at keys ``(block, pos)`` (ints or arrays of length ``size``).

        Returns ``(rank [size], cand_logprob [size, n_cand], pred_bucket [size])``: the target's
        rank (R = beyond the candidates), the candidates' sorted draft log-probs and the rank
        head's predicted bucket, all for a position whose parent is reachable. Drafters call this
        once per tree (all positions they may need), because per-call numpy overhead, not
        arithmetic, is what costs here.
        """
        if not 1 <= n_cand <= R:
            raise ValueError(f"n_cand must be in 1..{R}")
        b, p = self._key(block, pos)
        a = self._top1[b, p]
        if np.ndim(a) == 0:
            a = np.full(size, a)
        q0 = np.clip(rng.beta(a * self.kappa, (1.0 - a) * self.kappa), 1e-6, 1 - 1e-6)
        u = rng.random((3, size))
        cdf = self._rest_cdf[b, p]
        rest = (u[1][:, None] > cdf).sum(axis=-1) + 1 if cdf.ndim == 2 else np.searchsorted(cdf, u[1], side="right") + 1
        rank = np.where(u[0] < q0, 0, np.minimum(rest, R))
        logp = np.log(q0)[:, None]
        if n_cand > 1:
            tail = np.log1p(-q0)[:, None] + self._rest_logp[b, p, : n_cand - 1]
            # keep candidates sorted (non-increasing) when q0 is small, without reordering ranks
            logp = np.minimum.accumulate(np.concatenate([logp, tail], axis=1), axis=1)
        pred = (u[2][:, None] > self._pred_cdf[b, p, rank]).sum(axis=1)
        return rank, logp, pred

    def sample_pred_off(self, rng: np.random.Generator, block: np.ndarray | int, pos: np.ndarray | int,
                        size: int) -> np.ndarray | None:
        """Predicted buckets at ``size`` positions whose parent is not reachable, or None when
        the model has no such table (then callers keep :meth:`sample`'s buckets everywhere, so
        parametric models draw exactly what they drew before the table existed)."""
        if self.pred_off is None:
            return None
        b, p = self._key(block, pos)
        cdf = np.broadcast_to(self._off_cdf[b, p], (size, NUM_BUCKETS))
        return (rng.random(size)[:, None] > cdf).sum(axis=1)

    def mix(self, other: "RankModel", w: float) -> "RankModel":
        """``(1 - w) * self + w * other`` (the sim's adaptation state interpolates a drafter's
        static pmf towards its adapted one). Tables are broadcast to the larger shape. A position
        pool has no such knob: mixed and lifted models (adaptation what-ifs) drop it and draw from
        their tables."""
        if w <= 0:
            return self
        if w >= 1:
            return other
        shape = tuple(np.maximum(self.pmf.shape, other.pmf.shape))
        conf = (1 - w) * self.confusion + w * other.confusion
        kappa = (1 - w) * self.kappa + w * other.kappa
        if self.joint is None and other.joint is None and self.pred_off is None and other.pred_off is None:
            return RankModel(pmf=(1 - w) * _pad(self.pmf, shape) + w * _pad(other.pmf, shape),
                             confusion=conf, kappa=kappa)
        joint = (1 - w) * _pad(self.joint_table, shape) + w * _pad(other.joint_table, shape)
        off = (1 - w) * _pad(self.off_table, shape) + w * _pad(other.off_table, shape)
        return RankModel(pmf=joint.sum(-1), confusion=conf, kappa=kappa, joint=joint, pred_off=off)

    def lift(self, f: float) -> "RankModel":
        """Move every position's top-1 acceptance a to ``a + f (1 - a)`` (f >= 0) or ``a (1 + f)``
        (f < 0), rescaling the miss ranks proportionally: how the sim's adaptation state acts.
        A joint table keeps its ``P(pred | rank)``; the unreachable buckets are unchanged."""
        if f == 0:
            return self
        top1 = self.pmf[..., :1]
        new = top1 + f * (1 - top1) if f > 0 else top1 * (1 + max(f, -1.0))
        miss = (1 - new) / np.maximum(1 - top1, 1e-12)
        if self.joint is None:
            rest = self.pmf[..., 1:] * miss
            return RankModel(pmf=np.concatenate([new, rest], axis=-1), confusion=self.confusion, kappa=self.kappa,
                             pred_off=self.pred_off)
        j = self.joint
        hit = j[..., :1, :] * (new / np.maximum(top1, 1e-12))[..., None]
        zero = top1[..., 0] <= 1e-12  # no top-1 mass to scale: put the new mass on the rank-0 buckets' prior
        if zero.any():
            hit[zero] = new[zero][..., None] * self.confusion[0][None, None, :]
        joint = np.concatenate([hit, j[..., 1:, :] * miss[..., None]], axis=-2)
        return RankModel(pmf=joint.sum(-1), confusion=self.confusion, kappa=self.kappa, joint=joint,
                         pred_off=self.pred_off)


def _pad(table: np.ndarray, shape) -> np.ndarray:
    """Extend a per-key table (``[blocks, positions, ...]``) to ``shape[:2]`` keys by repeating
    its last block / position."""
    bi = np.minimum(np.arange(shape[0]), table.shape[0] - 1)
    pi = np.minimum(np.arange(shape[1]), table.shape[1] - 1)
    return table[bi][:, pi]


# --------------------------------------------------------------------------- parametric family
@dataclass(frozen=True)
class ParametricShape:
    """Shape of a parametric rank model (all our assumptions; only ``a1`` is fitted to the
    digest's tau, see ``digest.py``).

    * top-1 acceptance at key (m, k): ``a1 * decay**k * block_decay**m`` (capped at 0.98);
    * a miss lands on rank c >= 1 with probability proportional to ``spread**(c-1)``, except a
      share ``tail`` that falls outside the top R (b3 territory);
    * rank head: ``head_accuracy`` on the confusion diagonal; ``kappa`` as in the module doc.
    """

    decay: float = 0.95
    block_decay: float = 1.0
    spread: float = 0.6
    tail: float = 0.3
    head_accuracy: float = 0.7
    kappa: float = 2.0
    blocks: int = 4
    positions: int = 12

    def rank_model(self, a1: float) -> RankModel:
        if not 0 <= a1 <= 1:
            raise ValueError(f"top-1 acceptance a1 must be in [0, 1], got {a1}")
        m = np.arange(self.blocks)[:, None]
        k = np.arange(self.positions)[None, :]
        top1 = np.minimum(a1 * self.decay**k * self.block_decay**m, 0.98)
        geo = self.spread ** np.arange(R - 1)
        rest = np.concatenate([(1 - self.tail) * geo / geo.sum(), [self.tail]])
        pmf = np.concatenate([top1[..., None], (1 - top1)[..., None] * rest], axis=-1)
        return RankModel(pmf=pmf, confusion=default_confusion(self.head_accuracy), kappa=self.kappa)


def iid_rank_model(a: float, kappa: float = 2.0) -> RankModel:
    """Every position accepts its top-1 with probability ``a``, independently (Leviathan et al.'s
    assumption); misses are never among the candidates, so chains and trees agree on tau."""
    pmf = np.zeros((1, 1, R + 1))
    pmf[0, 0, 0], pmf[0, 0, R] = a, 1 - a
    return RankModel(pmf=pmf, kappa=kappa)


#: Per-method shapes (assumptions). EAGLE-3's drafter is autoregressive (slow decay with depth);
#: Medusa's heads predict each position independently (fast decay); SpS's draft LM is a small
#: sibling of the target (near-iid). SpecBlock: in-block decay is stronger than EAGLE-3's per-step
#: decay (positions share one forward) and each later block pays a little for drafter-state
#: inheritance.
#: Medusa's tail (misses outside the top R) is 0.6, not 0.3: on its 63-node static tree, which
#: offers all ten head candidates at depth 1, a 0.3 tail gives tau >= 2.1 even at a1 = 0.05, above
#: the digest's NQ tau of 2.00, so no a1 could fit it.
METHOD_SHAPES = {
    "sps": ParametricShape(decay=0.98, spread=0.5),
    "medusa": ParametricShape(decay=0.80, spread=0.6, tail=0.6),
    "eagle3": ParametricShape(decay=0.96, spread=0.6),
    "specblock": ParametricShape(decay=0.93, block_decay=0.95, spread=0.6),
}
