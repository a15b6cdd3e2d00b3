"""The cost-aware tree size (``policies/cost_aware.py``): the size that pays best for its rows,
the same nodes as expected-acceptance widths at that size, refusals, and lossless decoding."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specblock.errors import SpecBlockError
from specblock.policies import loading
from specblock.policies.branching import TreePolicy
from specblock.policies.cost_aware import CostAwareBranching
from specblock.policies.expected import ExpectedAcceptanceBranching
from specblock.runtime.cli import main
from specblock.runtime.drafters.specblock_net import SpecBlockConfig, SpecBlockNet
from specblock.runtime.target import TargetModel
from tiny import save_tiny

POLICY = "specblock.policies.cost_aware:CostAwareBranching"
ZEN5 = [1.0, 1.163, 1.279, 1.326, 1.463, 1.557]  # latency_smollm2_zen5_dot_s71.json at context 256
V = 96


def block(seed: int, s: int = 1, kd: int = 4, k: int = 10):
    rng = np.random.default_rng(seed)
    lp = -np.sort(rng.random((s, kd, k)) * 6, axis=-1)
    bp = rng.dirichlet(np.ones(4) * 0.5, size=(s, kd))
    return np.zeros((s, kd)), lp, bp


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 10**6), st.integers(0, 8), st.floats(0.5, 2.0), st.floats(0.3, 1.5), st.integers(1, 2))
def test_the_tree_is_the_size_that_pays_best_with_the_expected_nodes(seed, budget, rate, scale, s):
    """Against every size up to the budget (and the cost table): the kept size maximises
    ``scale * value - rate * row_cost``, and its nodes are expected-acceptance widths' at that budget."""
    score, lp, bp = block(seed, s)
    cost = np.concatenate([[1.0], 1.0 + np.cumsum(np.random.default_rng(seed + 1).random(5) * 0.2)])
    pol = CostAwareBranching(row_cost=cost.tolist(), rate=rate, scale=scale)
    ok = np.ones(s, bool)
    w, cut = pol.block_widths(score, lp, bp.argmax(-1), budget, ok, bp)
    n = int(w.sum())
    values = pol.node_values(score, lp, ok, bp)
    exp = ExpectedAcceptanceBranching()

    def worth(size: int) -> float:
        ws, _ = exp.block_widths(score, lp, bp.argmax(-1), size, ok, bp)
        kept = np.arange(values.shape[-1])[None, None, :] < ws[..., None]
        return scale * values[kept].sum() - rate * cost[int(ws.sum())]

    sizes = range(min(budget, cost.size - 1) + 1)
    assert n in sizes and not cut.any()
    assert worth(n) == pytest.approx(max(worth(m) for m in sizes), abs=1e-9)
    np.testing.assert_array_equal(w, exp.block_widths(score, lp, bp.argmax(-1), n, ok, bp)[0])


def test_flat_rows_fill_the_budget_and_steep_rows_keep_only_sure_nodes():
    """Free rows: the whole budget, like expected-acceptance widths. Rows at the Zen 5's prices:
    a block the drafter is sure of keeps three nodes, one it is lost on keeps none."""
    lp = np.log(np.tile(np.array([0.4, 0.2, 0.15, 0.1, 0.05, 0.04, 0.03, 0.02, 0.005, 0.005]), (1, 4, 1)))
    sure = np.tile(np.array([0.9, 0.08, 0.01, 0.01]), (1, 4, 1))
    lost = np.tile(np.array([0.1, 0.1, 0.1, 0.7]), (1, 4, 1))
    one = np.ones(1, bool)
    free = CostAwareBranching(row_cost=[1.0] * 6)
    for bp in (sure, lost):
        assert free.block_widths(np.zeros((1, 4)), lp, bp.argmax(-1), 3, one, bp)[0].sum() == 3
    zen5 = CostAwareBranching(row_cost=ZEN5)
    assert zen5.block_widths(np.zeros((1, 4)), lp, sure.argmax(-1), 3, one, sure)[0].tolist() == [[1, 1, 1, 0]]
    assert zen5.block_widths(np.zeros((1, 4)), lp, lost.argmax(-1), 3, one, lost)[0].sum() == 0
    assert zen5.block_widths(np.zeros((1, 4)), lp, sure.argmax(-1), 0, one, sure)[0].sum() == 0


@pytest.mark.parametrize("kwargs, match", [
    ({}, "needs row_cost"),
    ({"row_cost": [1.0]}, "needs row_cost"),
    ({"row_cost": [1.0, 0.9]}, "non-decreasing"),
    ({"row_cost": [1.0, 1.2], "rate": 0}, "rate > 0"),
])
def test_bad_costs_are_refused_in_one_line(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CostAwareBranching(**kwargs)
    with pytest.raises(SpecBlockError, match="--policy") as e:
        loading.build(POLICY, kwargs, TreePolicy, "--policy")
    assert "\n" not in str(e.value)


def test_live_decode_with_the_cost_aware_policy_is_identical_to_ar(tmp_path, capsys):
    save_tiny(tmp_path / "t", "llama", vocab=V, ctx=1024, layers=3)
    target = TargetModel.load(tmp_path / "t", "float32", "cpu")
    cfg = SpecBlockConfig(vocab_size=V, hidden_size=32, num_heads=4, intermediate_size=64, tap_layers=target.tap_layers)
    net = SpecBlockNet(cfg)
    net.tie_to_target(target.model)
    net.save(tmp_path / "d")
    for kwargs in ({"row_cost": ZEN5}, {"row_cost": ZEN5, "rate": 0.2, "scale": 3.0}):
        code = main([str(a) for a in ("--target", tmp_path / "t", "--method", "specblock", "--drafter", tmp_path / "d",
                                      "--policy", POLICY, "--policy-kwargs", json.dumps(kwargs), "--M", 1,
                                      "--budget", 5, "--prompt", "abc abc abc", "--max-new-tokens", 24,
                                      "--dtype", "float32", "--compare", "ar", "--json")])
        out = capsys.readouterr()
        assert code == 0, out.err
        assert json.loads(out.out)["identical_to_ar"] is True
