"""Three-window sliding rollback (issue 6)."""

from __future__ import annotations

import numpy as np

from specblock.policies.rollback import ThreeWindowRollback


def test_worse_drafter_is_rolled_back_within_three_windows():
    rng = np.random.default_rng(0)
    for trial in range(20):
        rb = ThreeWindowRollback(tolerance=0.05)
        for _ in range(5):
            rb.observe(4.0 + 0.08 * rng.standard_normal())
        rb.on_update(previous="theta_good")
        decisions = [rb.observe(3.4 + 0.08 * rng.standard_normal()) for _ in range(3)]  # made worse on purpose
        assert "rollback" in decisions, trial
        assert rb.good_version == "theta_good"


def test_good_update_is_committed_after_three_windows():
    rb = ThreeWindowRollback(tolerance=0.05)
    for v in (4.0, 4.1, 3.9):
        assert rb.observe(v) == "keep"
    rb.on_update(previous="v0")
    assert [rb.observe(v) for v in (4.2, 4.3, 4.25)] == ["keep", "keep", "commit"]
    assert not rb.in_probation and rb.rollbacks == 0


def test_chained_updates_restore_the_last_good_version():
    rb = ThreeWindowRollback(tolerance=0.05)
    rb.observe(4.0)
    rb.on_update(previous="v0")
    rb.observe(3.95)  # still on probation
    rb.on_update(previous="v1")  # unproven: restoring must land on v0
    assert rb.observe(3.0) == "rollback" and rb.good_version == "v0"


def test_no_update_no_rollback_on_domain_shift():
    rb = ThreeWindowRollback()
    assert [rb.observe(v) for v in (4.0, 4.0, 2.0, 2.0)] == ["keep"] * 4
