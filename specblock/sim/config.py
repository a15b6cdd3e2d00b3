"""Configuration models: pydantic at the boundary (CLI, YAML sweeps, JSON next to results).

Inside, the engine works with plain dataclasses and policy objects built by :func:`build_method`.
A config's hash (:func:`config_hash`) keys the sweep cache, so every field that changes a result
lives here, seeds included.
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from specblock.policies import loading
from specblock.policies.branching import (
    ChainBranching,
    DynamicBranching,
    RankBucketBranching,
    TopKBranching,
    TreePolicy,
)
from specblock.policies.seeds import DeepestConfidentSeeds, SeedPolicy, TopScoreSeeds

METHODS = ("ar", "sps", "medusa", "eagle3", "specblock", "lookup")
#: Methods that take prompt lookup's branch (``method.lookup_nodes``, the runtime's ``METHOD+lookup``)
BRANCHED = ("sps", "medusa", "eagle3", "specblock")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MethodCfg(_Strict):
    """Which method, its tree geometry and its policies. Unused fields are ignored per method.

    ``policy_class`` / ``seed_class`` ("package.module:Class", kwargs in ``*_kwargs``) drop a
    user's TreePolicy / SeedPolicy subclass into the sim, the same class the runtime takes.
    """

    name: Literal["ar", "sps", "medusa", "eagle3", "specblock", "lookup"] = "specblock"
    # SpecBlock (digest defaults K = 4, M = 2; seeds and budget are ours: the digest is silent)
    K: int = Field(4, ge=1, le=16)
    M: int = Field(2, ge=1, le=8)
    max_seeds: int = Field(4, ge=1, le=64)
    widths: tuple[int, int, int, int] = (2, 4, 10, 0)
    branching: Literal["rank", "topk", "dynamic", "chain"] = "rank"
    topk: int = Field(2, ge=1, le=16)
    seeds: Literal["deepest-confident", "top-score"] = "deepest-confident"
    min_prob: float = Field(0.0, ge=0, le=1)
    use_rank_head: bool = True
    # EAGLE-3 / Medusa / SpS
    depth: int = Field(7, ge=1, le=16)
    top_k: int = Field(10, ge=1, le=16)
    heads: int = Field(4, ge=1, le=8)
    medusa_top_k: int = Field(10, ge=1, le=16)
    # Medusa's calibrated accuracy table [heads][top_k] (the runtime drafter's config.json
    # ``rank_acc``): the sim then builds the very static tree the runtime verifies; None: the
    # table comes from the acceptance model's rank pmf (``methods.StaticTreeDrafter``)
    rank_acc: list[list[float]] | None = None
    gamma: int = Field(5, ge=1, le=16)
    # Prompt lookup (a replay of runtime traces, ``lookup.py``): truncate the replayed trees to
    # this depth; a fixed n-gram search cost instead of each record's measured draft time
    lookup_depth: int | None = Field(None, ge=0)
    search_ms: float | None = Field(None, ge=0)
    # METHOD+lookup (sps, medusa, eagle3, specblock): the most nodes prompt lookup's branch takes of
    # the whole tree's ``budget`` (the runtime's ``lookup_nodes``); its chains are replayed from
    # traces (``lookup.LookupBranchModel``); 0: no branch
    lookup_nodes: int = Field(0, ge=0, le=16)
    # with a budget: it stays the drafter's own and the chain comes on top (the runtime's lookup_on_top);
    # without one the drafter's default is always its own
    lookup_on_top: bool = False
    budget: int | None = Field(None, ge=1, le=512)
    policy_class: str | None = None
    policy_kwargs: dict = Field(default_factory=dict)
    seed_class: str | None = None
    seed_kwargs: dict = Field(default_factory=dict)

    @model_validator(mode="after")
    def _widths(self) -> "MethodCfg":
        if min(self.widths) < 0 or max(self.widths) > 16:
            raise ValueError("method.widths: four widths (b0..b3) in 0..16")
        if self.rank_acc is not None:
            a = self.rank_acc
            if len(a) < self.heads or any(len(r) < self.medusa_top_k for r in a[: self.heads]) or \
                    any(not 0 <= x <= 1 for r in a for x in r):
                raise ValueError(f"method.rank_acc: a [heads={self.heads}][medusa_top_k={self.medusa_top_k}] table "
                                 "of accuracies in [0, 1]")
        return self


class AcceptanceCfg(_Strict):
    """Where ranks come from.

    * ``digest``: parametric shape per method, top-1 scale fitted to the digest's tau for the
      preset's target, this method and ``benchmark`` (see ``digest.py``);
    * ``parametric``: the method's shape with ``a1`` given here;
    * ``iid``: every position accepts its top-1 with probability ``a`` (Leviathan's assumption);
    * ``traces``: fitted from runtime JSONL traces (``traces``: paths).
    """

    kind: Literal["digest", "parametric", "iid", "traces"] = "digest"
    benchmark: str = "mean"
    a: float | None = Field(None, ge=0, le=1)
    a1: float | None = Field(None, ge=0, le=1)
    head_accuracy: float | None = Field(None, ge=0, le=1)
    kappa: float | None = Field(None, gt=0)
    decay: float | None = Field(None, gt=0, le=1)
    traces: list[str] = Field(default_factory=list)
    # METHOD+lookup: traces whose lookup chains are replayed (a ``lookup`` run's, or a
    # ``METHOD+lookup`` run's); empty: the chains in ``traces``
    lookup_traces: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _need(self) -> "AcceptanceCfg":
        if self.kind == "iid" and self.a is None:
            raise ValueError("acceptance.kind=iid needs acceptance.a")
        if self.kind == "parametric" and self.a1 is None:
            raise ValueError("acceptance.kind=parametric needs acceptance.a1")
        if self.kind == "traces" and not self.traces:
            raise ValueError("acceptance.kind=traces needs acceptance.traces (JSONL paths)")
        return self


class ShiftCfg(_Strict):
    """From request ``at_request`` on, traffic comes from ``benchmark`` (a domain shift)."""

    at_request: int = Field(ge=0)
    benchmark: str


class WorkloadCfg(_Strict):
    requests: int = Field(200, ge=1)
    tokens: int = Field(256, ge=1)
    prompt_len: int = Field(512, ge=0)
    arrival: Literal["closed", "poisson"] = "closed"
    rate_per_s: float = Field(1.0, gt=0)
    max_batch: int = Field(1, ge=1, le=256)
    shifts: list[ShiftCfg] = Field(default_factory=list)


class AdaptCfg(_Strict):
    """Serving-time adaptation in the sim (issue 6's bandit and rollback drive it).

    The drafter's state per domain is a *skill* s: top-1 acceptance moves from its static value
    towards ``a + headroom * (1 - a)`` as s goes to 1 (negative s: worse than static). Update
    effects, costs and the interference factor are our assumptions until measured on real runs.
    """

    enabled: bool = False
    window: int = Field(256, ge=4)  # decoding iterations per window (smaller: noisier gains)
    headroom: float = Field(0.5, ge=0, le=1)
    heads_ms: float = Field(40.0, ge=0)  # GPU time of one heads-only update
    full_ms: float = Field(600.0, ge=0)  # ... of one full-backbone update (> 10x heads, digest)
    chunk_ms: float = Field(5.0, gt=0)  # background work is scheduled in chunks this long
    interference: float = Field(0.05, ge=0)  # decoding slowdown while an update is in flight
    heads_rate: float = Field(0.4, ge=0, le=1)
    heads_cap: float = Field(0.8, ge=0, le=1)  # heads-only absorbs most of the drift, not all
    full_rate: float = Field(0.4, ge=0, le=1)
    full_bad_prob: float = Field(0.1, ge=0, le=1)  # a full update sometimes hurts
    full_bad_drop: float = Field(0.5, ge=0)
    always: Literal["heads", "full"] | None = None  # ablations: no bandit
    no_heads_arm: bool = False
    ewma: float = Field(0.3, gt=0, le=1)
    explore: float = Field(1.0, ge=0)
    rollback_tolerance: float = Field(0.06, ge=0)
    # A user's bandit (CostAwareBandit subclass) and rollback rule (ThreeWindowRollback subclass),
    # "package.module:Class": the classes the runtime's --adapt-policy / --rollback-policy take.
    # The sim passes arms, seed, ewma and explore (tolerance for the rollback) where the class
    # takes them; ``*_kwargs`` override those.
    policy_class: str | None = None
    policy_kwargs: dict = Field(default_factory=dict)
    rollback_class: str | None = None
    rollback_kwargs: dict = Field(default_factory=dict)
    pool: int = Field(256, ge=0)  # trees pooled per drafter state (states change with every update)


class TableCfg(_Strict):
    """Hand-set latencies for ``preset: table`` (what-if studies, the closed-form check); see
    ``latency.TableLatency``."""

    t1_ms: float = Field(gt=0)
    verify_ms: float = Field(gt=0)
    draft_ms_per_forward: dict[str, float] = Field(default_factory=dict)
    overhead_ms: float = Field(0.0, ge=0)
    n_ref: int = Field(1, ge=1)
    slope_ms_per_token: float = Field(0.0, ge=0)
    draft_ms_per_query: float = Field(0.0, ge=0)


class SimConfig(_Strict):
    preset: str = "paper"
    latency_file: str | None = None
    table: TableCfg | None = None  # required by preset "table"
    target: str | None = None  # acceptance target key; default: the preset's model
    method: MethodCfg = Field(default_factory=MethodCfg)
    acceptance: AcceptanceCfg = Field(default_factory=AcceptanceCfg)
    workload: WorkloadCfg = Field(default_factory=WorkloadCfg)
    adapt: AdaptCfg = Field(default_factory=AdaptCfg)
    seed: int = Field(0, ge=0, lt=2**63)  # numpy's SeedSequence takes no negative seed
    n_seeds: int = Field(1, ge=1, le=64)
    # Trees per domain drafted up front and then resampled per iteration (a bootstrap of the tree
    # distribution: draft + acceptance depend on the rank model only, not on context). Why: the
    # shared tree code costs ~1-3 ms per tree on 2 busy cores, too slow for sweeps; 1024 trees
    # add ~1% relative s.e. to tau (seeds' CIs include it). 0 = draft a fresh tree every
    # iteration (exact). With adaptation, pools are per drafter state, of size min(this, adapt.pool).
    tree_pool: int = Field(1024, ge=0)

    @model_validator(mode="after")
    def _lookup_replays(self) -> "SimConfig":
        if self.method.name == "lookup" and self.acceptance.kind != "traces":
            raise ValueError("method lookup replays runtime traces: set acceptance.kind=traces and acceptance.traces")
        if self.method.name == "lookup" and self.adapt.enabled:
            raise ValueError("method lookup has no drafter to adapt: adapt.enabled must be false")
        if self.method.lookup_nodes:
            if self.method.name not in BRANCHED:
                raise ValueError(f"method.lookup_nodes: a lookup branch needs a drafter ({', '.join(BRANCHED)}), "
                                 f"not {self.method.name}")
            if self.acceptance.kind != "traces":
                raise ValueError("method.lookup_nodes replays lookup chains from runtime traces: set "
                                 "acceptance.kind=traces (and acceptance.lookup_traces for chains from other traces)")
        if self.method.lookup_on_top and not self.method.lookup_nodes:
            raise ValueError("method.lookup_on_top places prompt lookup's branch: set method.lookup_nodes too")
        return self


def latency_for(cfg: "SimConfig"):
    """(latency model, target key) for a config."""
    from specblock.sim.latency import TableLatency
    from specblock.sim.presets import latency_preset

    if cfg.preset == "table":
        if cfg.table is None:
            raise ValueError("preset 'table' needs a `table:` section (t1_ms, verify_ms, ...)")
        return TableLatency(**cfg.table.model_dump()), cfg.target or "llama3.1-8b"
    return latency_preset(cfg.preset, cfg.latency_file)


def config_hash(cfg: SimConfig) -> str:
    blob = json.dumps(cfg.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def tree_policy(m: MethodCfg) -> TreePolicy:
    if m.policy_class:  # the runtime's --policy goes through the same loader
        return loading.build(m.policy_class, m.policy_kwargs, TreePolicy, "method.policy_class",
                             kwargs_flag="method.policy_kwargs")
    return {
        "rank": lambda: RankBucketBranching(widths_by_bucket=tuple(m.widths)),
        "topk": lambda: TopKBranching(k=m.topk),
        "dynamic": lambda: DynamicBranching(top_k=m.top_k),
        "chain": ChainBranching,
    }[m.branching]()


def seed_policy(m: MethodCfg) -> SeedPolicy:
    if m.seed_class:
        return loading.build(m.seed_class, m.seed_kwargs, SeedPolicy, "method.seed_class", kwargs_flag="method.seed_kwargs")
    if m.seeds == "top-score":
        return TopScoreSeeds()
    return DeepestConfidentSeeds(min_prob=m.min_prob)


def build_method(m: MethodCfg):
    """Policy objects and method model for a config (the runtime builds the same policies)."""
    from specblock.sim import methods as mm

    if m.lookup_nodes:  # the drafter at whatever budget the chain leaves it (lookup.LookupBranchModel)
        from specblock.sim.lookup import LookupBranchModel

        def inner(budget: int):
            return build_method(m.model_copy(update={"lookup_nodes": 0, "budget": budget}))

        # as in the runtime (lookup_branch.with_branch): the drafter's default budget stays its own and
        # the chain comes on top; a budget given is the whole tree's, shared, unless lookup_on_top
        on_top = m.lookup_on_top or m.budget is None
        own = m.budget if m.budget is not None else build_method(m.model_copy(update={"lookup_nodes": 0})).budget
        return LookupBranchModel(inner=inner, nodes=m.lookup_nodes, budget=own + m.lookup_nodes if on_top else own,
                                 search_ms=m.search_ms or 0.0, inner_budget=own if on_top else None)
    if m.name == "ar":
        return mm.Autoregressive()
    if m.name == "lookup":
        from specblock.sim.lookup import LookupReplay

        return LookupReplay(max_depth=m.lookup_depth, search_ms=m.search_ms)
    if m.name == "sps":
        return mm.sps(m.gamma, m.budget)
    if m.name == "medusa":
        if m.policy_class:  # a user's branching over the heads' candidates instead of the static tree
            seeds = seed_policy(m) if m.seed_class else mm.TopScoreSeeds()
            return mm.DepthwiseDrafter(policy=tree_policy(m), seeds=seeds,
                                       depth=m.heads, n_cand=m.medusa_top_k, max_frontier=8, budget=m.budget or 63,
                                       forward_per_depth=False, drafter="medusa", name="medusa")
        return mm.medusa(heads=m.heads, top_k=m.medusa_top_k, budget=m.budget or 63, rank_acc=m.rank_acc)
    if m.name == "eagle3":
        d = mm.eagle3(depth=m.depth, top_k=m.top_k, budget=m.budget or 60)
        if m.policy_class:
            d.policy = tree_policy(m)
        if m.seed_class:
            d.seeds = seed_policy(m)
        return d
    return mm.SpecBlockDrafter(policy=tree_policy(m), seeds=seed_policy(m), K=m.K, M=m.M,
                               max_seeds=m.max_seeds, budget=m.budget or 48, use_rank_head=m.use_rank_head)
