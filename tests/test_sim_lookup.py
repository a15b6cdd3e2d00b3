"""Prompt lookup in the sim: a replay of runtime lookup traces (specblock/sim/lookup.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pydantic import ValidationError

from specblock.sim.config import SimConfig
from specblock.sim.engine import simulate
from specblock.sim.lookup import TraceReplay

TABLE = {"t1_ms": 10.0, "verify_ms": 10.0, "n_ref": 1, "slope_ms_per_token": 0.5, "draft_ms_per_forward": {}}


def write_lookup_trace(path, n: int = 300, seed: int = 0, depth: int = 8) -> tuple[float, float]:
    """Lookup-like records: no match (root only) 40% of the time, else a chain of 1..depth tokens
    of which a geometric prefix is correct; rank -1 at every node, as the runtime logs lookup's.
    Returns the records' tau and mean draft ms."""
    rng = np.random.default_rng(seed)
    lines, acc, draft = [], [], []
    for i in range(n):
        length = 0 if rng.random() < 0.4 else int(rng.integers(1, depth + 1))
        a = min(int(rng.geometric(0.35)) - 1, length)
        correct = [1] + [1] * a + [0] * (length - a)
        d_s = float(rng.uniform(0.001, 0.003))
        lines.append(json.dumps({
            "iter": i, "ctx": 100 + i, "tree_size": length + 1, "depth": length, "accepted": a, "draft_s": d_s,
            "verify_s": 0.01, "commit_s": 0.0005, "domain": "code",
            "nodes": {"parent": list(range(-1, length)), "depth": list(range(length + 1)), "rank": [-1] * (length + 1),
                      "bucket": [-1] * (length + 1), "block": [-1] + [0] * length, "correct": correct}}))
        acc.append(a)
        draft.append(1e3 * d_s)
    path.write_text("\n".join(lines) + "\n")
    return 1 + float(np.mean(acc)), float(np.mean(draft))


def _cfg(path, **method) -> SimConfig:
    return SimConfig.model_validate({
        "preset": "table", "table": TABLE, "method": dict({"name": "lookup"}, **method),
        "acceptance": {"kind": "traces", "traces": [str(path)]}, "workload": {"requests": 30, "tokens": 128},
        "seed": 5})


def test_replay_reproduces_the_traces_accepted_length_and_search_time(tmp_path):
    p = tmp_path / "lookup.code.jsonl"
    tau, draft_ms = write_lookup_trace(p)
    assert 1 + TraceReplay.from_traces(p).mean_accepted() == pytest.approx(tau)
    res = simulate(_cfg(p))
    assert res["tau"] == pytest.approx(tau, rel=0.02)
    assert res["t_draft_ms"] == pytest.approx(draft_ms, rel=0.03)  # no drafter forward: the search only
    fixed = simulate(_cfg(p, search_ms=0.25))
    assert fixed["t_draft_ms"] == pytest.approx(0.25) and fixed["tau"] == pytest.approx(tau, rel=0.02)


def test_replay_is_deterministic_and_truncates(tmp_path):
    p = tmp_path / "lookup.code.jsonl"
    tau, _ = write_lookup_trace(p)
    assert simulate(_cfg(p)) == simulate(_cfg(p))
    short = simulate(_cfg(p, lookup_depth=1))
    assert short["tau"] < tau and short["tau"] <= 2.0 and short["tree_size"] <= 2.0


def test_lookup_needs_traces(tmp_path):
    with pytest.raises(ValidationError, match="replays runtime traces"):
        SimConfig.model_validate({"method": {"name": "lookup"}, "acceptance": {"kind": "parametric", "a1": 0.5}})
    p = tmp_path / "t.jsonl"
    write_lookup_trace(p, n=10)
    with pytest.raises(ValidationError, match="no drafter to adapt"):
        SimConfig.model_validate({"method": {"name": "lookup"}, "adapt": {"enabled": True},
                                  "acceptance": {"kind": "traces", "traces": [str(p)]}})
