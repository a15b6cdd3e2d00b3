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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from specblock.policies.tree import NUM_BUCKETS, rank_to_bucket

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
    concentration. Keys beyond the table reuse its last block / position (deep positions)."""

    pmf: np.ndarray  # [blocks, positions, R + 1]
    confusion: np.ndarray = field(default_factory=default_confusion)  # [4, 4] P(pred | true)
    kappa: float = 2.0
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.pmf = np.asarray(self.pmf, dtype=np.float64)
        if self.pmf.ndim != 3 or self.pmf.shape[2] != R + 1:
            raise ValueError(f"pmf must be [blocks, positions, {R + 1}]")
        if (self.pmf < 0).any() or not np.allclose(self.pmf.sum(-1), 1.0, atol=1e-6):
            raise ValueError("every rank pmf must be non-negative and sum to 1")
        self.confusion = np.asarray(self.confusion, dtype=np.float64)
        top1 = np.clip(self.pmf[..., 0], 1e-6, 1 - 1e-6)
        rest = self.pmf[..., 1:] / np.maximum(1.0 - self.pmf[..., :1], 1e-12)  # P(r=c | r>=1)
        self._top1 = top1
        self._rest_cdf = np.cumsum(rest, axis=-1)
        self._rest_cdf[..., -1] = 1.0
        self._rest_logp = np.log(np.maximum(rest[..., : R - 1], 1e-12))  # candidates 1..R-1
        self._conf_cdf = np.cumsum(self.confusion, axis=1)
        self._conf_cdf[:, -1] = 1.0

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
        head's predicted bucket. Drafters call this once per tree (all positions they may need),
        because per-call numpy overhead, not arithmetic, is what costs here.
        """
        if not 1 <= n_cand <= R:
            raise ValueError(f"n_cand must be in 1..{R}")
        nb, npos = self.pmf.shape[:2]
        b = np.minimum(block, nb - 1)
        p = np.minimum(pos, npos - 1)
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
        pred = (u[2][:, None] > self._conf_cdf[_BUCKET_OF[rank]]).sum(axis=1)
        return rank, logp, pred

    def mix(self, other: "RankModel", w: float) -> "RankModel":
        """``(1 - w) * self + w * other`` (the sim's adaptation state interpolates a drafter's
        static pmf towards its adapted one). Tables are broadcast to the larger shape."""
        if w <= 0:
            return self
        if w >= 1:
            return other
        shape = np.maximum(self.pmf.shape, other.pmf.shape)
        a, b = _pad(self.pmf, shape), _pad(other.pmf, shape)
        return RankModel(pmf=(1 - w) * a + w * b, confusion=(1 - w) * self.confusion + w * other.confusion,
                         kappa=(1 - w) * self.kappa + w * other.kappa)

    def lift(self, f: float) -> "RankModel":
        """Move every position's top-1 acceptance a to ``a + f (1 - a)`` (f >= 0) or ``a (1 + f)``
        (f < 0), rescaling the miss ranks proportionally: how the sim's adaptation state acts."""
        if f == 0:
            return self
        top1 = self.pmf[..., :1]
        new = top1 + f * (1 - top1) if f > 0 else top1 * (1 + max(f, -1.0))
        rest = self.pmf[..., 1:] * (1 - new) / np.maximum(1 - top1, 1e-12)
        return RankModel(pmf=np.concatenate([new, rest], axis=-1), confusion=self.confusion, kappa=self.kappa)


def _pad(pmf: np.ndarray, shape) -> np.ndarray:
    """Extend a pmf table to ``shape`` by repeating its last block / position."""
    bi = np.minimum(np.arange(shape[0]), pmf.shape[0] - 1)
    pi = np.minimum(np.arange(shape[1]), pmf.shape[1] - 1)
    return pmf[bi][:, pi]


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
METHOD_SHAPES = {
    "sps": ParametricShape(decay=0.98, spread=0.5),
    "medusa": ParametricShape(decay=0.80, spread=0.7),
    "eagle3": ParametricShape(decay=0.96, spread=0.6),
    "specblock": ParametricShape(decay=0.93, block_decay=0.95, spread=0.6),
}
