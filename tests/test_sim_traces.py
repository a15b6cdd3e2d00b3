"""Trace-driven acceptance: the EM fit recovers the model that wrote synthetic traces."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specblock.sim.acceptance import ParametricShape, default_confusion
from specblock.sim.config import SimConfig
from specblock.sim.engine import simulate
from specblock.sim.traces import fit_traces, read_traces


def _cfg(**acc) -> SimConfig:
    return SimConfig.model_validate({
        "method": {"name": "specblock", "widths": [2, 4, 6, 4]}, "tree_pool": 0, "seed": 4,
        "acceptance": dict({"kind": "parametric", "a1": 0.8}, **acc),
        "workload": {"requests": 12, "tokens": 256}})


def test_fit_recovers_rank_pmf_and_confusion(tmp_path):
    path = tmp_path / "t.jsonl"
    simulate(_cfg(), trace_out=str(path))
    rm = fit_traces([path])
    truth = ParametricShape(decay=0.93, block_decay=0.95).rank_model(0.8)
    np.testing.assert_allclose(rm.pmf[0, :4, 0], truth.pmf[0, :4, 0], atol=0.06)
    np.testing.assert_allclose(rm.pmf[1, :2, 0], truth.pmf[1, :2, 0], atol=0.06)
    # Only b0 and b1 are identifiable under widths (2, 4, 6, 4): no width reaches rank 10, so
    # b2 (ranks 5-10) and b3 (> 10) are never told apart (see traces.py).
    np.testing.assert_allclose(np.diag(rm.confusion)[:2], np.diag(default_confusion(0.7))[:2], atol=0.06)


def test_traces_drive_the_sim_to_the_same_tau(tmp_path):
    path = tmp_path / "t.jsonl"
    orig = simulate(_cfg(), trace_out=str(path))
    refit = simulate(_cfg(kind="traces", traces=[str(path)]))
    assert refit["tau"] == pytest.approx(orig["tau"], rel=0.04)


def test_bad_trace_lines(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"iter": 0}) + "\n")
    with pytest.raises(ValueError, match="not a trace record"):
        read_traces([p])
    with pytest.raises(FileNotFoundError):
        read_traces([tmp_path / "none.jsonl"])
