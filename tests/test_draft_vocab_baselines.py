"""Draft vocabulary and feature-cache training for EAGLE-3, Medusa, ParallelSpec and Falcon (issue 14): a reduced head
stays lossless, never drafts a token outside its map, round-trips with its map, masks targets
outside it in training, and every method trains from a feature cache (SpS: the cached top-k alone)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from specblock.runtime.drafters.base import DraftRequest
from specblock.runtime.drafters.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Net
from specblock.runtime.drafters.falcon import FalconConfig, FalconDrafter, FalconNet
from specblock.runtime.drafters.medusa import MedusaConfig, MedusaDrafter, MedusaNet
from specblock.runtime.drafters.parallelspec import ParallelSpecConfig, ParallelSpecDrafter, ParallelSpecNet
from specblock.runtime.engine import Engine
from specblock.runtime.target import TargetModel
from specblock.training.eagle3_step import eagle3_step
from specblock.training.falcon_step import falcon_step
from specblock.training.medusa_step import medusa_pass, medusa_step
from specblock.training.parallelspec_step import parallelspec_step
from specblock.training.specblock_step import target_pass
from tests.test_featcache import tiny_feature_cache
from tests.tiny import hf_greedy, perturb, tiny_model

V, N = 32, 12
DRAFTERS = {"eagle3": Eagle3Drafter, "medusa": MedusaDrafter, "parallelspec": ParallelSpecDrafter,
            "falcon": FalconDrafter}


def make(method: str, seed: int = 0, draft_vocab: int | None = N):
    model = tiny_model("llama", vocab=V, seed=seed, layers=3)
    target = TargetModel(model)
    torch.manual_seed(seed)
    if method == "eagle3":
        net = Eagle3Net(Eagle3Config(vocab_size=V, hidden_size=32, num_heads=4, intermediate_size=64,
                                     tap_layers=target.tap_layers, top_k=4, draft_vocab=draft_vocab))
    elif method == "medusa":
        net = MedusaNet(MedusaConfig(vocab_size=V, hidden_size=32, heads=3, top_k=4, draft_vocab=draft_vocab))
    else:
        common = dict(vocab_size=V, hidden_size=32, num_heads=4, intermediate_size=64, tap_layers=target.tap_layers,
                      top_k=4, draft_vocab=draft_vocab)
        net = (ParallelSpecNet(ParallelSpecConfig(**common, k=4)) if method == "parallelspec"
               else FalconNet(FalconConfig(**common, block_size=2, forwards=3)))
    if draft_vocab is not None:
        net.set_vocab(torch.as_tensor(np.sort(np.random.default_rng(seed).choice(V, draft_vocab, replace=False))))
    net.tie_to_target(model)
    perturb(net, 0.3)
    return model, target, net.eval()


@pytest.mark.parametrize("method", sorted(DRAFTERS))
def test_reduced_head_is_lossless_and_drafts_only_its_tokens(method):
    model, target, net = make(method, seed=1)
    allowed = set(net.d2t.tolist())
    target.want_features = True
    rng = np.random.default_rng(0)
    for length in (1, 5, 13):
        prompt = rng.integers(2, V, length)
        res = Engine(target, DRAFTERS[method](net), budget=12).generate(prompt, 30)
        assert res.token_ids == hf_greedy(model, prompt, 30)
        d = DRAFTERS[method](net)
        d.prefill(prompt, target.prefill(prompt[:-1]))
        tree = d.propose(DraftRequest(tokens=prompt, budget=12, max_depth=20))
        if length > 1:
            assert tree.size > 1 and set(tree.tokens[1:].tolist()) <= allowed


@pytest.mark.parametrize("method", sorted(DRAFTERS))
def test_save_load_keeps_the_map(method, tmp_path):
    model, target, net = make(method, seed=2)
    net.save(tmp_path / "d")
    loaded = DRAFTERS[method].load(tmp_path / "d", target).net
    assert torch.equal(loaded.d2t, net.d2t) and loaded.lm_head.weight.shape == (N, 32)
    torch.testing.assert_close(loaded.lm_head.weight, model.lm_head.weight[net.d2t])
    with safe_open(str(tmp_path / "d" / "model.safetensors"), "pt") as fh:
        assert fh.get_tensor("d2t").dtype == torch.int64 and "lm_head.weight" not in fh.keys()
    # A full-vocabulary drafter keeps its old files: no d2t saved.
    _, _, full = make(method, seed=2, draft_vocab=None)
    full.save(tmp_path / "f")
    with safe_open(str(tmp_path / "f" / "model.safetensors"), "pt") as fh:
        assert "d2t" not in fh.keys()
    assert DRAFTERS[method].load(tmp_path / "f", target).net.lm_head.weight.shape == (V, 32)


@torch.no_grad()
def test_targets_outside_the_vocab_are_not_supervised():
    """Changing the soft target where the target's argmax has no head row changes neither loss."""
    model, target, net = make("eagle3", seed=3)
    tokens = torch.as_tensor(np.random.default_rng(0).integers(2, V, (2, 17)))
    tp = target_pass(model, tokens, target.tap_layers, net)
    assert not bool(tp.y_ok.all())
    res = eagle3_step(net, tp, 3)
    tp.e_target[~tp.y_ok] = 1e3
    assert float(eagle3_step(net, tp, 3).loss) == pytest.approx(float(res.loss))
    assert not bool(res.top1[0][~tp.y_ok[:, 1:]].any())
    model, target, mnet = make("medusa", seed=3)
    mp = medusa_pass(model, tokens, mnet)
    mres = medusa_step(mnet, mp)
    mp.e_target[~mp.y_ok] = 1e3
    assert float(medusa_step(mnet, mp).loss) == pytest.approx(float(mres.loss))
    assert torch.isfinite(medusa_step(mnet, mp, hard=True).loss)


@pytest.mark.parametrize("method", ["parallelspec", "falcon"])
@torch.no_grad()
def test_depth_drafters_do_not_supervise_targets_outside_the_vocab(method):
    model, target, net = make(method, seed=4)
    tokens = torch.as_tensor(np.random.default_rng(1).integers(2, V, (2, 17)))
    tp = target_pass(model, tokens, target.tap_layers, net)
    assert not bool(tp.y_ok.all())
    step = (lambda: parallelspec_step(net, tp)) if method == "parallelspec" else (lambda: falcon_step(net, tp, 3, 0.0))
    res = step()
    tp.e_target[~tp.y_ok] = 1e3
    assert float(step().loss) == pytest.approx(float(res.loss))
    w = tokens.shape[1]
    label = (torch.arange(w - 1)[:, None] + torch.arange(1, res.top1.shape[-1] + 1)).clamp(max=w - 1)
    assert not bool(res.top1[~tp.y_ok[:, label]].any())  # a token without a head row is never a hit


@pytest.mark.parametrize("method", sorted(DRAFTERS))
def test_trainer_from_a_feature_cache_with_a_draft_vocab(method, tmp_path):
    from specblock.training.drafter import main as train_main

    tdir, model, _ = tiny_feature_cache(tmp_path)
    out = tmp_path / "drafter"
    train_main(["--method", method, "--target", str(tdir), "--features", str(tmp_path / "cache"), "--draft-vocab", "20",
                "--run-dir", str(tmp_path / "run"), "--out", str(out), "--window", "17", "--batch", "2",
                "--max-steps", "3", "--eval-every", "2", "--intermediate", "32", "--ttt-steps", "2", "--heads", "2",
                "--K", "3", "--forwards", "2", "--threads", "1"])
    target = TargetModel(model)
    net = DRAFTERS[method].load(out, target).net
    assert net.cfg.draft_vocab == 20 and net.lm_head.weight.shape[0] == 20
    torch.testing.assert_close(net.lm_head.weight, model.lm_head.weight[net.d2t])
    if method == "medusa":  # the held-out calibration from the cache reached the exported config
        assert net.cfg.rank_acc is not None and len(net.cfg.rank_acc) == 2
    target.want_features = True
    prompt = np.arange(3, 12)
    res = Engine(target, DRAFTERS[method](net), budget=12).generate(prompt, 20)
    assert res.token_ids == hf_greedy(model, prompt, 20)


@pytest.mark.parametrize("method", sorted(DRAFTERS))
def test_vocab_sweep_reheads_a_drafter_without_touching_its_trained_weights(method, tmp_path):
    """experiments/vocab_sweep.py: the same drafter over another draft vocabulary (or all rows)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "experiments" / "vocab_sweep.py"
    spec = importlib.util.spec_from_file_location("vocab_sweep", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model, target, net = make(method, seed=5)
    for d2t in (None, np.arange(2, 2 + N + 6)):
        new = mod.reheaded(net, model, d2t)
        rows = V if d2t is None else len(d2t)
        assert new.lm_head.weight.shape == (rows, 32) and new.cfg.draft_vocab == (None if d2t is None else rows)
        torch.testing.assert_close(new.lm_head.weight, model.lm_head.weight if d2t is None else model.lm_head.weight[d2t])
        for k, v in net.state_dict().items():
            if k not in ("d2t", "lm_head.weight"):
                assert torch.equal(new.state_dict()[k], v), k
        target.want_features = True
        prompt = np.arange(3, 12)
        assert Engine(target, DRAFTERS[method](new), budget=12).generate(prompt, 20).token_ids == hf_greedy(model, prompt, 20)
        new.save(tmp_path / str(rows))
        assert DRAFTERS[method].load(tmp_path / str(rows), target).net.lm_head.weight.shape == (rows, 32)


def test_vocab_sweep_evaluates_every_head_method_on_the_cache(tmp_path):
    """Held-out figures for every method with an LM head (Medusa reads the top state, the others the taps)."""
    import importlib.util
    from pathlib import Path

    from specblock.training.drafter import main as train_main

    path = Path(__file__).resolve().parents[1] / "experiments" / "vocab_sweep.py"
    spec = importlib.util.spec_from_file_location("vocab_sweep", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from specblock.training.featcache import FeatureCache

    tdir, model, cache = tiny_feature_cache(tmp_path)
    for method in ("medusa", "falcon"):
        out = tmp_path / method
        train_main(["--method", method, "--target", str(tdir), "--features", str(cache), "--draft-vocab", "20",
                    "--run-dir", str(tmp_path / f"run_{method}"), "--out", str(out), "--window", "17", "--batch", "2",
                    "--max-steps", "1", "--eval-every", "1", "--intermediate", "32", "--heads", "2",
                    "--forwards", "2", "--threads", "1"])
        net = mod.load(method, out, model)
        row = mod.evaluate(method, net, FeatureCache(cache, tdir), 2, window=17)
        assert 0 < row["coverage"] <= 1
        assert ("head_top1" in row) == (method == "medusa") and ("chain_acc" in row) == (method == "falcon")


def test_sps_trains_from_a_feature_cache_and_refuses_a_draft_vocab(tmp_path):
    """The SpS draft model distils from the cached top-k (no target pass per step); the export is
    an HF model the sps drafter serves losslessly. A draft vocabulary is refused in one line."""
    from specblock.errors import SpecBlockError
    from specblock.runtime.drafters.sps import SpsDrafter
    from specblock.training.drafter import main as train_main

    tdir, model, cache = tiny_feature_cache(tmp_path)
    common = ["--method", "sps", "--target", str(tdir), "--features", str(cache), "--window", "17", "--batch", "2",
              "--max-steps", "3", "--eval-every", "2", "--layers", "1", "--intermediate", "32",
              "--draft-hidden", "16", "--tie-embeddings", "--threads", "1"]
    with pytest.raises(SpecBlockError, match="drop --draft-vocab"):
        train_main(common + ["--run-dir", str(tmp_path / "r0"), "--draft-vocab", "20"])
    out = tmp_path / "sps"
    train_main(common + ["--run-dir", str(tmp_path / "run"), "--out", str(out)])
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert 0.0 <= metrics[-1]["alpha"] <= 1.0
    target = TargetModel(model)
    prompt = np.arange(3, 12)
    res = Engine(target, SpsDrafter.load(out, target), budget=6).generate(prompt, 20)
    assert res.token_ids == hf_greedy(model, prompt, 20)


def test_a_narrow_tied_sps_model_starts_from_the_targets_principal_directions():
    from specblock.training.sps_step import build_draft, principal_rows

    model = tiny_model("llama", vocab=V, seed=0, layers=2)
    emb = model.get_input_embeddings().weight.detach().float()
    net = build_draft(model, layers=1, intermediate=32, hidden=8, tie=True)
    got = net.model.get_input_embeddings().weight.detach()
    torch.testing.assert_close(got, principal_rows(emb, 8))
    assert net.model.get_input_embeddings().weight is net.model.get_output_embeddings().weight  # still tied
    # the projection keeps the rows' Gram matrix up to the dropped directions: rank-8 best fit
    err = torch.linalg.matrix_norm(got @ got.T - emb @ emb.T)
    s = torch.linalg.svdvals(emb)
    assert float(err) <= float(torch.sqrt((s[8:] ** 4).sum())) * 1.01 + 1e-4
