"""Latency models: how long a target forward, a drafter forward and the per-iteration glue take.

Per decoding iteration the simulator charges (DESIGN.md)
``T_iter = T_draft + T_verify(n_tree, ctx, batch) + T_overhead``, where ``T_draft`` is a sum of
drafter forwards (one per depth for autoregressive drafters, one per block for SpecBlock, one for
Medusa heads). Two kinds of model implement :class:`LatencyModel`:

* :class:`RooflineLatency` (``presets.py``): bytes over bandwidth vs FLOPs over peak, plus overhead;
* :class:`CalibratedLatency`: fitted to a :class:`LatencyMeasurements` JSON that the runtime's
  ``calibrate`` command writes on a real machine, so the sim can be held against real runs.

Everything is in milliseconds. No torch here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from specblock.errors import SpecBlockError


class LatencyModel(Protocol):
    """What the engine asks of a latency model."""

    overhead_ms: float

    def target_ms(self, n: int, ctx: float, batch: int = 1) -> float:
        """One target forward over ``n`` new tokens in total (all requests of the batch together;
        a tree counts its root), each request attending to about ``ctx`` cached tokens."""

    def draft_ms(self, drafter: str, n_query: int, ctx: float, batch: int = 1, first: bool = False) -> float:
        """One drafter forward with ``n_query`` query positions in total (seeds x K for a
        SpecBlock block, the frontier for EAGLE, 1 for Medusa heads and SpS); ``first``: the
        step's first forward, which may run another graph (SpecBlock's compiled block 1)."""


# --------------------------------------------------------------------------- the JSON format
class TargetGrid(BaseModel):
    """Target forward times on a grid: ``ms[i][j]`` is the median time of one forward of ``n[j]``
    new tokens (a tree of that size, root included) at a context of ``ctx[i]`` cached tokens."""

    model_config = ConfigDict(extra="forbid")
    ctx: list[int] = Field(min_length=1)
    n: list[int] = Field(min_length=1)
    ms: list[list[float]]

    @model_validator(mode="after")
    def _shape(self) -> "TargetGrid":
        if len(self.ms) != len(self.ctx) or any(len(r) != len(self.n) for r in self.ms):
            raise ValueError(f"target.ms must be [len(ctx)={len(self.ctx)}][len(n)={len(self.n)}]")
        if sorted(set(self.ctx)) != self.ctx or sorted(set(self.n)) != self.n:
            raise ValueError("target.ctx and target.n must be strictly increasing")
        if min(self.n) < 1 or min(self.ctx) < 0 or min(min(r) for r in self.ms) <= 0:
            raise ValueError("target: n >= 1, ctx >= 0 and every time > 0")
        return self


class DrafterTiming(BaseModel):
    """One drafter's forward time. Either a single ``ms_per_forward`` (measured at one query) or a
    curve ``n_query`` -> ``ms`` (an EAGLE step has one query per frontier node).

    SpecBlock: ``calibrate`` times a later block at S = 1..4 seeds and labels it ``n_query = S*K``,
    while the forward runs S rows of [seed, K queries] = ``S*(K+1)`` positions, which is what the
    sim's method model reports. ``K`` (optional) states that labelling: with it, each point is
    read as ``n_query * (K+1) / K`` positions; without it, labels are positions already.
    ``overhead_ms`` (optional, default 0): host work per drafter forward outside the network
    (tree building, seed selection, gathering seed states), charged on every forward;
    ``calibrate`` measures it from whole ``propose`` calls. ``first_ms`` (optional): a step's first
    forward at one seed where it is not a later block's (SpecBlock's block 1 compiled beside
    later blocks run eagerly: ``drafter_compiled``, ``--compile``); the first forward is then
    priced as the curve plus ``first_ms`` minus the curve at one seed. ``compiled``: whether
    ``calibrate`` ran block 1 compiled (a record; the price is in ``first_ms``)."""

    model_config = ConfigDict(extra="forbid")
    ms_per_forward: float = Field(gt=0)
    n_query: list[int] | None = None
    ms: list[float] | None = None
    K: int | None = Field(None, ge=1)
    overhead_ms: float = Field(0.0, ge=0)
    first_ms: float | None = Field(None, gt=0)
    compiled: bool = False

    @model_validator(mode="after")
    def _curve(self) -> "DrafterTiming":
        if (self.n_query is None) != (self.ms is None):
            raise ValueError("drafter: give both n_query and ms, or neither")
        if self.n_query is not None:
            if len(self.n_query) != len(self.ms) or sorted(set(self.n_query)) != self.n_query:
                raise ValueError("drafter: n_query strictly increasing, same length as ms")
            if min(self.ms) <= 0:
                raise ValueError("drafter: every time must be > 0")
        return self

    def positions(self) -> np.ndarray | None:
        """The curve's x axis in query positions (see ``K``)."""
        if self.n_query is None:
            return None
        q = np.asarray(self.n_query, dtype=np.float64)
        return q * (self.K + 1) / self.K if self.K else q


class LatencyMeasurements(BaseModel):
    """The latency JSON that ``python -m specblock.runtime calibrate`` writes (format v1).

    Example::

        {"version": 1, "device": "cpu: 2 cores", "dtype": "float32",
         "target": {"ctx": [64, 256, 1024], "n": [1, 2, 4, 8, 16, 32, 64],
                    "ms": [[...7 values...], [...], [...]]},
         "drafters": {"specblock": {"ms_per_forward": 3.1, "n_query": [1, 4, 8, 16],
                                    "ms": [2.9, 3.1, 3.4, 4.0]},
                      "eagle3": {"ms_per_forward": 2.2}},
         "overhead_ms": 0.8}

    * ``target``: medians of one target forward per (context, tree size), KV cache already holding
      ``ctx`` tokens, batch 1. Measure n = 1..64 so T_verify's growth with the tree is profiled,
      not assumed flat.
    * ``drafters``: keys are the sim's drafter names (``specblock``, ``eagle3``, ``medusa``,
      ``sps``); one forward each, excluding target work.
    * ``overhead_ms``: per-iteration glue outside the two forwards (tree building, acceptance,
      KV pruning, sampling), measured as iteration time minus draft and verify time.
    * ``compiled``: timed on the compiled target and drafter (``calibrate --compile``).
    """

    model_config = ConfigDict(extra="forbid")
    version: int = 1
    device: str
    dtype: str
    compiled: bool = False
    target: TargetGrid
    drafters: dict[str, DrafterTiming] = Field(default_factory=dict)
    overhead_ms: float = Field(ge=0)

    @field_validator("version")
    @classmethod
    def _v(cls, v: int) -> int:
        if v != 1:
            raise ValueError(f"unsupported latency JSON version {v} (this sim reads version 1)")
        return v


def load_measurements(path: str | Path) -> LatencyMeasurements:
    """Read and validate a latency JSON. Raises FileNotFoundError / pydantic ValidationError."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(
            f"latency file {p} not found; write it with `python -m specblock.runtime calibrate --out {p}`"
        )
    try:
        return LatencyMeasurements.model_validate(json.loads(p.read_text(encoding="utf-8")))
    except (ValueError, UnicodeDecodeError) as e:  # bad JSON, bad bytes, or fields that do not validate
        detail = (" ".join(str(e).split())[:200] if not isinstance(e, ValidationError) else
                  "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors()[:3]))
        raise SpecBlockError(f"latency file {p} is not a valid calibration ({detail}); "
                             f"write it with `python -m specblock.runtime calibrate --out {p}`") from None


# --------------------------------------------------------------------------- the fit
@dataclass
class TargetFit:
    """``ms ~ a + b*n + c*ctx + d*n*ctx`` by least squares over the grid.

    Why bilinear: on every real machine a forward is a fixed cost plus terms linear in new tokens
    (GEMMs), in context (KV reads) and in their product (attention scores). Inside the measured
    grid we interpolate the measurements themselves (exact at grid points); the fit is used only
    to extrapolate beyond the grid, where it degrades gracefully instead of clamping.
    """

    coef: np.ndarray  # a, b, c, d
    ctx: np.ndarray
    n: np.ndarray
    ms: np.ndarray
    max_rel_residual: float

    def predict(self, n: float, ctx: float) -> float:
        a, b, c, d = self.coef
        return float(a + b * n + c * ctx + d * n * ctx)

    def __call__(self, n: float, ctx: float) -> float:
        inside = self.n[0] <= n <= self.n[-1] and self.ctx[0] <= ctx <= self.ctx[-1]
        if not inside:
            return max(self.predict(n, ctx), 1e-3)
        # Bilinear interpolation on the measured grid (piecewise linear in n, then in ctx).
        rows = np.array([np.interp(n, self.n, r) for r in self.ms])
        return float(np.interp(ctx, self.ctx, rows))


def fit_target(grid: TargetGrid) -> TargetFit:
    ctx = np.asarray(grid.ctx, dtype=np.float64)
    n = np.asarray(grid.n, dtype=np.float64)
    ms = np.asarray(grid.ms, dtype=np.float64)
    cc, nn = np.meshgrid(ctx, n, indexing="ij")
    x = np.stack([np.ones(cc.size), nn.ravel(), cc.ravel(), (nn * cc).ravel()], axis=1)
    coef, *_ = np.linalg.lstsq(x, ms.ravel(), rcond=None)
    resid = np.abs(x @ coef - ms.ravel()) / ms.ravel()
    return TargetFit(coef=coef, ctx=ctx, n=n, ms=ms, max_rel_residual=float(resid.max()))


@dataclass
class CalibratedLatency:
    """A :class:`LatencyModel` from measurements on one machine.

    Batches (ours, the calibrate command measures batch 1): a batch of B requests with n tokens in
    total at context ctx each is charged as one forward of n tokens at context ``ctx * B`` (same
    weights read once, B times the KV). Drafter forwards interpolate the curve over query
    positions (``DrafterTiming.positions``; linear, clamped below its first point) or use
    ``ms_per_forward``; beyond the last point the last segment's slope continues (not a scaling
    proportional to queries: a small drafter's forward is mostly fixed cost, 5.3 ms at 1 seed
    and 6.2 at 4 on the lab CPU), plus the drafter's per-forward ``overhead_ms``.
    """

    meas: LatencyMeasurements
    fit: TargetFit = field(init=False)
    overhead_ms: float = field(init=False)

    def __post_init__(self) -> None:
        self.fit = fit_target(self.meas.target)
        self.overhead_ms = float(self.meas.overhead_ms)

    def target_ms(self, n: int, ctx: float, batch: int = 1) -> float:
        return self.fit(float(n), float(ctx) * max(batch, 1))

    def draft_ms(self, drafter: str, n_query: int, ctx: float, batch: int = 1, first: bool = False) -> float:
        try:
            t = self.meas.drafters[drafter]
        except KeyError:
            raise KeyError(
                f"latency file has no drafter {drafter!r} (has {sorted(self.meas.drafters)})"
            ) from None
        if t.n_query is None:
            return (t.first_ms if first and t.first_ms is not None else t.ms_per_forward) + t.overhead_ms
        q, ms = t.positions(), np.asarray(t.ms, float)
        if n_query > q[-1]:
            slope = max((ms[-1] - ms[-2]) / (q[-1] - q[-2]), 0.0) if q.size > 1 else 0.0
            curve = float(ms[-1] + slope * (n_query - q[-1]))
        else:
            curve = float(np.interp(n_query, q, ms))
        shift = t.first_ms - float(ms[0]) if first and t.first_ms is not None else 0.0  # block 1 against a later block at one seed
        return max(curve + shift, 0.0) + t.overhead_ms

    def tau_needed(self, n: int, ctx: float, speedup: float = 2.0, draft_share: float = 0.2) -> float:
        """The tau a tree of ``n`` tokens needs for ``speedup`` when drafting takes ``draft_share``
        of each iteration: T_iter = (T(n) + glue) / (1 - share), Spd = tau (T(1) + glue) / T_iter."""
        glue = self.overhead_ms
        return speedup * (self.target_ms(n, ctx) + glue) / ((1.0 - draft_share) * (self.target_ms(1, ctx) + glue))


@dataclass
class TableLatency:
    """Hand-set latencies (the ``paper`` preset and tests): a target forward costs
    ``t1_ms`` for one token and ``verify_ms(n)`` for a tree of n > 1 tokens, linear in n between
    ``verify_ms`` at ``n_ref`` and ``verify_ms + slope_ms_per_token * (n - n_ref)``; drafters cost
    a fixed time per forward (``draft_ms_per_forward[name]``) plus ``draft_ms_per_query`` per
    query beyond the first. Context-independent on purpose: the digest quotes no context."""

    t1_ms: float
    verify_ms: float
    draft_ms_per_forward: dict[str, float]
    overhead_ms: float = 0.0
    n_ref: int = 1
    slope_ms_per_token: float = 0.0
    draft_ms_per_query: float = 0.0

    def target_ms(self, n: int, ctx: float, batch: int = 1) -> float:
        if n <= 1:
            return self.t1_ms
        # never below a one-token forward: a tree forward reads the same weights
        return max(self.verify_ms + self.slope_ms_per_token * (n - self.n_ref), self.t1_ms)

    def draft_ms(self, drafter: str, n_query: int, ctx: float, batch: int = 1, first: bool = False) -> float:
        try:
            base = self.draft_ms_per_forward[drafter]
        except KeyError:
            raise KeyError(f"latency preset has no drafter {drafter!r}") from None
        return base + self.draft_ms_per_query * max(n_query - 1, 0)
