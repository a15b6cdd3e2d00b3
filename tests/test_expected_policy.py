"""Expected-acceptance widths (``policies/expected.py``): the block-wide hook ``block_widths``,
the rank head's probabilities reaching a policy, optimal trees where the estimates are monotone,
and lossless decoding with the policy live."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specblock.policies.branching import RankBucketBranching, TreePolicy, grow_block
from specblock.policies.expected import ExpectedAcceptanceBranching, candidate_probs, falling
from specblock.policies.tree import DraftTree
from specblock.runtime import drafters
from specblock.runtime.cli import main
from specblock.runtime.drafters.specblock_net import SpecBlockConfig, SpecBlockNet
from specblock.runtime.engine import Engine
from specblock.runtime.target import TargetModel
from tiny import save_tiny

POLICY = "specblock.policies.expected:ExpectedAcceptanceBranching"
V = 96


def expected_accepted(p: np.ndarray, w: np.ndarray) -> float:
    """A one-seed block's expected accepted drafts under widths ``w`` [K], candidate chances ``p`` [K, k]."""
    total, reach = 0.0, 1.0
    for d in range(len(w)):
        if w[d] == 0:
            break
        total += reach * p[d, : w[d]].sum()
        reach *= p[d, 0]
    return total


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 5), st.integers(0, 12), st.integers(0, 10**6))
def test_greedy_widths_are_optimal_for_draft_probabilities(kd, k, budget, seed):
    """With draft probabilities (sorted per position) node values fall from a node to its
    descendants and lower siblings, so the best ``budget`` nodes are the best tree: checked
    against every width vector."""
    rng = np.random.default_rng(seed)
    p = np.sort(rng.dirichlet(np.ones(k + 1), size=kd)[:, :k], axis=1)[:, ::-1]
    lp = np.log(p)[None]
    w, cut = ExpectedAcceptanceBranching().block_widths(np.zeros((1, kd)), lp, None, budget, np.ones(1, bool))
    assert w.shape == (1, kd) and not cut.any() and w.sum() <= budget
    best = max(expected_accepted(p, np.array(v)) for v in itertools.product(range(k + 1), repeat=kd)
               if sum(v) <= budget)
    assert expected_accepted(p, w[0]) == pytest.approx(best, rel=1e-9, abs=1e-12)
    if budget <= kd * k:  # room for nothing more: it fills the budget (every value is > 0)
        assert w.sum() == budget


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(1, 5), st.integers(0, 20), st.integers(0, 10**6), st.floats(0, 0.3))
def test_expected_trees_are_valid_with_rank_probabilities(s, kd, budget, seed, min_value):
    """Several seeds, rank-head probabilities (whose b0 can be below a b1 candidate): a valid tree
    within the budget, spines only under kept top-1 nodes, no node worth less than min_value."""
    rng = np.random.default_rng(seed)
    tree = DraftTree.root_only(0)
    ct = rng.integers(0, 50, (s, kd, 10))
    cl = -np.sort(rng.random((s, kd, 10)) * 5, axis=-1)
    bp = rng.dirichlet(np.ones(4), size=(s, kd))
    policy = ExpectedAcceptanceBranching(min_value=min_value)
    spine = grow_block(tree, np.zeros(s, dtype=np.int64), ct, cl, bp.argmax(-1), policy, budget, block=0, bucket_prob=bp)
    tree.check()
    assert tree.size - 1 <= budget
    p = candidate_probs(cl, bp)
    meta = tree.meta
    for node, row, d in zip(meta["block_nodes"], meta["block_rows"], meta["block_pos"]):
        worth = falling(p)[row, d, int(tree.rank[node])]  # its share of its pooled run of siblings
        reach = np.prod(p[row, :d, 0])  # times the chance its spine is reached
        assert reach * worth >= min_value - 1e-12


def test_candidate_probs_spread_each_band_by_draft_probabilities():
    lp = np.log(np.array([[0.5, 0.2, 0.1, 0.1, 0.04, 0.02, 0.02, 0.01, 0.005, 0.005]]))
    bp = np.array([[0.4, 0.3, 0.2, 0.1]])
    p = candidate_probs(lp, bp)[0]
    assert p[0] == pytest.approx(0.4)
    assert p[1:4] == pytest.approx(0.3 * np.array([0.5, 0.25, 0.25]))
    assert p[4:].sum() == pytest.approx(0.2) and p.sum() == pytest.approx(0.9)
    assert candidate_probs(lp, None) == pytest.approx(np.exp(lp))


def test_a_likely_b0_gets_a_chain_and_a_likely_b3_still_a_node():
    """What the rank widths cannot do at a budget of 3: a chain when the spine is likely right,
    siblings when the top-1 is unlikely, and a node where the argmax bucket is b3."""
    lp = np.log(np.tile(np.array([0.4, 0.2, 0.15, 0.1, 0.05, 0.04, 0.03, 0.02, 0.005, 0.005]), (1, 4, 1)))
    pol = ExpectedAcceptanceBranching()
    sure = np.tile(np.array([0.9, 0.08, 0.01, 0.01]), (1, 4, 1))
    w, _ = pol.block_widths(np.zeros((1, 4)), lp, sure.argmax(-1), 3, np.ones(1, bool), sure)
    assert w.tolist() == [[1, 1, 1, 0]]
    unsure = np.tile(np.array([0.2, 0.6, 0.1, 0.1]), (1, 4, 1))
    w, _ = pol.block_widths(np.zeros((1, 4)), lp, unsure.argmax(-1), 3, np.ones(1, bool), unsure)
    assert w.tolist() == [[3, 0, 0, 0]]
    lost = np.tile(np.array([0.1, 0.1, 0.1, 0.7]), (1, 4, 1))
    w, _ = pol.block_widths(np.zeros((1, 4)), lp, lost.argmax(-1), 3, np.ones(1, bool), lost)
    assert w.sum() == 3  # RankBucketBranching's (2, 4, 10, 0) drafts nothing here
    tree = DraftTree.root_only(0)
    grow_block(tree, np.zeros(1, np.int64), np.arange(40).reshape(1, 4, 10), lp, lost.argmax(-1),
               RankBucketBranching(), 3, block=0, bucket_prob=lost)
    assert tree.size == 1
    w, _ = ExpectedAcceptanceBranching(min_value=0.2).block_widths(np.zeros((1, 4)), lp, None, 3, np.ones(1, bool), lost)
    assert w.sum() == 0  # no node worth 0.2 there


def test_a_band_worth_more_together_than_its_top_candidate_is_kept_whole():
    """A rank head sure of b2 (the target's token ranked 5-10) makes the top-4 worthless alone;
    together with the six behind them they are worth b2's probability, so a budget of 10 keeps
    them all, and a budget of 4 keeps what it can (the best prefix, as good as any)."""
    lp = np.log(np.tile(np.linspace(0.2, 0.02, 10), (1, 4, 1)))
    b2 = np.tile(np.array([0.0, 0.0, 1.0, 0.0]), (1, 4, 1))
    w, _ = ExpectedAcceptanceBranching().block_widths(np.zeros((1, 4)), lp, b2.argmax(-1), 10, np.ones(1, bool), b2)
    assert w.tolist() == [[10, 0, 0, 0]]
    assert falling(np.array([0.0, 0, 0, 0, 0.2, 0.2, 0.2, 0.2, 0.1, 0.1])) == pytest.approx(np.full(10, 0.1))
    assert falling(np.array([0.5, 0.2, 0.1, 0.3, 0.05])) == pytest.approx([0.5, 0.2, 0.2, 0.2, 0.05])


def test_grow_block_holds_a_policy_to_the_budget_and_the_spine():
    class Greedy(TreePolicy):
        def raw_widths(self, parent_score, cand_logprob, bucket):
            return np.full(len(parent_score), 2)

        def block_widths(self, parent_score, cand_logprob, bucket, budget_left, seed_ok, bucket_prob=None):
            w = np.full(parent_score.shape, 2)
            w[:, 1] = 0  # the spine ends at position 2: deeper widths must be dropped
            return w, np.ones(parent_score.shape, bool)

    lp = np.log(np.full((1, 4, 10), 0.1))
    tree = DraftTree.root_only(0)
    grow_block(tree, np.zeros(1, np.int64), np.arange(40).reshape(1, 4, 10), lp, None, Greedy(), 10, block=0)
    assert tree.size - 1 == 2 and tree.depth.max() == 1
    assert tree.meta["block_cuts"][0].tolist() == [1]  # the cut at position 2, under the spine node
    with pytest.raises(ValueError, match="Greedy.block_widths kept 2 nodes with 1 left"):
        grow_block(DraftTree.root_only(0), np.zeros(1, np.int64), np.arange(40).reshape(1, 4, 10), lp, None,
                   Greedy(), 1, block=0)


# ----------------------------------------------------------------------------- live, on a tiny target
@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    root = tmp_path_factory.mktemp("expected")
    save_tiny(root / "t", "llama", vocab=V, ctx=1024, layers=3)
    target = TargetModel.load(root / "t", "float32", "cpu")
    cfg = SpecBlockConfig(vocab_size=V, hidden_size=32, num_heads=4, intermediate_size=64, tap_layers=target.tap_layers)
    torch.manual_seed(0)
    net = SpecBlockNet(cfg)
    net.tie_to_target(target.model)
    with torch.no_grad():  # a rank head that predicts every bucket somewhere
        for p in net.rank_head.parameters():
            p.add_(torch.randn_like(p) * 2.0)
    net.save(root / "d")
    return root / "t", root / "d", target


def test_the_drafter_hands_the_rank_heads_probabilities_to_the_policy(lab):
    _, ddir, target = lab
    seen: list = []

    class Spy(ExpectedAcceptanceBranching):
        def block_widths(self, parent_score, cand_logprob, bucket, budget_left, seed_ok, bucket_prob=None):
            seen.append((bucket.copy(), bucket_prob.copy()))
            return super().block_widths(parent_score, cand_logprob, bucket, budget_left, seed_ok, bucket_prob)

    rt = drafters.build("specblock", target, {"drafter": ddir, "M": 2})
    rt.policy = Spy()
    prompt = np.random.default_rng(0).integers(3, V, 12)
    Engine(target, rt, budget=6).generate(prompt, 16)
    assert len(seen) >= 4  # one call per block forward
    for bucket, prob in seen:
        assert prob.shape == bucket.shape + (4,)
        np.testing.assert_allclose(prob.sum(-1), 1.0, rtol=1e-5)
        np.testing.assert_array_equal(prob.argmax(-1), bucket)


def test_live_decode_with_the_expected_policy_is_identical_to_ar(lab, capsys):
    tdir, ddir, _ = lab
    for kwargs in ("{}", '{"min_value": 0.05}'):
        code = main([str(a) for a in ("--target", tdir, "--method", "specblock", "--drafter", ddir, "--policy", POLICY,
                                      "--policy-kwargs", kwargs, "--budget", 5, "--prompt", "abc abc abc",
                                      "--max-new-tokens", 24, "--dtype", "float32", "--compare", "ar", "--json")])
        out = capsys.readouterr()
        assert code == 0, out.err
        rec = json.loads(out.out)
        assert rec["identical_to_ar"] is True
