"""Cost-aware bandit over the adaptation actions: skip, heads-only, full (paper: serving-time
adaptation). The runtime's adaptation worker and the simulator use the same class.

After an arm is played the caller measures its *gain* (relative throughput change over the next
window, or any unit it likes) and its *cost* (the update's GPU time as a fraction of the window,
in the same unit). Each arm keeps an EWMA of gains and of costs; its value is
``ewma_gain - cost_weight * ewma_cost``. Choice is UCB over values:

    value(arm) + explore * scale * sqrt(log(1 + total) / count(arm))

with the bonus built on the *arm's own* count. (A bonus on the total count alone is the same for
every arm, so the choice collapses into greedy; that is the known flaw issue 6 names.) ``scale``
normalises rewards: the running mean absolute reward, so ``explore`` is unit-free. Why EWMA rather
than a plain mean: traffic drifts, and a gain measured before a domain shift says little after it.

Torch-free; subclass and override :meth:`value` or :meth:`select` to change the rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

ARMS = ("skip", "heads", "full")


@dataclass
class ArmStats:
    count: int = 0
    gain: float = 0.0  # EWMA of measured gains
    cost: float = 0.0  # EWMA of measured costs


@dataclass
class CostAwareBandit:
    arms: tuple[str, ...] = ARMS
    ewma: float = 0.3  # weight of the newest observation
    explore: float = 0.5
    cost_weight: float = 1.0
    seed: int | None = 0  # breaks exact ties only
    stats: dict[str, ArmStats] = field(default_factory=dict)
    _abs_reward: float = 0.0
    _n_reward: int = 0

    def __post_init__(self) -> None:
        if not self.arms:
            raise ValueError("CostAwareBandit needs at least one arm")
        if not 0 < self.ewma <= 1 or self.explore < 0:
            raise ValueError("ewma must be in (0, 1], explore >= 0")
        for a in self.arms:
            self.stats.setdefault(a, ArmStats())
        self._rng = np.random.default_rng(self.seed)

    @property
    def total(self) -> int:
        return sum(s.count for s in self.stats.values())

    def value(self, arm: str) -> float:
        """Expected net gain of ``arm``: EWMA gain minus weighted EWMA cost."""
        s = self.stats[arm]
        return s.gain - self.cost_weight * s.cost

    def bonus(self, arm: str) -> float:
        s = self.stats[arm]
        scale = self._abs_reward if self._n_reward else 1.0
        return self.explore * max(scale, 1e-12) * np.sqrt(np.log1p(self.total) / s.count)

    def select(self) -> str:
        """Play every arm once (in order), then the best UCB score."""
        for a in self.arms:
            if self.stats[a].count == 0:
                return a
        scores = np.array([self.value(a) + self.bonus(a) for a in self.arms])
        best = np.flatnonzero(scores >= scores.max() - 1e-12)
        return self.arms[int(self._rng.choice(best))]

    def update(self, arm: str, gain: float, cost: float = 0.0) -> None:
        """Record what playing ``arm`` measured. The first observation initialises the EWMA."""
        if arm not in self.stats:
            raise KeyError(f"unknown arm {arm!r}")
        s = self.stats[arm]
        w = 1.0 if s.count == 0 else self.ewma
        s.gain += w * (gain - s.gain)
        s.cost += w * (cost - s.cost)
        s.count += 1
        r = abs(gain - self.cost_weight * cost)
        self._n_reward += 1
        self._abs_reward += (r - self._abs_reward) / self._n_reward

    def counts(self) -> dict[str, int]:
        return {a: s.count for a, s in self.stats.items()}


@dataclass
class FixedArm(CostAwareBandit):
    """Always plays one arm (the digest's "always full" and "no heads-only" ablations)."""

    arm: str = "full"

    def select(self) -> str:
        return self.arm
