"""ParallelSpec-style drafter: lossless with any weights, serving runs what training taught,
training learns, save/load round trips, the trainer's recipe exports a drafter the registry serves."""

import json

import numpy as np
import pytest
import torch

from specblock.errors import SpecBlockError
from specblock.runtime import drafters
from specblock.runtime.drafters.base import DraftRequest
from specblock.runtime.drafters.parallelspec import ParallelSpecConfig, ParallelSpecDrafter, ParallelSpecNet
from specblock.runtime.engine import Engine
from specblock.runtime.target import TargetModel
from specblock.training.parallelspec_step import chain_acceptance, parallelspec_states, parallelspec_step
from specblock.training.specblock_step import target_pass
from tiny import FAMILIES, hf_greedy, perturb, save_tiny, tiny_model

V = 16


def make(family="llama", seed=0, noise=0.0, k=4, layers=1):
    model = tiny_model(family, vocab=V, seed=seed, layers=3)
    target = TargetModel(model)
    cfg = ParallelSpecConfig(vocab_size=V, hidden_size=32, num_heads=4, num_layers=layers, intermediate_size=64,
                             tap_layers=target.tap_layers, k=k)
    torch.manual_seed(seed)
    net = ParallelSpecNet(cfg)
    net.tie_to_target(model)
    if noise:
        perturb(net, noise)
    return model, target, net.eval()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("noise", [0.0, 0.5])
def test_lossless_greedy(family, noise):
    model, target, net = make(family, noise=noise, layers=1 + int(noise > 0))
    rng = np.random.default_rng(int(noise * 10))
    for length in (1, 2, 5, 14):
        prompt = rng.integers(2, V, length)
        top_k = int(rng.integers(1, 4))
        drafter = ParallelSpecDrafter(net, top_k=top_k)
        res = Engine(target, drafter, budget=int(rng.integers(top_k + 1, 25))).generate(prompt, 30)
        assert res.token_ids == hf_greedy(model, prompt, 30)
        assert max(res.stats.tree_depth) > 1


def test_one_forward_tree_shape_and_limits():
    model, target, net = make("qwen3", seed=1, noise=0.2, k=5)
    target.want_features = True
    prompt = np.arange(2, 12)
    drafter = ParallelSpecDrafter(net, top_k=3)
    drafter.prefill(prompt, target.prefill(prompt[:-1]))
    tree = drafter.propose(DraftRequest(tokens=prompt, budget=24, max_depth=100))
    tree.check()
    assert tree.max_depth == 5 and tree.size - 1 == 15  # 3 candidates at each of 5 depths
    # Siblings are leaves: only the top-1 spine has children.
    assert set(tree.parent[1:]) <= {0, *np.nonzero(tree.rank == 0)[0]}
    drafter.prefill(prompt, target.prefill(prompt[:-1]))
    short = drafter.propose(DraftRequest(tokens=prompt, budget=4, max_depth=2))
    assert short.max_depth <= 2 and short.size - 1 <= 4


def test_serving_equals_training_states():
    """The chain drafted at serving time has, at every depth, the log-probs that the training
    pass computes at the same row: training teaches exactly the one-forward mask group."""
    model, target, net = make("qwen2", seed=2, noise=0.3, k=4, layers=2)
    target.want_features = True
    prompt = np.random.default_rng(0).integers(2, V, 9)
    drafter = ParallelSpecDrafter(net, top_k=1)
    drafter.prefill(prompt, target.prefill(prompt[:-1]))
    tree = drafter.propose(DraftRequest(tokens=prompt, budget=4, max_depth=4))
    assert tree.size == 5 and (tree.parent[1:] == np.arange(4)).all()
    seq = torch.as_tensor(np.concatenate([prompt, tree.tokens[1:4]]))[None]
    with torch.no_grad():
        states = parallelspec_states(net, target_pass(model, seq, target.tap_layers))
        lp = torch.log_softmax(net.logits(states[0, len(prompt) - 2]), -1)
    assert (lp.argmax(-1).numpy() == tree.tokens[1:]).all()
    np.testing.assert_allclose(lp.max(-1).values.numpy(), tree.logprob[1:], atol=2e-4)


def test_training_learns_a_fixed_batch():
    model, target, net = make("llama", seed=4, k=3)
    net.train()
    tokens = torch.as_tensor(np.random.default_rng(1).integers(2, V, (2, 33)))
    tp = target_pass(model, tokens, target.tap_layers)
    opt = torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=1e-2)
    with torch.no_grad():
        before = parallelspec_step(net, tp)
    for _ in range(80):
        res = parallelspec_step(net, tp)
        opt.zero_grad()
        res.loss.backward()
        opt.step()
    with torch.no_grad():
        after = parallelspec_step(net, tp)
    assert float(after.loss) < float(before.loss) - 0.5  # soft CE: the target's entropy is the floor
    acc0, acc1 = chain_acceptance(before), chain_acceptance(after)
    assert acc1[0] > acc0[0] + 0.2 and acc1[1] > acc0[1]


def test_save_load_round_trip_and_mismatch(tmp_path):
    model, target, net = make(noise=0.1)
    net.save(tmp_path / "d")
    d = ParallelSpecDrafter.load(tmp_path / "d", target)
    loaded = d.net.state_dict()
    for name, a in net.state_dict().items():
        want = a if name in ("embed.weight", "lm_head.weight") else a.to(torch.bfloat16).float()
        torch.testing.assert_close(want, loaded[name].float())
    assert d.net.cfg == net.cfg and not d.net.lm_head.weight.requires_grad
    other = TargetModel(tiny_model("llama", vocab=V + 4, layers=3))
    with pytest.raises(SpecBlockError, match="trained for vocab"):
        ParallelSpecDrafter.load(tmp_path / "d", other)
    with pytest.raises(SpecBlockError, match="no ParallelSpec drafter"):
        ParallelSpecDrafter.load(tmp_path / "missing", target)


def test_trainer_recipe_resumes_exports_and_serves(tmp_path, monkeypatch):
    import specblock.training.windows as windows
    from specblock.training.drafter import main as train_main

    monkeypatch.setattr(windows, "CACHE_ROOT", tmp_path / "cache")
    save_tiny(tmp_path / "t", "llama", vocab=96, ctx=128, layers=3)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"line {i} " + "abc def " * 12}) + "\n" for i in range(60)))
    common = ["--method", "parallelspec", "--target", str(tmp_path / "t"), "--run-dir", str(tmp_path / "run"),
              "--data", str(data), "--window", "33", "--batch", "2", "--intermediate", "64", "--threads", "1",
              "--eval-every", "1000", "--layers", "1", "--K", "3"]
    assert train_main([*common, "--max-steps", "2"]) == 0
    assert train_main([*common, "--max-steps", "3", "--out", str(tmp_path / "out")]) == 0
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert recs[-1]["step"] == 3 and recs[-1]["final"] and len(recs[-1]["chain_acc"]) == 3
    target = TargetModel.load(tmp_path / "t", "float32", "cpu")
    drafter = drafters.build("parallelspec", target, {"drafter": tmp_path / "out"})
    prompt = np.arange(3, 20)
    assert Engine(target, drafter, budget=10).generate(prompt, 20).token_ids == hf_greedy(target.model, prompt, 20)
