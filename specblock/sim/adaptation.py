"""Background adaptation in the sim, driven by the runtime's own bandit and rollback classes.

Every ``window`` decoding iterations the adapter closes a window (tau, tokens/s) and:

1. gives the bandit the gain of the arm played before: relative tokens/s change from the mean of
   the three windows before the arm to the first whole window after its update landed; its cost: the update's GPU
   time as a fraction of that window's wall time (same unit, so the bandit can subtract them);
2. asks the rollback policy about the window's tau; "rollback" restores the drafter state from
   before the update on probation;
3. if no update is in flight, asks the bandit for the next arm and, for heads/full, starts an
   update job: GPU work in ``chunk_ms`` chunks at low priority on the shared PriorityResource,
   decoding slowed by ``interference`` while the job is in flight.

The drafter state is a per-domain *skill* (``AdaptCfg``): heads-only moves it towards
``heads_cap`` (they absorb most calibration drift), full towards 1, and a full update hurts with
probability ``full_bad_prob`` (our assumption, so that the rollback has something to catch).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specblock.policies import loading
from specblock.policies.bandit import CostAwareBandit, FixedArm
from specblock.policies.rollback import ThreeWindowRollback


@dataclass
class _Pending:
    arm: str
    before: float  # tokens/s of the window closed when the arm was chosen
    cost_ms: float
    applied_at: int | None  # window index in progress when the update landed


class Adapter:
    def __init__(self, sim, seed_seq: np.random.SeedSequence) -> None:
        self.sim = sim
        self.cfg = sim.cfg.adapt
        self.rng = np.random.default_rng(seed_seq)
        seed = int(self.rng.integers(2**31))
        arms = ("skip", "full") if self.cfg.no_heads_arm else ("skip", "heads", "full")
        if self.cfg.policy_class:  # a user's bandit, loaded as the runtime's --adapt-policy is
            self.bandit = loading.build(self.cfg.policy_class, self.cfg.policy_kwargs, CostAwareBandit,
                                        "adapt.policy_class", kwargs_flag="adapt.policy_kwargs",
                                        defaults={"arms": arms, "seed": seed, "ewma": self.cfg.ewma,
                                                  "explore": self.cfg.explore})
        elif self.cfg.always:
            self.bandit = FixedArm(arms=arms if self.cfg.always in arms else ("skip", self.cfg.always),
                                   arm=self.cfg.always, seed=seed)
        else:
            self.bandit = CostAwareBandit(arms=arms, ewma=self.cfg.ewma, explore=self.cfg.explore, seed=seed)
        if self.cfg.rollback_class:
            self.rollback = loading.build(self.cfg.rollback_class, self.cfg.rollback_kwargs, ThreeWindowRollback,
                                          "adapt.rollback_class", kwargs_flag="adapt.rollback_kwargs",
                                          defaults={"tolerance": self.cfg.rollback_tolerance})
        else:
            self.rollback = ThreeWindowRollback(tolerance=self.cfg.rollback_tolerance)
        self.busy = False
        self.pending: _Pending | None = None
        self.win = 0
        self._w_iters = self._w_tau = self._w_tokens = 0
        self._w_time = 0.0
        self.played = {a: 0 for a in ("skip", "heads", "full")}
        self.update_ms = 0.0
        self.window_tau: list[float] = []
        self.window_tps: list[float] = []

    @property
    def domain(self) -> str:
        return self.sim.domain_of(max(len(self.sim.done), 0))

    def after_iteration(self, drafts, tokens: int, t_ms: float) -> None:
        self._w_iters += 1
        self._w_tau += sum(d.acceptance.accepted + 1 for d in drafts) / len(drafts)
        self._w_tokens += tokens
        self._w_time += t_ms
        if self._w_iters >= self.cfg.window:
            self._close_window()

    def _close_window(self) -> None:
        tau = self._w_tau / self._w_iters
        tps = 1000.0 * self._w_tokens / max(self.sim.env.now - self._w_start(), 1e-9)
        self.window_tau.append(tau)
        self.window_tps.append(tps)
        ref = float(np.mean(self.window_tps[-3:]))
        p = self.pending
        if p is not None and p.applied_at is not None and p.applied_at < self.win:
            cost = p.cost_ms / max(self._w_time, 1e-9)
            self.bandit.update(p.arm, (tps - p.before) / max(p.before, 1e-9), cost)
            self.pending = None
        if self.rollback.observe(tau) == "rollback":
            self.sim.skill[self.domain] = float(self.rollback.good_version or 0.0)
        if self.pending is None and not self.busy:
            arm = self.bandit.select()
            self.played[arm] += 1
            if arm == "skip":
                self.pending = _Pending(arm, ref, 0.0, applied_at=self.win)
            else:
                ms = self.cfg.heads_ms if arm == "heads" else self.cfg.full_ms
                self.pending = _Pending(arm, ref, ms, applied_at=None)
                self.sim.env.process(self._update(arm, ms))
        self.win += 1
        self._w_iters = self._w_tau = self._w_tokens = 0
        self._w_time = 0.0
        self._t0 = self.sim.env.now

    def _w_start(self) -> float:
        return getattr(self, "_t0", 0.0)

    def _update(self, arm: str, ms: float):
        env, gpu = self.sim.env, self.sim.gpu
        self.busy = True
        left = ms
        while left > 1e-9:
            chunk = min(self.cfg.chunk_ms, left)
            with gpu.request(priority=1) as req:
                yield req
                yield env.timeout(chunk)
            left -= chunk
        self.update_ms += ms
        dom = self.domain
        before = self.sim.skill.get(dom, 0.0)
        if arm == "heads":
            after = before + self.cfg.heads_rate * max(self.cfg.heads_cap - before, 0.0)
        elif self.rng.random() < self.cfg.full_bad_prob:
            after = before - self.cfg.full_bad_drop
        else:
            after = before + self.cfg.full_rate * (1.0 - before)
        self.sim.skill[dom] = after
        self.rollback.on_update(previous=before)
        self.busy = False
        if self.pending is not None:
            self.pending.applied_at = self.win

    def summary(self) -> dict:
        return {"adapt_arms": dict(self.played), "adapt_rollbacks": self.rollback.rollbacks,
                "adapt_update_ms": self.update_ms, "adapt_windows": self.win,
                "adapt_skill": {k: round(v, 4) for k, v in self.sim.skill.items()}}
