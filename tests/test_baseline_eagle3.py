"""EAGLE-3-style drafter: lossless with any weights, serving runs what training taught (TTT),
training learns, save/load round trips."""

import numpy as np
import pytest
import torch

from specblock.errors import SpecBlockError
from specblock.policies.branching import DynamicBranching
from specblock.runtime.drafters.base import DraftRequest
from specblock.runtime.drafters.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Net
from specblock.runtime.engine import Engine
from specblock.runtime.target import TargetModel
from specblock.training.eagle3_step import chain_acceptance, eagle3_step, ttt_states
from specblock.training.specblock_step import target_pass
from tiny import FAMILIES, tiny_model, hf_greedy, perturb

V = 16


def make(family="llama", seed=0, noise=0.0):
    model = tiny_model(family, vocab=V, seed=seed, layers=3)
    target = TargetModel(model)
    cfg = Eagle3Config(vocab_size=V, hidden_size=32, num_heads=4, intermediate_size=64, tap_layers=target.tap_layers)
    torch.manual_seed(seed)
    net = Eagle3Net(cfg)
    net.tie_to_target(model)
    if noise:  # "random weights": every trainable tensor moved far from its init
        perturb(net, noise)
    return model, target, net.eval()



@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("noise", [0.0, 0.5])
def test_lossless_greedy(family, noise):
    model, target, net = make(family, noise=noise)
    rng = np.random.default_rng(int(noise * 10))
    for length in (1, 5, 14):
        prompt = rng.integers(2, V, length)
        drafter = Eagle3Drafter(net, depth=int(rng.integers(2, 7)), top_k=int(rng.integers(1, 5)))
        res = Engine(target, drafter, budget=int(rng.integers(3, 25))).generate(prompt, 30)
        assert res.token_ids == hf_greedy(model, prompt, 30)
        assert max(res.stats.tree_depth) > 1


def test_tree_is_eagle2_shaped_and_within_budget():
    model, target, net = make("qwen3", seed=1)
    target.want_features = True
    prompt = np.arange(2, 12)
    drafter = Eagle3Drafter(net, depth=5, top_k=4)
    drafter.prefill(prompt, target.prefill(prompt[:-1]))
    tree = drafter.propose(DraftRequest(tokens=prompt, budget=20, max_depth=100))
    tree.check()
    assert tree.size - 1 == 20 and tree.max_depth >= 3
    # Every expanded node offers at most top_k children; the rerank keeps an ancestor-closed set.
    assert np.bincount(tree.parent[1:]).max() <= 4
    short = drafter.propose(DraftRequest(tokens=prompt, budget=20, max_depth=2))
    assert short.max_depth <= 2



def test_trees_take_the_one_size_tree_sizes_names():
    """A compiled server warms only ``tree_sizes`` (``Engine.warm_compiled``): with the default
    policy every tree away from the context's end has that size, whatever the depth, top-k and
    budget; a user's policy gets every size."""
    model, target, net = make("llama", seed=2)
    target.want_features = True
    rng = np.random.default_rng(5)
    prompt = np.arange(2, 12)
    for _ in range(12):
        depth, top_k, budget = (int(x) for x in rng.integers(1, [7, 5, 30]))
        drafter = Eagle3Drafter(net, depth=depth, top_k=top_k)
        drafter.reset()
        drafter.prefill(prompt, target.prefill(prompt[:-1]))
        tree = drafter.propose(DraftRequest(tokens=prompt, budget=budget, max_depth=100))
        assert (tree.size,) == drafter.tree_sizes(budget), (depth, top_k, budget)

    class Wider(DynamicBranching):
        pass

    assert Eagle3Drafter(net, policy=Wider(top_k=2)).tree_sizes(3) == (1, 2, 3, 4)


def test_traces_log_each_expanded_nodes_candidates_and_the_targets_rank():
    """Per expanded node the trace holds the drafter's whole top-k and the target's rank among it
    (the sim's position pool); a correct child's rank is that rank."""
    import io
    import json

    model, target, net = make("llama", seed=2, noise=0.3)
    buf = io.StringIO()
    eng = Engine(target, Eagle3Drafter(net, depth=4, top_k=3), budget=8, trace=buf)
    eng.generate(np.arange(2, 14), 24)
    recs = [json.loads(x) for x in buf.getvalue().splitlines()]
    assert recs and all("positions" in r for r in recs if r["tree_size"] > 1)
    seen = 0
    for r in recs:
        if "positions" not in r:
            continue
        nd, pos = r["nodes"], r["positions"]
        assert all(len(row) == 3 and row == sorted(row, reverse=True) for row in pos["logp"])
        for node, tr in zip(pos["node"], pos["target_rank"]):
            kids = [i for i, p in enumerate(nd["parent"]) if p == node]
            hit = [nd["rank"][i] for i in kids if nd["correct"][i]]
            if hit:
                assert tr == hit[0]
                seen += 1
            elif kids:
                assert tr not in [nd["rank"][i] for i in kids]
    assert seen > 0


def test_serving_chain_equals_training_steps():
    """A top-1 chain drafted at serving time has, at every depth, the log-probs that the
    training-time test computes at the same rows: TTT teaches exactly what serving runs."""
    model, target, net = make("qwen2", seed=2, noise=0.3)
    target.want_features = True
    prompt = np.random.default_rng(0).integers(2, V, 9)
    depth = 5
    drafter = Eagle3Drafter(net, depth=depth, top_k=1, policy=DynamicBranching(top_k=1))
    drafter.prefill(prompt, target.prefill(prompt[:-1]))
    tree = drafter.propose(DraftRequest(tokens=prompt, budget=depth, max_depth=depth))
    assert tree.size == depth + 1 and (tree.parent[1:] == np.arange(depth)).all()
    seq = torch.as_tensor(np.concatenate([prompt, tree.tokens[1:depth]]))[None]
    with torch.no_grad():
        tp = target_pass(model, seq, target.tap_layers)
        states = ttt_states(net, tp.taps, seq, depth)
    root = len(prompt) - 1
    for d in range(1, depth + 1):
        lp = torch.log_softmax(net.logits(states[d - 1][0, root - 2 + d]).detach(), -1)
        assert int(lp.argmax()) == int(tree.tokens[d])
        assert abs(float(lp.max()) - float(tree.logprob[d])) < 2e-4


def test_training_learns_a_fixed_batch():
    model, target, net = make("llama", seed=4)
    net.train()
    tokens = torch.as_tensor(np.random.default_rng(1).integers(2, V, (2, 33)))
    tp = target_pass(model, tokens, target.tap_layers)
    opt = torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=1e-2)

    def acc():
        with torch.no_grad():
            return chain_acceptance(eagle3_step(net, tp, 3))

    before = acc()
    for _ in range(120):
        res = eagle3_step(net, tp, steps=3)
        opt.zero_grad()
        res.loss.backward()
        opt.step()
    after = acc()
    assert after[0] > before[0] + 0.2 and after[0] > 0.5
    assert after[1] > before[1]


def test_save_load_round_trip_and_mismatch(tmp_path):
    model, target, net = make(noise=0.1)
    net.save(tmp_path / "d")
    d = Eagle3Drafter.load(tmp_path / "d", target)
    loaded = d.net.state_dict()
    for name, a in net.state_dict().items():
        want = a if name in ("embed.weight", "lm_head.weight") else a.to(torch.bfloat16).float()
        torch.testing.assert_close(want, loaded[name].float())
    assert not d.net.embed.weight.requires_grad
    other = TargetModel(tiny_model("llama", vocab=V + 4, layers=3))
    with pytest.raises(SpecBlockError, match="trained for vocab"):
        Eagle3Drafter.load(tmp_path / "d", other)
    with pytest.raises(SpecBlockError, match="no EAGLE-3 drafter"):
        Eagle3Drafter.load(tmp_path / "missing", target)


def test_cli_eagle3_with_compare(tmp_path, capsys):
    import json

    from specblock.runtime.cli import main
    from tiny import save_tiny

    save_tiny(tmp_path / "t", "llama", vocab=96, ctx=128, layers=3)
    target = TargetModel.load(tmp_path / "t", "float32", "cpu")
    net = Eagle3Net(Eagle3Config(vocab_size=96, hidden_size=32, num_heads=4, intermediate_size=64, tap_layers=target.tap_layers))
    net.tie_to_target(target.model)
    net.save(tmp_path / "d")
    code = main(["--target", str(tmp_path / "t"), "--method", "eagle3", "--drafter", str(tmp_path / "d"),
                 "--prompt", "abc abc", "--max-new-tokens", "16", "--dtype", "float32", "--compare", "ar", "--json"])
    rec = json.loads(capsys.readouterr().out)
    assert code == 0 and rec["identical_to_ar"] is True and rec["mean_tree_size"] > 1


def test_engine_sets_the_drafters_taps_on_a_shared_target():
    """Two engines on one target, drafters reading different layers: each generate uses its own."""
    model, target, net = make("llama", seed=5, noise=0.2)
    other = Eagle3Net(net.cfg.model_copy(update={"tap_layers": (0, 1, 2)}))
    other.tie_to_target(model)
    prompt = np.arange(2, 10)
    ref = hf_greedy(model, prompt, 12)
    for d in (Eagle3Drafter(net), Eagle3Drafter(other.eval()), Eagle3Drafter(net)):
        res = Engine(target, d, budget=8).generate(prompt, 12)
        assert target.tap_layers == d.tap_layers and res.token_ids == ref
