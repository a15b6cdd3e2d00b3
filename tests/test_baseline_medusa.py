"""Medusa-1: lossless with any weights, the static tree follows the calibrated accuracies,
serving heads equal training heads, training learns, save/load keeps the calibration."""

import numpy as np
import pytest
import torch

from specblock.errors import SpecBlockError
from specblock.runtime.drafters.base import DraftRequest
from specblock.policies.static_tree import static_tree
from specblock.runtime.drafters.medusa import MedusaConfig, MedusaDrafter, MedusaNet
from specblock.runtime.engine import Engine
from specblock.runtime.target import TargetModel
from specblock.training.medusa_step import medusa_pass, medusa_step, rank_accuracy
from tiny import FAMILIES, tiny_model, hf_greedy, perturb

V = 16


def make(family="llama", seed=0, noise=0.0, heads=3, top_k=4):
    model = tiny_model(family, vocab=V, seed=seed, layers=3)
    target = TargetModel(model)
    torch.manual_seed(seed)
    net = MedusaNet(MedusaConfig(vocab_size=V, hidden_size=32, heads=heads, top_k=top_k))
    net.tie_to_target(model)
    if noise:  # "random weights": every trainable tensor moved far from its init
        perturb(net, noise)
    return model, target, net.eval()



@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("noise", [0.0, 0.5])
def test_lossless_greedy(family, noise):
    model, target, net = make(family, noise=noise)
    rng = np.random.default_rng(int(noise * 10) + 1)
    for length in (1, 5, 14):
        prompt = rng.integers(2, V, length)
        res = Engine(target, MedusaDrafter(net), budget=int(rng.integers(1, 25))).generate(prompt, 30)
        assert res.token_ids == hf_greedy(model, prompt, 30)
    assert max(res.stats.tree_size) > 1



def test_trees_take_the_one_size_tree_sizes_names():
    """One static tree a budget: every proposal away from the context's end has the size a compiled
    server warms alone (``Drafter.tree_sizes``)."""
    model, target, net = make("llama", seed=3)
    target.want_features = True
    prompt = np.arange(2, 12)
    drafter = MedusaDrafter(net)
    drafter.prefill(prompt, target.prefill(prompt[:-1]))
    for budget in range(1, 40, 3):
        tree = drafter.propose(DraftRequest(tokens=prompt, budget=budget, max_depth=100))
        assert (tree.size,) == drafter.tree_sizes(budget) and tree.size <= budget + 1

def test_untrained_heads_are_the_target_head():
    """Zero-initialised residual blocks: every head predicts the target's own next token."""
    model, target, net = make()
    top = torch.randn(5, 32)
    logits = net.logits(top)
    for i in range(net.cfg.heads):
        torch.testing.assert_close(logits[:, i], model.lm_head(top + torch.nn.functional.silu(net.res[i].bias)))


def test_static_tree_is_best_first_and_prefix_closed():
    acc = np.array([[0.7, 0.2, 0.05], [0.5, 0.2, 0.1], [0.4, 0.1, 0.1]])
    parent, depth, rank = static_tree(acc, 6)
    assert parent.size == 7 and parent[0] == -1 and (parent[1:] < np.arange(1, 7)).all()
    score = np.ones(7)
    for n in range(1, 7):
        score[n] = score[parent[n]] * acc[depth[n] - 1, rank[n]]
    # The chosen paths are the six best of all paths (brute force over every rank path).
    import itertools

    every = [np.prod([acc[i, r] for i, r in enumerate(path)])
             for d in (1, 2, 3) for path in itertools.product(range(3), repeat=d)]
    np.testing.assert_allclose(np.sort(score[1:])[::-1], np.sort(every)[::-1][:6])
    assert list(zip(depth[1:3], rank[1:3])) == [(1, 0), (2, 0)]  # 0.7, then 0.35
    assert (depth <= 3).all()


def test_serving_heads_equal_training_heads():
    model, target, net = make("qwen3", seed=2, noise=0.3)
    target.want_features = True
    prompt = np.random.default_rng(0).integers(2, V, 12)
    drafter = MedusaDrafter(net)
    drafter.prefill(prompt, target.prefill(prompt[:-1]))
    tree = drafter.propose(DraftRequest(tokens=prompt, budget=12, max_depth=10))
    tree.check()
    with torch.no_grad():
        res = medusa_step(net, medusa_pass(model, torch.as_tensor(prompt)[None]))
    lp = torch.log_softmax(res.logits[0, len(prompt) - 2], -1)  # heads at the root's parent position
    for n in range(1, tree.size):
        assert abs(float(lp[tree.depth[n] - 1, tree.tokens[n]]) - float(tree.logprob[n])) < 1e-4


@pytest.mark.parametrize("hard", [False, True])
def test_training_learns_a_fixed_batch(hard):
    model, target, net = make("llama", seed=4)
    net.train()
    tokens = torch.as_tensor(np.random.default_rng(1).integers(2, V, (2, 33)))
    mp = medusa_pass(model, tokens)
    opt = torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=1e-2)

    def acc():
        with torch.no_grad():
            return rank_accuracy(medusa_step(net, mp, hard), 1)[:, 0]

    before = acc()
    for _ in range(150):
        res = medusa_step(net, mp, hard)
        opt.zero_grad()
        res.loss.backward()
        opt.step()
    after = acc()
    assert (after[:2] > before[:2] + 0.15).all()


def test_save_load_keeps_calibration_and_refuses_mismatch(tmp_path):
    model, target, net = make(noise=0.1)
    net.cfg.rank_acc = np.round(np.random.default_rng(0).random((3, 4)), 3).tolist()
    net.save(tmp_path / "d")
    d = MedusaDrafter.load(tmp_path / "d", target)
    assert d.net.cfg.rank_acc == net.cfg.rank_acc
    np.testing.assert_allclose(d.acc, net.cfg.accuracy_table())
    for name, a in net.state_dict().items():
        want = a if name == "lm_head.weight" else a.to(torch.bfloat16).float()
        torch.testing.assert_close(want, d.net.state_dict()[name].float())
    with pytest.raises(SpecBlockError, match="trained for vocab"):
        MedusaDrafter.load(tmp_path / "d", TargetModel(tiny_model("llama", vocab=V + 4, layers=3)))
    with pytest.raises(SpecBlockError, match="no Medusa drafter"):
        MedusaDrafter.load(tmp_path / "nothing", target)
