"""Speculative sampling draws from the target's own distribution (chi-square on a tiny vocab).

Two levels: the verifier alone on fixed tree logits (many draws, strong test, and a biased
verifier must fail it), and the whole engine on a tiny model (the first two new tokens against
the exact joint distribution computed from the model).
"""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specblock.policies.tree import DraftTree
from specblock.runtime.drafters import RandomDrafter
from specblock.runtime.engine import Engine
from specblock.runtime.target import TargetModel
from specblock.runtime.verify import SamplingVerifier, target_probs
from tiny import tiny_model

V = 6


class BiasedVerifier(SamplingVerifier):
    """Accepts drafted tokens too easily: the tests must catch it."""

    def accept_prob(self, p_child, removed):
        return np.sqrt(super().accept_prob(p_child, removed))


def fit_pvalue(counts, probs):
    n = counts.sum()
    keep = probs * n >= 5  # pool rare cells so the chi-square approximation holds
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(probs[keep], probs[~keep].sum()) * n
    obs, exp = obs[exp > 0], exp[exp > 0]
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


# Root with children [1, 4, 1(repeat)], node 1 with children [2, 5]; logits per node.
TREE = DraftTree.from_parents(np.array([0, 1, 4, 1, 2, 5]), np.array([-1, 0, 0, 0, 1, 1]))
LOGITS = torch.tensor(np.random.default_rng(0).normal(0, 1.5, (TREE.size, V)), dtype=torch.float32)
LOGITS[0, 1] = LOGITS[0].max() + 0.5  # keep the drafted token 1 inside the top-p set at the root


def verifier_draws(verifier, n=20_000):
    first, second_after_1 = np.zeros(V), np.zeros(V)
    for _ in range(n):
        v = verifier.verify(TREE, LOGITS)
        emitted = TREE.tokens[v.path[1:]].tolist() + [v.bonus]
        first[emitted[0]] += 1
        if v.accepted >= 1 and v.path[1] == 1:  # first token came from node 1: the next ~ p(node 1)
            second_after_1[emitted[1]] += 1
    return first, second_after_1


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.8, 0.7)])
def test_verifier_emits_target_distribution(temperature, top_p):
    probs = target_probs(LOGITS, temperature, top_p).double().numpy()
    first, second = verifier_draws(SamplingVerifier(temperature, top_p, seed=1))
    assert fit_pvalue(first, probs[0]) > 1e-3
    assert fit_pvalue(second, probs[1]) > 1e-3
    assert second.sum() > 1000  # the depth-2 branch was exercised


def test_biased_verifier_is_caught():
    probs = target_probs(LOGITS, 1.0, 1.0).double().numpy()
    first, _ = verifier_draws(BiasedVerifier(1.0, 1.0, seed=1))
    assert fit_pvalue(first, probs[0]) < 1e-6


def test_engine_sampling_matches_model():
    model = tiny_model("llama", vocab=V, seed=5)
    with torch.no_grad():
        model.lm_head.weight.div_(4.0)  # spread the distributions out
    prompt = np.array([2, 3, 4, 5])
    with torch.no_grad():
        p1 = target_probs(model(torch.tensor(prompt)[None]).logits[0, -1], 1.0, 1.0)
        seqs = torch.tensor(np.concatenate([np.tile(prompt, (V, 1)), np.arange(V)[:, None]], axis=1))
        p2 = target_probs(model(seqs).logits[:, -1], 1.0, 1.0)
    joint = (p1[:, None] * p2).reshape(-1).double().numpy()
    drafter = RandomDrafter(V, budget=6)
    engine = Engine(TargetModel(model), drafter, SamplingVerifier(1.0), budget=6)
    counts = np.zeros(V * V)
    accepted = 0
    for i in range(800):
        drafter.seed = 10_000 + i
        res = engine.generate(prompt, 2, seed=i)
        counts[res.token_ids[0] * V + res.token_ids[1]] += 1
        accepted += sum(res.stats.accepted)
    assert accepted > 100
    assert fit_pvalue(counts, joint) > 1e-3
