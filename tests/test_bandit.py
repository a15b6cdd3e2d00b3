"""Cost-aware bandit (issue 6): converges to the best arm; skips when updates cost more than they gain."""

from __future__ import annotations

import numpy as np
import pytest

from specblock.policies.bandit import ARMS, CostAwareBandit, FixedArm


def play(bandit: CostAwareBandit, gains: dict, costs: dict, steps: int, noise: float, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        arm = bandit.select()
        bandit.update(arm, gains[arm] + noise * rng.standard_normal(), costs[arm])
    return bandit.counts()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_converges_to_best_arm(seed):
    gains = {"skip": 0.0, "heads": 0.08, "full": 0.12}
    costs = {"skip": 0.0, "heads": 0.005, "full": 0.09}  # heads nets 0.075, full 0.03
    counts = play(CostAwareBandit(seed=seed), gains, costs, steps=400, noise=0.03, seed=seed)
    assert max(counts, key=counts.get) == "heads"
    assert counts["heads"] > 0.7 * sum(counts.values())


def test_skips_when_every_update_costs_more_than_it_gains():
    gains = {"skip": 0.0, "heads": 0.02, "full": 0.10}
    costs = {"skip": 0.0, "heads": 0.05, "full": 0.30}
    counts = play(CostAwareBandit(seed=0), gains, costs, steps=300, noise=0.02, seed=0)
    assert counts["skip"] > 0.8 * sum(counts.values())


def test_bonus_uses_the_arms_own_count():
    b = CostAwareBandit(seed=0)
    for arm in ARMS:
        b.update(arm, 0.1, 0.0)
    for _ in range(20):
        b.update("full", 0.1, 0.0)
    # Same value everywhere: the rarely played arms must get the larger bonus.
    assert b.bonus("skip") > b.bonus("full") and b.bonus("heads") > b.bonus("full")
    assert b.select() in ("skip", "heads")


def test_subclass_overrides_value_and_fixed_arm():
    class CostBlind(CostAwareBandit):
        def value(self, arm):
            return self.stats[arm].gain

    gains = {"skip": 0.0, "heads": 0.02, "full": 0.10}
    costs = {"skip": 0.0, "heads": 0.05, "full": 0.30}
    counts = play(CostBlind(seed=0, explore=0.1), gains, costs, steps=200, noise=0.01, seed=0)
    assert max(counts, key=counts.get) == "full"
    assert FixedArm(arm="heads").select() == "heads"
    with pytest.raises(KeyError):
        CostAwareBandit().update("nope", 1.0)
