"""A latency JSON fitted from runtime traces instead of isolated ``calibrate`` timings.

Isolated timings run faster than the same work inside the decode loop (caches, allocator, the
host work around each call): on the lab CPU the traces' verify ms sit ~20-25% above calibrate's
target forward for the same tree size. ``sim_fidelity --latency-from traces`` therefore prices
the sim with this module's fit, made on traces of *other* domains than the row it evaluates.

The models, chosen to be simple and robust (few iterations per trace file, noisy timings):

* tree forward (``verify_s`` of every non-AR iteration with ``tree_size >= 2``):
  ``ms = a + b*n + c*ctx`` by least squares, refit once without iterations whose residual is
  above 4 robust sigmas (1.4826 * MAD): a stall or a page fault must not tilt the line; for a
  compiled run ``n`` is the tree's padded bucket (``specblock/buckets.py``), a step in its size;
* AR per token (``draft_s + verify_s + commit_s`` of the ``ar`` traces, one token each):
  ``ms = a + c*ctx``, same robust least squares. A negative context slope (either fit) cannot be a
  cost: it is drift between runs of different domains (their contexts differ), so the fit is then
  redone without the context term (``c = 0``). The sim prices an AR token as
  ``target_ms(1, ctx) + overhead_ms``, so the n = 1 column of the grid is this line minus the glue;
* glue (``overhead_ms``): mean ``commit_s`` of the method's own iterations (per iteration);
* drafting: the calibrate drafter curves are kept; their missing per-forward host cost is fitted
  by the caller (``draft_overhead``) and set as ``DrafterTiming.overhead_ms``.

The result is an ordinary :class:`LatencyMeasurements` whose grid holds the linear models at its
corners (bilinear interpolation reproduces a linear model exactly), so the sim needs no new code
path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from specblock.buckets import bucket_of
from specblock.sim.latency import LatencyMeasurements, TargetGrid

#: grid n: 1 (AR) and tree sizes 2..N_MAX (linear in between, exact for a linear model)
N_MAX = 1024
CTX_MAX = 1 << 16


def robust_lstsq(x: np.ndarray, y: np.ndarray, k_sigma: float = 4.0) -> np.ndarray:
    """Least squares, refit once without points whose residual exceeds ``k_sigma`` robust sigmas."""
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    r = y - x @ coef
    r = r - np.median(r)  # outliers pull the first fit off the bulk: measure from the bulk's centre
    sigma = 1.4826 * float(np.median(np.abs(r)))
    keep = np.abs(r) <= k_sigma * sigma if sigma > 0 else np.ones(y.size, bool)
    if keep.sum() >= x.shape[1] and not keep.all():
        coef, *_ = np.linalg.lstsq(x[keep], y[keep], rcond=None)
    return coef


def _design(ctx: np.ndarray, *cols: np.ndarray) -> np.ndarray:
    # a constant column only for ctx when it varies (a single-context fit stays determined)
    return np.stack([np.ones(ctx.size), *cols, ctx], axis=1)


@dataclass
class TraceLatencyFit:
    """``tree``: (a, b, c) of ``a + b*n + c*ctx`` ms; ``ar``: (a, c) of ``a + c*ctx`` ms per AR
    token, glue included; ``glue_ms``: per-iteration glue; counts of iterations behind each."""

    tree: tuple[float, float, float]
    ar: tuple[float, float]
    glue_ms: float
    n_tree: int
    n_ar: int
    buckets: tuple[int, ...] | None = None  # a compiled run's tree sizes: n is priced as its bucket

    def tree_ms(self, n: float, ctx: float) -> float:
        a, b, c = self.tree
        return a + b * self.size(n) + c * ctx

    def size(self, n: float) -> float:
        """The rows a tree of ``n`` nodes runs: ``n``, or its bucket on a compiled target."""
        return float(n) if self.buckets is None else float(bucket_of(int(np.ceil(n)), self.buckets))

    def ar_ms(self, ctx: float) -> float:
        a, c = self.ar
        return a + c * ctx


def fit_trace_latency(tree_recs: Iterable, ar_recs: Iterable, glue_recs: Iterable | None = None,
                      buckets: tuple[int, ...] | None = None) -> TraceLatencyFit:
    """Fit the models above. ``tree_recs``: non-AR trace records (anything with ``tree_size``,
    ``ctx``, ``verify_s``; size-1 trees are ignored); ``ar_recs``: AR records; ``glue_recs``: the
    records whose mean ``commit_s`` is the glue (default: ``tree_recs``); ``buckets``: the runs were
    compiled, their trees padded to these sizes, so the line is fitted over (and prices) each tree's
    bucket, not its size: a step function of the size. Why: on the compiled real model a 7-node
    tree runs 8 rows; fitted over sizes, the line priced a 7-node tree 1.6 ms above the 14.0 ms
    it took. Raises ValueError when there are too few points."""
    tree = [r for r in tree_recs if r.tree_size >= 2]
    ar = list(ar_recs)
    glue = tree if glue_recs is None else list(glue_recs)
    if len(tree) < 3 or len(ar) < 2 or not glue:
        raise ValueError(f"trace latency fit: too few iterations (trees {len(tree)}, ar {len(ar)}, glue {len(glue)})")
    n = np.array([r.tree_size if buckets is None else bucket_of(r.tree_size, buckets) for r in tree], float)
    ctx = np.array([r.ctx for r in tree], float)
    y = 1e3 * np.array([r.verify_s for r in tree])
    if np.ptp(ctx) > 0:
        tc = robust_lstsq(_design(ctx, n), y)
    else:  # one context only: no ctx term
        a, b = robust_lstsq(np.stack([np.ones(n.size), n], axis=1), y)
        tc = np.array([a, b, 0.0])
    if tc[2] < 0:  # no slower with less context: drift between runs, not a cost; drop the term
        a, b = robust_lstsq(np.stack([np.ones(n.size), n], axis=1), y)
        tc = np.array([a, b, 0.0])
    actx = np.array([r.ctx for r in ar], float)
    ay = 1e3 * np.array([r.draft_s + r.verify_s + r.commit_s for r in ar])
    ac = robust_lstsq(_design(actx), ay) if np.ptp(actx) > 0 else np.array([0.0, -1.0])
    if ac[1] < 0:
        ac = np.array([float(robust_lstsq(np.ones((ay.size, 1)), ay)[0]), 0.0])
    g = 1e3 * float(np.mean([r.commit_s for r in glue]))
    return TraceLatencyFit(tree=tuple(float(x) for x in tc), ar=tuple(float(x) for x in ac), glue_ms=g,
                           n_tree=len(tree), n_ar=len(ar), buckets=buckets)


def latency_json(base: LatencyMeasurements, fit: TraceLatencyFit,
                 draft_overhead_ms: dict[str, float] | None = None) -> LatencyMeasurements:
    """``base`` (calibrate's JSON: device, dtype, drafter curves) with its target grid and glue
    replaced by ``fit``, and the drafters' per-forward host cost set from ``draft_overhead_ms``."""
    floor = 1e-3
    ctxs, ns = [0, CTX_MAX], [1, 2, N_MAX]
    if fit.buckets is not None:  # a step function: a grid point at every size up to the largest bucket
        ns = sorted({1, *range(2, max(fit.buckets) + 1), N_MAX})
    ms = [[max(fit.ar_ms(c) - fit.glue_ms, floor)] + [max(fit.tree_ms(n, c), floor) for n in ns[1:]] for c in ctxs]
    out = base.model_copy(deep=True)
    out.target = TargetGrid(ctx=ctxs, n=ns, ms=ms)
    out.overhead_ms = max(fit.glue_ms, 0.0)
    out.device = f"{base.device} (fitted from runtime traces)"
    for name, oh in (draft_overhead_ms or {}).items():
        if name in out.drafters and oh is not None:
            out.drafters[name].overhead_ms = max(float(oh), 0.0)
    return out
