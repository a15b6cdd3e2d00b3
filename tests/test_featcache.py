"""Feature cache (training/featcache.py): resumable, refuses another target, features equal a direct forward."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from specblock.errors import SpecBlockError
from specblock.runtime.target import default_taps, load_causal_lm
from specblock.training.featcache import FeatureCache, as_tensor, build_cache, target_identity
from tests.tiny import save_tiny


def _fake_chatgen(data, target_dir, shards: int = 2, seed: int = 0, vocab: int = 64) -> None:
    """A chatgen directory as chatgen writes it (answers need not be the model's: features do not care)."""
    rng = np.random.default_rng(seed)
    data.mkdir()
    man = {"target": "tiny", "target_sha256": target_identity(target_dir)["weights_sha256"], "heldout_shards": [0],
           "shards": {}}
    for s in range(shards):
        rows = [{"id": f"{s}/{i}", "domain": "chat", "prompt_ids": rng.integers(3, vocab, int(rng.integers(3, 9))).tolist(),
                 "answer_ids": rng.integers(3, vocab, int(rng.integers(1, 20))).tolist(), "stopped": True} for i in range(5)]
        (data / f"shard_{s:05d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        man["shards"][f"shard_{s:05d}"] = {"sequences": 5}
    (data / "manifest.json").write_text(json.dumps(man))


def tiny_feature_cache(tmp_path):
    """A 9-layer tiny target, its fp32 model and a 3-shard feature cache of fake answers."""
    target = save_tiny(tmp_path / "t", layers=9)
    _fake_chatgen(tmp_path / "gen", target, shards=3)
    model = load_causal_lm(target, "float32", "cpu", "sdpa", False).eval()
    build_cache(tmp_path / "gen", tmp_path / "cache", target, model, k=4, log=lambda s: None)
    return target, model, tmp_path / "cache"


@pytest.fixture()
def setup(tmp_path):
    target = save_tiny(tmp_path / "t", layers=9)
    data = tmp_path / "gen"
    _fake_chatgen(data, target)
    model = load_causal_lm(target, "float32", "cpu", "sdpa", False).eval()
    return target, data, model


def test_features_equal_direct_forward_and_resume(setup, tmp_path):
    target, data, model = setup
    out = tmp_path / "cache"
    man = build_cache(data, out, target, model, k=4, batch_tokens=40, max_shards=1, log=lambda s: None)
    assert list(man["shards"]) == ["shard_00000"]
    first = (out / "shard_00000" / "taps.npy").stat().st_mtime_ns
    man = build_cache(data, out, target, model, k=4, batch_tokens=40, log=lambda s: None)  # resumes
    assert list(man["shards"]) == ["shard_00000", "shard_00001"]
    assert (out / "shard_00000" / "taps.npy").stat().st_mtime_ns == first  # not recomputed
    assert man["totals"]["tokens"] == sum(s["tokens"] for s in man["shards"].values())
    cache = FeatureCache(out, target)
    cache.verify()
    taps = default_taps(9)
    rows = [json.loads(x) for x in (data / "shard_00001.jsonl").read_text().splitlines()]
    sh = cache.shard("shard_00001")
    for i, r in enumerate(rows):
        seq = r["prompt_ids"] + r["answer_ids"]
        a, b = int(sh.offsets[i]), int(sh.offsets[i + 1])
        assert sh.tokens[a:b].tolist() == seq and sh.prompt_lens[i] == len(r["prompt_ids"])
        with torch.no_grad():
            ref = model(torch.tensor([seq]), output_hidden_states=True)
        want = torch.cat([ref.hidden_states[t][0] for t in taps], -1)
        torch.testing.assert_close(as_tensor(sh.taps[a:b], cache.bf16), want, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(as_tensor(sh.top[a:b], cache.bf16), ref.hidden_states[-1][0], atol=1e-5, rtol=1e-4)
        lp, ids = torch.log_softmax(ref.logits[0], -1).topk(4, -1)
        assert torch.equal(torch.from_numpy(np.array(sh.topk_ids[a:b])), ids.int())
        torch.testing.assert_close(torch.from_numpy(np.array(sh.topk_logp[a:b])), lp, atol=1e-5, rtol=1e-4)


def test_bf16_features_stored_bit_exact(setup, tmp_path):
    target, data, _ = setup
    model = load_causal_lm(target, "bfloat16", "cpu", "sdpa", False).eval()
    out = tmp_path / "cache16"
    build_cache(data, out, target, model, k=2, batch_tokens=1, max_shards=1, log=lambda s: None)  # one sequence per forward
    cache = FeatureCache(out, target)
    sh = cache.shard("shard_00000")
    seq = sh.tokens[int(sh.offsets[0]):int(sh.offsets[1])].tolist()
    with torch.no_grad():
        ref = model(torch.tensor([seq]), output_hidden_states=True)
    got = as_tensor(sh.top[:len(seq)], cache.bf16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, ref.hidden_states[-1][0])


def test_q4_features_are_the_served_targets_bit_for_bit(tmp_path):
    """``--dtype q4``: each sequence's taps equal what the served q4 target's prefill hands a drafter,
    and its soft targets the served logits' top-k; the cache says q4, and another dtype cannot carry it on."""
    from specblock.runtime.target import TargetModel
    from tests.tiny import Q4_VOCAB, save_tiny_q4

    target = save_tiny_q4(tmp_path / "t", layers=9)
    data = tmp_path / "gen"
    _fake_chatgen(data, target, vocab=Q4_VOCAB)
    served = TargetModel.load(target, "q4", "cpu")
    served.want_features = True
    out = tmp_path / "cache"
    man = build_cache(data, out, target, served.model, k=4, max_shards=1, log=lambda s: None)
    assert man["dtype"] == "q4"
    cache = FeatureCache(out, target)
    cache.verify()
    assert not cache.bf16
    sh = cache.shard("shard_00000")
    for i in range(len(sh.offsets) - 1):
        a, b = int(sh.offsets[i]), int(sh.offsets[i + 1])
        got = served.prefill(np.array(sh.tokens[a:b]))  # taps at every position, logits at the last
        assert torch.equal(as_tensor(sh.taps[a:b], cache.bf16), got.taps)
        assert torch.equal(as_tensor(sh.top[a:b], cache.bf16), got.top)
        lp, ids = torch.log_softmax(got.logits[-1].float(), -1).topk(4)
        assert torch.equal(torch.from_numpy(np.array(sh.topk_ids[b - 1])), ids.int())
    fp32 = load_causal_lm(target, "float32", "cpu", "sdpa", False).eval()
    with pytest.raises(SpecBlockError, match="pass the same settings"):
        build_cache(data, out, target, fp32, k=4, log=lambda s: None)


def test_refuses_another_target(setup, tmp_path):
    target, data, model = setup
    out = tmp_path / "cache"
    build_cache(data, out, target, model, k=2, max_shards=1, log=lambda s: None)
    other = save_tiny(tmp_path / "other", layers=9, seed=1)
    with pytest.raises(SpecBlockError, match="made for target"):
        FeatureCache(out, other)
    other_model = load_causal_lm(other, "float32", "cpu", "sdpa", False)
    with pytest.raises(SpecBlockError, match="answers of target"):
        build_cache(data, out, other, other_model, k=2, log=lambda s: None)
    data2 = tmp_path / "gen2"
    _fake_chatgen(data2, other)
    with pytest.raises(SpecBlockError, match="feature cache of another target"):
        build_cache(data2, out, other, other_model, k=2, log=lambda s: None)
    cmd = [sys.executable, "-m", "specblock.training", "featcache", "--target", str(other), "--data", str(data2),
           "--out", str(out), "--dtype", "float32", "--threads", "1"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0 and "another target" in res.stderr
    assert list(json.loads((out / "manifest.json").read_text())["shards"]) == ["shard_00000"]  # nothing written


def test_windows_take_in_shards_finished_later(setup, tmp_path):
    from specblock.runtime.drafters.specblock_net import SpecBlockConfig, SpecBlockNet
    from specblock.training.cachewindows import CacheWindows

    target, data, model = setup
    out = tmp_path / "cache"
    build_cache(data, out, target, model, k=2, max_shards=2, log=lambda s: None)  # held-out shard 0 + shard 1
    src = CacheWindows(FeatureCache(out, target), window=9)
    assert src.train == ["shard_00001"] and src.held == ["shard_00000"]
    net = SpecBlockNet(SpecBlockConfig(vocab_size=64, hidden_size=32, num_heads=4, intermediate_size=64,
                                       tap_layers=default_taps(9), top_k=4))
    tp = src.batch(3, net)
    assert tp.tokens.shape == (3, 9) and tp.taps.shape == (3, 9, 96) and tp.y_ok is None
    assert src.refresh() == 0
    rows = [json.loads(x) for x in (data / "shard_00001.jsonl").read_text().splitlines()]
    (data / "shard_00002.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    man = json.loads((data / "manifest.json").read_text())
    man["shards"]["shard_00002"] = {"sequences": len(rows)}
    (data / "manifest.json").write_text(json.dumps(man))
    build_cache(data, out, target, model, k=2, log=lambda s: None)
    assert src.refresh() == 1 and src.train == ["shard_00001", "shard_00002"] and src.held == ["shard_00000"]


def test_own_share_fixes_the_mix_of_own_and_reference_windows():
    from specblock.training.cachewindows import CacheWindows

    class Stub:
        names = ["ref_00000", "shard_00000", "shard_00001", "shard_00002"]
        manifest = {"heldout_shards": ["shard_00000"],
                    "shards": {"ref_00000": {"tokens": 9000}, "shard_00000": {"tokens": 100},
                               "shard_00001": {"tokens": 1000}, "shard_00002": {"tokens": 2000}}}

    src = CacheWindows.__new__(CacheWindows)
    src.cache, src.window, src.own_share = Stub(), 9, None
    src._index()
    assert src.train == ["ref_00000", "shard_00001", "shard_00002"]
    assert np.allclose(src.p, [0.75, 1 / 12, 2 / 12])  # by size: the held-out shard never counts
    src.own_share = 0.5
    src._index()
    assert np.allclose(src.p, [0.5, 0.5 / 3, 1 / 3])  # half own answers, each kind still by size within
    src.rng = np.random.default_rng(0)
    picks = src.rng.choice(len(src.train), size=4000, p=src.p)
    assert abs((picks == 0).mean() - 0.5) < 0.04


def test_repeats_marks_the_closing_token_of_each_repeated_ngram():
    from specblock.training.cachewindows import repeats

    row = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6, 7, 9]
    got = repeats(np.array([row, row[::-1]]), 3)
    assert np.flatnonzero(got[0]).tolist() == [6, 10, 11]  # "5 6 7" twice more, then "6 7 9" again

    def brute(r):
        return [i for i in range(2, len(r)) if tuple(r[i - 2:i + 1]) in {tuple(r[j - 2:j + 1]) for j in range(2, i)}]

    assert np.flatnonzero(got[1]).tolist() == brute(row[::-1]) != []
    rng = np.random.default_rng(0)
    many = rng.integers(0, 3, (5, 40))
    assert [np.flatnonzero(g).tolist() for g in repeats(many, 3)] == [brute(r.tolist()) for r in many]
    assert not repeats(np.array([[1, 2]]), 3).any()  # a row shorter than n closes no n-gram


def test_skip_loops_masks_training_positions_only(setup, tmp_path):
    """--skip-loops: a training window's position is off where its next token closes a repeated
    n-gram; held-out windows keep every position."""
    from specblock.runtime.drafters.specblock_net import SpecBlockConfig, SpecBlockNet
    from specblock.training.cachewindows import CacheWindows, repeats

    target, data, model = setup
    rows = [json.loads(x) for x in (data / "shard_00001.jsonl").read_text().splitlines()]
    for r in rows:  # answers that loop
        r["answer_ids"] = [9, 10, 11, 12] * 5
    (data / "shard_00001.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "cache"
    build_cache(data, out, target, model, k=2, log=lambda s: None)
    net = SpecBlockNet(SpecBlockConfig(vocab_size=64, hidden_size=32, num_heads=4, intermediate_size=64,
                                       tap_layers=default_taps(9), top_k=4))
    plain = CacheWindows(FeatureCache(out, target), window=17, seed=3).batch(4, net)
    src = CacheWindows(FeatureCache(out, target), window=17, seed=3, skip_loops=4)
    tp = src.batch(4, net)
    assert torch.equal(tp.tokens, plain.tokens) and plain.y_ok is None
    loop = repeats(tp.tokens.numpy(), 4)
    assert loop.any() and torch.equal(tp.y_ok[:, :-1], torch.from_numpy(~loop[:, 1:])) and bool(tp.y_ok[:, -1].all())
    assert src.heldout(2, net).y_ok is None
    with pytest.raises(SpecBlockError, match="skip-loops"):
        CacheWindows(FeatureCache(out, target), window=17, feature="tokens", skip_loops=4)


def test_loop_share_counts_repeated_ngrams_by_answer_prefix(tmp_path, capsys):
    from tests.tiny import experiment

    mod = experiment("loop_share")
    d = tmp_path / "gen"
    d.mkdir()
    rows = [{"domain": "chat", "answer_ids": list(range(50)) + [0, 1, 2, 3] * 20, "stopped": False},
            {"domain": "code", "answer_ids": [7] * 10, "stopped": True}]
    (d / "shard_00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert mod.main(["--chatgen", str(d), "--n", "4", "--out", str(tmp_path / "s")]) == 0
    res = json.loads((tmp_path / "s.json").read_text())
    # answer 1: "0 1 2 3" closes again at token 53; "1 2 3 0" .. "3 0 1 2" are new at 54-56, every token from 57
    # closes a repeat (1 + 73); answer 2: "7 7 7 7" again at tokens 4-9 (6)
    assert res["share"]["48"] == pytest.approx(6 / 58, abs=1e-4) and res["share"]["96"] == pytest.approx(46 / 106, abs=1e-4)
    assert res["share"]["all"] == pytest.approx((1 + 73 + 6) / 140, abs=1e-4)
    assert res["stopped"] == 0.5
    assert mod.main(["--chatgen", str(tmp_path / "none"), "--out", str(tmp_path / "x")]) == 2
    assert "no chatgen shards" in capsys.readouterr().err and not (tmp_path / "x.json").exists()


def test_skip_loops_without_a_feature_cache_is_refused(tmp_path):
    from specblock.training.drafter import build_parser, check_args

    args = build_parser().parse_args(["--target", "t", "--run-dir", str(tmp_path / "r"), "--skip-loops", "8"])
    with pytest.raises(SpecBlockError, match="skip-loops .*--features"):
        check_args(args)
    check_args(build_parser().parse_args(["--target", "t", "--run-dir", str(tmp_path / "r"), "--skip-loops", "8", "--features",
                                          str(tmp_path / "cache")]))
