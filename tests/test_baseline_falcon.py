"""Falcon-style drafter: lossless with any weights, blocks of 2 per forward grow the tree, serving
runs what training taught, glancing training learns, save/load round trips, the recipe serves."""

import json

import numpy as np
import pytest
import torch

from specblock.errors import SpecBlockError
from specblock.runtime import drafters
from specblock.runtime.drafters.base import DraftRequest
from specblock.runtime.drafters.falcon import FalconConfig, FalconDrafter, FalconNet
from specblock.runtime.engine import Engine
from specblock.runtime.target import TargetModel
from specblock.training.falcon_step import falcon_states, falcon_step, glance_at
from specblock.training.parallelspec_step import chain_acceptance
from specblock.training.specblock_step import target_pass
from tiny import FAMILIES, hf_greedy, perturb, save_tiny, tiny_model

V = 16


def make(family="llama", seed=0, noise=0.0, layers=1, block_size=2):
    model = tiny_model(family, vocab=V, seed=seed, layers=3)
    target = TargetModel(model)
    cfg = FalconConfig(vocab_size=V, hidden_size=32, num_heads=4, num_layers=layers, intermediate_size=64,
                       tap_layers=target.tap_layers, block_size=block_size)
    torch.manual_seed(seed)
    net = FalconNet(cfg)
    net.tie_to_target(model)
    if noise:
        perturb(net, noise)
    return model, target, net.eval()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("noise", [0.0, 0.5])
def test_lossless_greedy(family, noise):
    model, target, net = make(family, noise=noise, layers=1 + int(noise > 0))
    rng = np.random.default_rng(int(noise * 10))
    for length in (1, 2, 3, 11):
        prompt = rng.integers(2, V, length)
        top_k = int(rng.integers(1, 4))
        drafter = FalconDrafter(net, forwards=int(rng.integers(1, 4)), top_k=top_k, max_seeds=int(rng.integers(1, 4)))
        res = Engine(target, drafter, budget=int(rng.integers(2 * top_k, 25))).generate(prompt, 30)
        assert res.token_ids == hf_greedy(model, prompt, 30)
        assert max(res.stats.tree_depth) >= 2


def test_three_forwards_make_depth_six_within_budget():
    model, target, net = make("qwen3", seed=1, noise=0.2)
    target.want_features = True
    prompt = np.arange(2, 12)
    drafter = FalconDrafter(net, forwards=3, top_k=2, max_seeds=2)
    drafter.prefill(prompt, target.prefill(prompt[:-1]))
    tree = drafter.propose(DraftRequest(tokens=prompt, budget=40, max_depth=100))
    tree.check()
    assert tree.max_depth == 6 and tree.size - 1 == 4 + 8 + 8  # forward 1: 1 seed, then 2 seeds; x 2 depths x 2
    assert (tree.block[1:] == (tree.depth[1:] - 1) // 2).all()  # forward f drafts depths 2f+1, 2f+2
    drafter.prefill(prompt, target.prefill(prompt[:-1]))
    small = drafter.propose(DraftRequest(tokens=prompt, budget=7, max_depth=3))
    assert small.size - 1 <= 7


def test_serving_equals_training_states():
    """A top-1 chain of 3 forwards has, at every depth, the log-probs of the training pass at
    the same row with glancing off (the drafter's own predictions as inputs, as served)."""
    model, target, net = make("qwen2", seed=2, noise=0.3, layers=2)
    target.want_features = True
    prompt = np.random.default_rng(0).integers(2, V, 9)
    drafter = FalconDrafter(net, forwards=3, top_k=1, max_seeds=1)
    drafter.prefill(prompt, target.prefill(prompt[:-1]))
    tree = drafter.propose(DraftRequest(tokens=prompt, budget=6, max_depth=6))
    assert tree.size == 7 and (tree.parent[1:] == np.arange(6)).all()
    seq = torch.as_tensor(np.concatenate([prompt, tree.tokens[1:6]]))[None]
    with torch.no_grad():
        states = falcon_states(net, target_pass(model, seq, target.tap_layers), 3, 0.0, None)
        lp = torch.log_softmax(net.logits(states[0, len(prompt) - 2]), -1)
    assert (lp.argmax(-1).numpy() == tree.tokens[1:]).all()
    np.testing.assert_allclose(lp.max(-1).values.numpy(), tree.logprob[1:], atol=2e-4)


def test_glancing_training_learns_a_fixed_batch():
    model, target, net = make("llama", seed=4)
    net.train()
    tokens = torch.as_tensor(np.random.default_rng(1).integers(2, V, (2, 33)))
    tp = target_pass(model, tokens, target.tap_layers)
    opt = torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        before = falcon_step(net, tp, 2, 0.0)
    steps = 80
    for s in range(steps):
        res = falcon_step(net, tp, 2, glance_at(s / steps, 1.0, 0.25), gen)
        opt.zero_grad()
        res.loss.backward()
        opt.step()
    with torch.no_grad():
        after = falcon_step(net, tp, 2, 0.0)
    assert float(after.loss) < float(before.loss) - 0.5
    acc0, acc1 = chain_acceptance(before), chain_acceptance(after)
    assert len(acc1) == 4 and acc1[0] > acc0[0] + 0.2 and acc1[2] > acc0[2]
    assert glance_at(0.0, 1.0, 0.25) == 1.0 and glance_at(1.0, 1.0, 0.25) == 0.25


def test_save_load_round_trip_and_mismatch(tmp_path):
    model, target, net = make(noise=0.1)
    net.save(tmp_path / "d")
    d = FalconDrafter.load(tmp_path / "d", target)
    loaded = d.net.state_dict()
    for name, a in net.state_dict().items():
        want = a if name in ("embed.weight", "lm_head.weight") else a.to(torch.bfloat16).float()
        torch.testing.assert_close(want, loaded[name].float())
    assert d.net.cfg == net.cfg and not d.net.embed.weight.requires_grad
    other = TargetModel(tiny_model("llama", vocab=V + 4, layers=3))
    with pytest.raises(SpecBlockError, match="trained for vocab"):
        FalconDrafter.load(tmp_path / "d", other)
    with pytest.raises(SpecBlockError, match="not a Falcon drafter"):
        from specblock.runtime.drafters.parallelspec import ParallelSpecConfig, ParallelSpecNet

        ps = ParallelSpecNet(ParallelSpecConfig(vocab_size=V, hidden_size=32, tap_layers=target.tap_layers))
        ps.tie_to_target(model)
        ps.save(tmp_path / "ps")
        FalconDrafter.load(tmp_path / "ps", target)


def test_trainer_recipe_resumes_exports_and_serves(tmp_path, monkeypatch):
    import specblock.training.windows as windows
    from specblock.training.drafter import main as train_main

    monkeypatch.setattr(windows, "CACHE_ROOT", tmp_path / "cache")
    save_tiny(tmp_path / "t", "qwen2", vocab=96, ctx=128, layers=3)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"line {i} " + "abc def " * 12}) + "\n" for i in range(60)))
    common = ["--method", "falcon", "--target", str(tmp_path / "t"), "--run-dir", str(tmp_path / "run"),
              "--data", str(data), "--window", "33", "--batch", "2", "--intermediate", "64", "--threads", "1",
              "--eval-every", "1000", "--layers", "1", "--forwards", "2"]
    assert train_main([*common, "--max-steps", "2"]) == 0
    assert train_main([*common, "--max-steps", "3", "--out", str(tmp_path / "out")]) == 0
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert recs[-1]["step"] == 3 and recs[-1]["final"] and len(recs[-1]["chain_acc"]) == 4
    target = TargetModel.load(tmp_path / "t", "float32", "cpu")
    drafter = drafters.build("falcon", target, {"drafter": tmp_path / "out"})
    assert drafter.forwards == 2
    prompt = np.arange(3, 20)
    assert Engine(target, drafter, budget=10).generate(prompt, 20).token_ids == hf_greedy(target.model, prompt, 20)
