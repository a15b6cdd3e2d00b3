"""SpS: a small Llama draft model; lossless (chain and tree) with any weights, the tree-masked
draft forwards equal plain forwards along each path, distillation learns, save/load."""

import numpy as np
import pytest
import torch

from specblock.errors import SpecBlockError
from specblock.runtime.drafters.base import DraftRequest
from specblock.runtime.drafters.sps import SpsDrafter
from specblock.runtime.engine import Engine
from specblock.runtime.target import TargetModel
from specblock.training.sps_step import build_draft, sps_pass, sps_step
from tiny import FAMILIES, tiny_model, hf_greedy

V = 16


def make(family="llama", seed=0, layers=1, hidden=None, copy=True):
    model = tiny_model(family, vocab=V, seed=seed, layers=3)
    target = TargetModel(model)
    torch.manual_seed(seed + 100)
    net = build_draft(model, layers=layers, intermediate=64, hidden=hidden)
    if not copy:  # fully random draft weights
        net.model.init_weights()
    return model, target, net



@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("top_k", [1, 3])
def test_lossless_greedy(family, top_k):
    model, target, net = make(family, copy=top_k == 1)
    rng = np.random.default_rng(top_k)
    for length in (1, 5, 14):
        prompt = rng.integers(2, V, length)
        drafter = SpsDrafter(net.model.eval(), gamma=int(rng.integers(1, 6)), top_k=top_k)
        res = Engine(target, drafter, budget=int(rng.integers(2, 20))).generate(prompt, 30)
        assert res.token_ids == hf_greedy(model, prompt, 30)
    assert max(res.stats.tree_size) > 1


def test_tree_logprobs_equal_plain_forwards():
    """Every node's draft log-prob equals what the draft model gives its token after a plain
    (cache-free, causal) forward over the committed tokens plus the node's ancestors."""
    model, target, net = make("qwen2", seed=3, layers=2, hidden=16)
    draft = net.model.eval()
    prompt = np.random.default_rng(0).integers(2, V, 7)
    drafter = SpsDrafter(draft, gamma=4, top_k=3)
    drafter.propose(DraftRequest(tokens=prompt[:4], budget=10, max_depth=10))  # warm the cache, then move on
    tree = drafter.propose(DraftRequest(tokens=prompt, budget=40, max_depth=10))  # no rerank cut
    tree.check()
    assert tree.max_depth == 4 and drafter.n_cached == len(prompt)
    assert all(layer.keys.shape[-2] == len(prompt) for layer in drafter.cache.layers)  # drafts cut away
    with torch.no_grad():
        for n in range(1, tree.size):
            ctx = np.concatenate([prompt, tree.tokens[tree.path_to(int(tree.parent[n]))[1:]]])
            lp = torch.log_softmax(draft(torch.as_tensor(ctx)[None]).logits[0, -1].float(), -1)
            assert abs(float(lp[tree.tokens[n]]) - float(tree.logprob[n])) < 1e-4


def test_distillation_learns_a_fixed_batch():
    model, target, net = make("llama", seed=4, hidden=16)
    tokens = torch.as_tensor(np.random.default_rng(1).integers(2, V, (2, 33)))
    sp = sps_pass(model, tokens)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    before = float(sps_step(net, sp).top1.float().mean())
    for _ in range(100):
        res = sps_step(net, sp)
        opt.zero_grad()
        res.loss.backward()
        opt.step()
    after = float(sps_step(net, sp).top1.float().mean())
    assert after > before + 0.2 and after > 0.6


def test_save_load_round_trip_and_mismatch(tmp_path):
    model, target, net = make(layers=2)
    net.save(tmp_path / "d")
    d = SpsDrafter.load(tmp_path / "d", target, gamma=3)
    for name, a in net.model.state_dict().items():
        torch.testing.assert_close(a, d.model.state_dict()[name])
    with pytest.raises(SpecBlockError, match="has vocab"):
        SpsDrafter.load(tmp_path / "d", TargetModel(tiny_model("llama", vocab=V + 4, layers=3)))
    with pytest.raises(SpecBlockError, match="no model directory"):
        SpsDrafter.load(tmp_path / "nothing", target)
