"""EAGLE-2-style expansion stops at what the final rerank can keep (``rerank_limits``): the same
tree as the full expansion, for fewer drafter forwards; a user's policy expands as configured."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specblock.policies.branching import DynamicBranching, expand, rerank_limits
from specblock.policies.seeds import DeepestConfidentSeeds, TopScoreSeeds
from specblock.policies.tree import DraftTree
from specblock.runtime.drafters.base import DraftRequest
from specblock.runtime.drafters.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Net
from specblock.runtime.drafters.sps import SpsDrafter
from specblock.runtime.target import TargetModel
from specblock.training.sps_step import build_draft
from tiny import perturb, tiny_model

V = 16


class FullExpansion(TopScoreSeeds):
    """The top-score frontier under another name: ``rerank_limits`` knows no bound for it, so a
    drafter given it expands every configured depth and width (the reference)."""

    def select(self, tree, candidates, max_seeds):
        return super().select(tree, candidates, max_seeds)


class OwnPrune(DynamicBranching):
    def prune(self, tree, budget):
        return super().prune(tree, budget)


def paths_of(tree: DraftTree, n: int) -> tuple[int, ...]:
    p = []
    while n > 0:
        p.append(int(tree.tokens[n]))
        n = int(tree.parent[n])
    return tuple(reversed(p))


def paths(tree: DraftTree) -> set[tuple[int, ...]]:
    """A tree as the set of its nodes' token paths (node ids differ between expansions)."""
    return {paths_of(tree, i) for i in range(tree.size)}


def test_limits_only_for_the_default_rerank_and_top_score_frontier():
    assert rerank_limits(DynamicBranching(), TopScoreSeeds(), 3, 6, 8, 2) == (3, 3, 2)
    assert rerank_limits(DynamicBranching(), TopScoreSeeds(), 0, 6, 8) == (1, 1)
    assert rerank_limits(OwnPrune(), TopScoreSeeds(), 3, 6, 8) == (6, 8)
    assert rerank_limits(DynamicBranching(), FullExpansion(), 3, 6, 8) == (6, 8)
    assert rerank_limits(DynamicBranching(), DeepestConfidentSeeds(), 3, 6, 8) == (6, 8)


def _expand(cands, depth: int, top_k: int, budget: int, seeds) -> tuple[DraftTree, int]:
    """The drafters' loop over a synthetic drafter: ``cands(path)`` gives a node's top-k."""
    policy = DynamicBranching(top_k=top_k)
    tree, parents, forwards = DraftTree.root_only(0), np.zeros(1, dtype=np.int64), 0
    depth, width = rerank_limits(policy, seeds, budget, depth, top_k)
    for d in range(1, depth + 1):
        forwards += 1
        c = [cands(paths_of(tree, p)) for p in parents]
        ids = np.stack([x[0] for x in c])[:, :width]
        lps = np.stack([x[1] for x in c])[:, :width]
        new = expand(tree, parents, ids, lps, policy, budget, block=d - 1)
        if d == depth:
            break
        parents = np.sort(seeds.select(tree, new[new >= 0], width))
        if parents.size == 0:
            break
    return policy.prune(tree, budget), forwards


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), depth=st.integers(1, 7), top_k=st.integers(1, 8), budget=st.integers(1, 24),
       sharp=st.floats(0.5, 8.0))
def test_bounded_expansion_keeps_the_reranked_tree(seed, depth, top_k, budget, sharp):
    def cands(path):  # a fixed random distribution per path: the same node drafts the same candidates
        rng = np.random.default_rng([seed, *path])
        logits = rng.normal(size=V) * sharp
        lp = logits - np.log(np.exp(logits).sum())
        order = np.argsort(-lp, kind="stable")[:top_k]
        return order.astype(np.int64), lp[order].astype(np.float32)

    full, n_full = _expand(cands, depth, top_k, budget, FullExpansion())
    bounded, n_bounded = _expand(cands, depth, top_k, budget, TopScoreSeeds())
    assert paths(bounded) == paths(full)
    assert n_bounded <= min(n_full, budget)


def _eagle3(seed: int):
    model = tiny_model("llama", vocab=V, seed=seed, layers=3)
    target = TargetModel(model)
    target.want_features = True
    cfg = Eagle3Config(vocab_size=V, hidden_size=32, num_heads=4, intermediate_size=64, tap_layers=target.tap_layers)
    torch.manual_seed(seed)
    net = Eagle3Net(cfg)
    net.tie_to_target(model)
    perturb(net, 0.5)  # a spread-out drafter: many near-equal candidates, a wide tree
    return target, net.eval()


@pytest.mark.parametrize("budget", [1, 2, 3, 5, 9, 20])
def test_eagle3_proposes_the_full_expansion_tree_with_fewer_forwards(budget):
    target, net = _eagle3(seed=budget)
    prompt = np.arange(2, 13)
    trees, calls = [], []
    for seeds in (FullExpansion(), TopScoreSeeds()):
        drafter = Eagle3Drafter(net, depth=6, top_k=4, seeds=seeds)
        drafter.prefill(prompt, target.prefill(prompt[:-1]))
        n = [0]
        hook = net.layer.register_forward_hook(lambda *_: n.__setitem__(0, n[0] + 1))
        trees.append(drafter.propose(DraftRequest(tokens=prompt, budget=budget, max_depth=100)))
        hook.remove()
        calls.append(n[0])
        target.reset()
    assert paths(trees[1]) == paths(trees[0])
    assert trees[1].size - 1 == min(budget, trees[0].size - 1)
    assert calls[1] <= calls[0]
    if budget <= 3:  # the flush plus at most budget - 1 expansions, against 1 + 5 in full
        assert calls[1] <= budget and calls[0] == 6


@pytest.mark.parametrize("budget", [1, 2, 4, 10])
def test_sps_tree_proposes_the_full_expansion_tree(budget):
    model = tiny_model("llama", vocab=V, seed=7, layers=3)
    torch.manual_seed(7)
    draft = build_draft(model, layers=1, intermediate=64)
    draft.model.init_weights()  # random: spread-out candidates
    prompt = np.arange(2, 12)
    trees = []
    for seeds in (FullExpansion(), TopScoreSeeds()):
        drafter = SpsDrafter(draft.model.eval(), gamma=5, top_k=3, seeds=seeds)
        trees.append(drafter.propose(DraftRequest(tokens=prompt, budget=budget, max_depth=100)))
    assert paths(trees[1]) == paths(trees[0])


def test_sim_eagle3_same_tree_fewer_forwards():
    from specblock.sim import methods
    from specblock.sim.acceptance import R, RankModel

    pmf = np.full((1, 8, R + 1), 1.0 / (R + 1))
    rm = RankModel(pmf=pmf)
    full = methods.eagle3(depth=6, top_k=8, budget=3)
    full.seeds = FullExpansion()
    bounded = methods.eagle3(depth=6, top_k=8, budget=3)
    for seed in range(5):
        a = full.draft(np.random.default_rng(seed), rm)
        b = bounded.draft(np.random.default_rng(seed), rm)
        assert paths(a.tree) == paths(b.tree)
        assert a.acceptance.accepted == b.acceptance.accepted
        assert len(b.forwards) <= 3 < len(a.forwards)
