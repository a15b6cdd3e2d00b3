"""The SimPy engine: requests, the decode loop, domain shifts, background adaptation.

One server process serves requests from a queue: closed loop (every request queued at t = 0,
``max_batch`` at a time; batch 1 is the paper's setting) or Poisson arrivals. Each decoding
iteration drafts one tree per active request with the method model (shared policy objects),
accepts with the shared ``accept_longest``, and charges
``T_iter = sum(drafter forwards) + T_target(sum of tree sizes, ctx, batch) + overhead``; drafter
forwards of a batch run in lockstep (i-th forward of every request together). When adaptation is
on, the GPU is one ``simpy.PriorityResource``: decoding iterations at priority 0, update chunks at
priority 1 (see ``adaptation.py``). Time unit: milliseconds. Each random component has its own
seed (acceptance, arrivals, adaptation), spawned from the run's seed.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import numpy as np
import simpy

from specblock.sim.acceptance import RankModel, iid_rank_model, METHOD_SHAPES
from specblock.sim.config import SimConfig, build_method, latency_for


@dataclass
class Request:
    idx: int
    domain: str
    arrival: float
    tokens_left: int
    ctx: int
    generated: int = 0
    start: float | None = None
    finish: float | None = None


@dataclass
class Counters:
    forwards: int = 0  # target forwards, counted per request (tau's denominator)
    tau_sum: int = 0
    accepted_hist: np.ndarray = field(default_factory=lambda: np.zeros(64, dtype=np.int64))
    iterations: int = 0
    t_iter: float = 0.0
    t_draft: float = 0.0
    t_verify: float = 0.0
    tokens: int = 0
    tree_nodes: int = 0  # nodes verified, roots included, summed over target forwards


class AcceptanceSource:
    """Rank models per (domain, adaptation skill), cached."""

    def __init__(self, cfg: SimConfig, target: str) -> None:
        self.cfg, self.target, self.notes = cfg, target, []
        self._base: dict[str, RankModel] = {}
        self._cache: dict[tuple, RankModel] = {}
        self.model(cfg.acceptance.benchmark, 0.0)  # fail early on bad names / files

    def base(self, domain: str) -> RankModel:
        if domain not in self._base:
            self._base[domain] = self._build(domain)
        return self._base[domain]

    def _build(self, domain: str):  # a RankModel, or a TraceReplay for lookup
        a, m = self.cfg.acceptance, self.cfg.method.name
        if m == "ar" or a.kind == "iid":
            return iid_rank_model(a.a if a.a is not None else 0.0, kappa=a.kappa or 2.0)
        if m == "lookup":  # the config validator guarantees kind == "traces"
            from specblock.sim.lookup import TraceReplay

            return TraceReplay.from_traces(a.traces)
        if a.kind == "traces":
            from specblock.sim.traces import fit_acceptance, has_cuts, read_traces

            recs = read_traces(a.traces)
            mc = self.cfg.method
            if mc.lookup_nodes:  # the drafter's own nodes for its fit, the chains replayed beside it
                from specblock.sim.lookup import BranchSource, Chains, drafter_part

                chains = Chains.from_traces(a.lookup_traces) if a.lookup_traces else Chains.from_records(recs)
                recs = [drafter_part(r) for r in recs]
            if m == "specblock" and mc.branching == "rank" and 0 in mc.widths and not has_cuts(recs):
                self.notes.append("traces have no rank-head cuts (written before the runtime logged them): "
                                  "P(b3) is unseen, so simulated trees and tau come out too large")
            rm = fit_acceptance(recs, m)
            return BranchSource(rm, chains) if mc.lookup_nodes else rm
        shape = METHOD_SHAPES[m]
        over = {k: v for k, v in (("head_accuracy", a.head_accuracy), ("kappa", a.kappa), ("decay", a.decay))
                if v is not None}
        if over:
            from dataclasses import replace

            shape = replace(shape, **over)
        if a.kind == "parametric":
            return shape.rank_model(a.a1)
        from specblock.sim.digest import fitted_a1

        a1, note = fitted_a1(self.cfg.target or self.target, m, domain)
        if note:
            self.notes.append(note)
        return shape.rank_model(a1)

    def model(self, domain: str, skill: float) -> RankModel:
        key = (domain, round(skill, 4))
        if key not in self._cache:
            self._cache[key] = self.base(domain).lift(skill * self.cfg.adapt.headroom if skill > 0 else skill)
        return self._cache[key]


class Simulation:
    def __init__(self, cfg: SimConfig, seed: int, trace_out: str | Path | IO[str] | None = None) -> None:
        self.cfg = cfg
        acc_ss, arr_ss, ad_ss = np.random.SeedSequence(seed).spawn(3)
        self.rng_acc = np.random.default_rng(acc_ss)
        self.rng_arr = np.random.default_rng(arr_ss)
        self.lat, target = latency_for(cfg)
        self.source = AcceptanceSource(cfg, target)
        self.method = build_method(cfg.method)
        self.env = simpy.Environment()
        self.gpu = simpy.PriorityResource(self.env, capacity=1) if cfg.adapt.enabled else None
        self.queue: deque[Request] = deque()
        self.arrived = simpy.Event(self.env)
        self.c = Counters()
        self.done: list[Request] = []
        self.skill: dict[str, float] = {}
        self.adapter = None
        self.pools: dict[tuple, list] = {}
        self._picks: list[float] = []
        # A path is opened (and closed) here; an open file (the CLI's atomic writer) is the caller's.
        self._own_trace = isinstance(trace_out, (str, Path))
        self.trace = open(trace_out, "w") if self._own_trace else trace_out
        if cfg.adapt.enabled:
            from specblock.sim.adaptation import Adapter

            self.adapter = Adapter(self, ad_ss)

    # ------------------------------------------------------------------ workload
    def domain_of(self, i: int) -> str:
        dom = self.cfg.acceptance.benchmark
        for s in sorted(self.cfg.workload.shifts, key=lambda s: s.at_request):
            if i >= s.at_request:
                dom = s.benchmark
        return dom

    def _new_request(self, i: int) -> Request:
        w = self.cfg.workload
        return Request(i, self.domain_of(i), self.env.now, w.tokens, w.prompt_len)

    def arrivals(self):
        w = self.cfg.workload
        for i in range(w.requests):
            yield self.env.timeout(self.rng_arr.exponential(1000.0 / w.rate_per_s))
            self.queue.append(self._new_request(i))
            if not self.arrived.triggered:
                self.arrived.succeed()

    # ------------------------------------------------------------------ decoding
    def step(self, active: list[Request]) -> tuple[float, list]:
        """Draft and verify one iteration for ``active``; returns (ms, drafts)."""
        drafts = [self._draft(r.domain) for r in active]
        b = len(active)
        ctx = sum(r.ctx for r in active) / b
        draft = 0.0
        n_fw = max(len(d.forwards) for d in drafts)
        for i in range(n_fw):
            q = sum(d.forwards[i] for d in drafts if i < len(d.forwards))
            draft += self.lat.draft_ms(self.method.drafter, q, ctx, b, first=i == 0)
        draft += sum(d.host_ms for d in drafts)  # host-side drafting (lookup's search): serial per request
        verify = self.lat.target_ms(sum(d.tree.size for d in drafts), ctx, b)
        t = draft + verify + self.lat.overhead_ms
        if self.adapter is not None and self.adapter.busy:
            t *= 1.0 + self.cfg.adapt.interference
        c = self.c
        c.iterations += 1
        c.t_iter += t
        c.t_draft += draft
        c.t_verify += verify
        if self.trace is not None:
            self._write_trace(active, drafts, draft, verify, t)
        return t, drafts

    def _draft(self, domain: str):
        skill = round(self.skill.get(domain, 0.0), 4)
        size = self.cfg.tree_pool if self.adapter is None else min(self.cfg.tree_pool, self.cfg.adapt.pool)
        rm = self.source.model(domain, skill)
        if size == 0 or not getattr(self.method, "pooled", True):  # a trace replay draws its own records
            return self.method.draft(self.rng_acc, rm)
        pool = self.pools.get((domain, skill))
        if pool is None:
            pool = self.pools[(domain, skill)] = [self.method.draft(self.rng_acc, rm) for _ in range(size)]
        if not self._picks:  # pool indices drawn in batches: one rng call per 4096 iterations
            self._picks = self.rng_acc.random(4096).tolist()
        return pool[int(self._picks.pop() * len(pool))]

    def server(self):
        w = self.cfg.workload
        active: list[Request] = []
        n_done = 0
        while n_done < w.requests:
            while self.queue and len(active) < w.max_batch:
                r = self.queue.popleft()
                r.start = self.env.now
                active.append(r)
            if not active:
                self.arrived = simpy.Event(self.env)
                yield self.arrived
                continue
            t, drafts = self.step(active)
            if self.gpu is not None:
                with self.gpu.request(priority=0) as req:
                    yield req
                    yield self.env.timeout(t)
                # Let the release land before the next request: a queued low-priority chunk then
                # takes the GPU between two iterations, as a background stream's kernels would.
                yield self.env.timeout(0)
            else:
                yield self.env.timeout(t)
            win_tokens = 0
            for r, d in zip(active, drafts):
                acc = d.acceptance.accepted
                self.c.forwards += 1
                self.c.tree_nodes += d.tree.size
                self.c.tau_sum += acc + 1
                self.c.accepted_hist[min(acc, 63)] += 1
                got = min(acc + 1, r.tokens_left)
                r.tokens_left -= got
                r.generated += got
                r.ctx += got
                win_tokens += got
            self.c.tokens += win_tokens
            if self.adapter is not None:
                self.adapter.after_iteration(drafts, win_tokens, t)
            for r in [r for r in active if r.tokens_left == 0]:
                r.finish = self.env.now
                self.done.append(r)
                n_done += 1
            active = [r for r in active if r.tokens_left > 0]

    def run(self) -> dict:
        w = self.cfg.workload
        if w.arrival == "closed":
            self.queue.extend(self._new_request(i) for i in range(w.requests))
        else:
            self.env.process(self.arrivals())
        self.env.process(self.server())
        self.env.run()
        if self.trace is not None and self._own_trace:
            self.trace.close()
        return self.metrics()

    # ------------------------------------------------------------------ outputs
    def metrics(self) -> dict:
        c, w = self.c, self.cfg.workload
        tau = c.tau_sum / c.forwards
        tpot = float(np.mean([(r.finish - r.start) / r.generated for r in self.done]))
        ar = ar_tpot_ms(self.lat, w.prompt_len, w.tokens)
        hist = c.accepted_hist[: max(int(np.nonzero(c.accepted_hist)[0].max()) + 1, 1)]
        reach = hist[::-1].cumsum()[::-1]  # forwards that accepted >= d tokens
        per_depth = [float(reach[d] / reach[d - 1]) for d in range(1, len(reach))]
        out = {
            "speedup": ar / tpot,
            "speedup_iter": tau * ar / (c.t_iter / c.iterations),
            "tau": tau,
            "draft_share": c.t_draft / c.t_iter,
            "tokens_per_s": 1000.0 * c.tokens / self.env.now,
            "tpot_ms": tpot,
            "ar_tpot_ms": ar,
            "tree_size": c.tree_nodes / c.forwards,
            "t_iter_ms": c.t_iter / c.iterations,
            "t_draft_ms": c.t_draft / c.iterations,
            "t_verify_ms": c.t_verify / c.iterations,
            "per_depth_acceptance": per_depth,
            "iterations": c.iterations,
            "tokens": c.tokens,
        }
        if self.adapter is not None:
            out.update(self.adapter.summary())
        if self.source.notes:
            out["notes"] = sorted(set(self.source.notes))
        return out

    def _write_trace(self, active, drafts, draft, verify, t) -> None:
        """The runtime's JSONL trace format (``traces.TraceRecord``), one line per request."""
        for r, d in zip(active, drafts):
            tr = d.tree
            rec = {"iter": self.c.iterations - 1, "ctx": r.ctx, "tree_size": tr.size, "depth": tr.max_depth,
                   "accepted": d.acceptance.accepted, "draft_s": draft / 1e3, "verify_s": verify / 1e3,
                   "commit_s": (t - draft - verify) / 1e3, "domain": r.domain,
                   "nodes": {"parent": tr.parent.tolist(), "depth": tr.depth.tolist(), "rank": tr.rank.tolist(),
                             "bucket": tr.bucket.tolist(), "block": tr.block.tolist(),
                             "correct": d.correct.astype(int).tolist()}}
            if d.cuts is not None:  # the runtime writes cuts for every SpecBlock tree, empty or not
                rec["cuts"] = {"parent": [c[0] for c in d.cuts], "bucket": [c[1] for c in d.cuts],
                               "block": [c[2] for c in d.cuts]}
            self.trace.write(json.dumps(rec) + "\n")


def ar_tpot_ms(lat, prompt_len: int, tokens: int) -> float:
    """Plain autoregressive decoding's time per output token at batch 1 over the same contexts."""
    return float(np.mean([lat.target_ms(1, prompt_len + t, 1) + lat.overhead_ms for t in range(tokens)]))


def simulate(cfg: SimConfig, seed: int | None = None, trace_out: str | Path | IO[str] | None = None) -> dict:
    """One seeded run."""
    return Simulation(cfg, cfg.seed if seed is None else seed, trace_out).run()
