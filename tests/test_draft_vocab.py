"""Draft vocabulary (issue 14): a SpecBlock head of N target tokens stays lossless, never drafts a
token outside its map, round-trips with its map, and trains from a feature cache."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specblock.errors import SpecBlockError
from specblock.policies.branching import RankBucketBranching
from specblock.runtime.drafters.base import DraftRequest
from specblock.runtime.drafters.specblock import SpecBlockDrafter
from specblock.runtime.drafters.specblock_net import SpecBlockConfig, SpecBlockNet
from specblock.runtime.engine import Engine
from specblock.runtime.target import TargetModel
from specblock.training import vocab
from specblock.training.specblock_step import specblock_step, target_pass, to_draft_vocab
from tests.test_featcache import tiny_feature_cache
from tests.tiny import hf_greedy, tiny_model

V, N = 32, 12


def make(seed: int = 0):
    model = tiny_model("llama", vocab=V, seed=seed, layers=3)
    target = TargetModel(model)
    cfg = SpecBlockConfig(vocab_size=V, hidden_size=32, num_heads=4, intermediate_size=64, tap_layers=target.tap_layers,
                          top_k=6, draft_vocab=N)
    torch.manual_seed(seed)
    net = SpecBlockNet(cfg)
    d2t = torch.as_tensor(np.sort(np.random.default_rng(seed).choice(V, N, replace=False)))
    net.set_vocab(d2t)
    net.tie_to_target(model)
    with torch.no_grad():
        for p in net.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    return model, target, net.eval()


@pytest.mark.parametrize("M", [1, 2])
def test_reduced_head_is_lossless_and_drafts_only_its_tokens(M):
    model, target, net = make(M)
    allowed = set(net.d2t.tolist())
    rng = np.random.default_rng(M)
    for length in (1, 5, 13):
        prompt = rng.integers(2, V, length)
        drafter = SpecBlockDrafter(net, M=M, policy=RankBucketBranching((2, 3, 4, 2)))
        res = Engine(target, drafter, budget=20).generate(prompt, 30)
        assert res.token_ids == hf_greedy(model, prompt, 30)
        assert max(res.stats.tree_size) > 1
        # propose directly: every drafted node (not the root) is a draft-vocabulary token
        d = SpecBlockDrafter(net, M=M, policy=RankBucketBranching((2, 3, 4, 2)))
        d.prefill(prompt, target.prefill(prompt[:-1]))
        tree = d.propose(DraftRequest(tokens=prompt, budget=20, max_depth=20))
        assert tree.size > 1 and set(tree.tokens[1:].tolist()) <= allowed


def test_save_load_keeps_the_map(tmp_path):
    model, target, net = make(3)
    net.save(tmp_path / "d")
    loaded = SpecBlockDrafter.load(tmp_path / "d", target).net
    assert torch.equal(loaded.d2t, net.d2t) and loaded.lm_head.weight.shape == (N, 32)
    torch.testing.assert_close(loaded.lm_head.weight, model.lm_head.weight[net.d2t])
    t2d = loaded.t2d()
    assert torch.equal(t2d[loaded.d2t], torch.arange(N)) and int((t2d >= 0).sum()) == N


def test_top_n_and_coverage():
    counts = np.array([5, 0, 9, 9, 1, 3])
    assert vocab.top_n(counts, 3).tolist() == [0, 2, 3]
    assert vocab.top_n(counts, 4).tolist() == [0, 2, 3, 5]
    assert vocab.coverage(counts, vocab.top_n(counts, 3)) == pytest.approx(23 / 27)
    with pytest.raises(SpecBlockError, match="draft-vocab"):
        vocab.top_n(counts, 7)
    assert vocab.count_tokens([np.array([1, 1, 4]), np.array([4])], 6).tolist() == [0, 2, 0, 0, 2, 0]


def test_cache_soft_targets_match_the_target_pass():
    """Soft targets built from a (here: complete) top-k list equal the on-the-fly target pass's,
    and a position whose argmax has no head row is cut from the valid-prefix chain."""
    model, target, net = make(5)
    tokens = torch.as_tensor(np.random.default_rng(0).integers(2, V, (2, 17)))
    tp = target_pass(model, tokens, target.tap_layers, net)
    with torch.no_grad():
        logits = model(tokens).logits.float()
    lp, ids = torch.log_softmax(logits, -1).sort(-1, descending=True)
    e, y, ok = to_draft_vocab(lp.exp(), ids, net.lm_head.weight, net.t2d())
    torch.testing.assert_close(e, tp.e_target, atol=1e-5, rtol=1e-4)
    assert torch.equal(y, tp.y_star) and torch.equal(ok, tp.y_ok)
    assert torch.equal(ok, torch.isin(logits.argmax(-1), net.d2t)) and not bool(ok.all())
    res = specblock_step(net, tp, torch.Generator().manual_seed(0), 1.0)
    m = res.blocks[0].mask  # [B, R, K]: position p, depth k reads y_ok at p + k + 1
    bad = ~tp.y_ok[:, 1:]  # depth 1 of the block at p targets position p + 1
    assert float(m[..., 0][bad].abs().sum()) == 0.0
    assert bool(torch.isfinite(res.loss))


def test_trainer_from_a_feature_cache_with_a_draft_vocab(tmp_path):
    from specblock.training.drafter import main as train_main
    from specblock.training.featcache import build_cache

    tdir, model, _ = tiny_feature_cache(tmp_path)
    data = tmp_path / "gen"
    out = tmp_path / "drafter"
    train_main(["--target", str(tdir), "--features", str(tmp_path / "cache"), "--draft-vocab", "20",
                "--run-dir", str(tmp_path / "run"), "--out", str(out), "--window", "17", "--batch", "2",
                "--max-steps", "3", "--eval-every", "2", "--layers", "1", "--intermediate", "32", "--threads", "1"])
    target = TargetModel(model)
    net = SpecBlockDrafter.load(out, target).net
    assert net.cfg.draft_vocab == 20 and net.lm_head.weight.shape[0] == 20
    prompt = np.arange(3, 12)
    res = Engine(target, SpecBlockDrafter(net, policy=RankBucketBranching((2, 3, 4, 2))), budget=16).generate(prompt, 20)
    assert res.token_ids == hf_greedy(model, prompt, 20)
    # Resume after featcache added a shard: the checkpoint's map wins over a recount of the new data.
    rows = (data / "shard_00002.jsonl").read_text().splitlines()
    (data / "shard_00003.jsonl").write_text("\n".join(rows[::-1]) + "\n")
    man = json.loads((data / "manifest.json").read_text())
    man["shards"]["shard_00003"] = {"sequences": len(rows)}
    (data / "manifest.json").write_text(json.dumps(man))
    build_cache(data, tmp_path / "cache", tdir, model, k=4, log=lambda s: None)
    train_main(["--target", str(tdir), "--features", str(tmp_path / "cache"), "--draft-vocab", "20",
                "--run-dir", str(tmp_path / "run"), "--out", str(tmp_path / "drafter2"), "--window", "17", "--batch", "2",
                "--max-steps", "5", "--eval-every", "2", "--layers", "1", "--intermediate", "32", "--threads", "1"])
    assert torch.equal(SpecBlockDrafter.load(tmp_path / "drafter2", target).net.d2t, net.d2t)
    # Fine-tuning (--init-from): the source's weights and map, a fresh step count, the source on record.
    from specblock.training.checkpoint import load_checkpoint

    flags = ["--target", str(tdir), "--features", str(tmp_path / "cache"), "--draft-vocab", "20", "--window", "17",
             "--batch", "2", "--eval-every", "2", "--layers", "1", "--intermediate", "32", "--threads", "1"]
    src = load_checkpoint(tmp_path / "run" / "ckpt.safetensors")
    train_main(flags + ["--run-dir", str(tmp_path / "ft"), "--init-from", str(tmp_path / "run"), "--max-steps", "2",
                        "--out", str(tmp_path / "drafter3")])
    ft = load_checkpoint(tmp_path / "ft" / "ckpt.safetensors")
    assert ft["step"] == 2 and ft["init"]["step"] == src["step"] == 5
    assert torch.equal(ft["net"]["d2t"], src["net"]["d2t"])
    assert not torch.equal(ft["net"]["fuse_taps.weight"], src["net"]["fuse_taps.weight"])  # it trained on
    assert torch.equal(SpecBlockDrafter.load(tmp_path / "drafter3", target).net.d2t, net.d2t)
    with pytest.raises(SpecBlockError, match="no ckpt.safetensors there"):
        train_main(flags + ["--run-dir", str(tmp_path / "ft2"), "--init-from", str(tmp_path / "nowhere")])
    assert not (tmp_path / "ft2").exists()  # refused before anything was written
    with pytest.raises(SpecBlockError, match="trained with other settings"):  # another architecture
        train_main(flags[:-6] + ["--layers", "2", "--intermediate", "32", "--threads", "1", "--run-dir",
                                 str(tmp_path / "ft3"), "--init-from", str(tmp_path / "run"), "--max-steps", "1"])
    with pytest.raises(SpecBlockError, match="drop --draft-vocab"):  # SpS takes --features, not a draft vocabulary
        train_main(["--method", "sps", "--target", str(tdir), "--features", str(tmp_path / "cache"),
                    "--draft-vocab", "20", "--run-dir", str(tmp_path / "run2")])


def test_adapting_a_reduced_head_stays_lossless_and_updates():
    """specblock+adapt on a draft-vocabulary drafter: the update maps the target's top-k to head rows."""
    from specblock.runtime.adapt import Adapter, AdaptSettings

    model, target, net = make(6)
    with torch.no_grad():
        net.rank_head[2].bias.copy_(torch.tensor([0.0, 0.0, 20.0, 0.0]))  # wide trees
    adapter = Adapter(SpecBlockDrafter(net, policy=RankBucketBranching((2, 4, 6, 0))),
                      AdaptSettings(window=3, steps=1, batch=2, buffer=8, max_ctx=64, top_k=8, arms=("heads",)))
    engine = Engine(target, adapter, budget=16)
    rng = np.random.default_rng(0)
    for _ in range(3):
        p = rng.integers(2, V, 9)
        res = engine.generate(p, 30, on_tokens=lambda _: adapter.wait(10))
        assert res.token_ids == hf_greedy(model, p, 30)
    adapter.close()
    assert adapter.swaps >= 1 and adapter.failures == 0
    assert not torch.equal(adapter.theta_inf.lm_head.weight.float(), adapter.theta_0.lm_head.weight)


def test_heldout_block1_counts_tokens_outside_the_draft_vocab_as_misses():
    """Held-out block-1 acceptance divides by every position, as serving sees them: a target token
    without a draft-vocabulary row can never be drafted, so it is a miss, not a position left out."""
    import argparse

    from specblock.training import recipes

    model, target, net = make(5)
    tokens = torch.as_tensor(np.random.default_rng(1).integers(2, V, (4, 17)))
    tp = target_pass(model, tokens, target.tap_layers, net)
    assert not bool(tp.y_ok.all())  # some argmax tokens have no head row
    ev = recipes.get("specblock").evaluate(net, None, tp, argparse.Namespace())
    with torch.no_grad():
        from specblock.training.specblock_step import first_block

        pred = net.heads(first_block(net, tp.taps, tp.tokens)[0])[0].argmax(-1)[..., 0]  # [B, R]: depth 1
    right = (pred == tp.y_star[:, 1:]) & tp.y_ok[:, 1:]
    assert ev["block1_acc"][0] == pytest.approx(float(right.float().mean()), abs=1e-4)
