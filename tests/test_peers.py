"""HF peers in the bench: HF's plain greedy loop, assisted generation and prompt lookup on the same
target equal plain greedy decoding, appear as bench rows with tau/T_D% null, and a missing draft model is a note."""

import json

import numpy as np
import pytest

from specblock.runtime import peers
from specblock.runtime.cli import main
from specblock.runtime.engine import Engine
from specblock.runtime.drafters.base import ARDrafter
from specblock.runtime.target import TargetModel
from tiny import hf_greedy, save_tiny, tiny_model

V = 64


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_hf_peers_equal_plain_greedy(tmp_path, family):
    model = tiny_model(family, vocab=V, layers=2)
    target = TargetModel(model)
    tiny_model("llama", vocab=V, layers=1, seed=3).save_pretrained(tmp_path / "sps")
    rng = np.random.default_rng(0)
    for name in peers.PEERS:
        peer = peers.build(name, target, {"drafter": tmp_path / "sps"}, frozenset())
        for length in (1, 7, 20):
            prompt = np.tile(rng.integers(2, V, 5), 4)[:length]  # repeats give lookup something to find
            res = peer.generate(prompt, 24)
            assert res.token_ids == hf_greedy(model, prompt, 24)
            assert res.stats.new_tokens == 24 and res.stats.tokens_per_s > 0 and res.stats.accepted == []
    # EOS: the peer stops where our engine stops (the EOS token included).
    prompt = np.arange(2, 12)
    ar = Engine(target, ARDrafter()).generate(prompt, 24).token_ids
    eos = frozenset({ar[5]})
    want = Engine(target, ARDrafter(), eos_ids=eos).generate(prompt, 24)
    got = peers.build("hf-lookup", target, {}, eos).generate(prompt, 24)
    assert got.token_ids == want.token_ids and got.stopped == want.stopped == "eos"


def test_bench_rows_for_peers(tmp_path, capsys):
    save_tiny(tmp_path / "t", "llama", vocab=96, ctx=2048)
    tiny_model("llama", vocab=96, layers=1, seed=5, ctx=2048).save_pretrained(tmp_path / "drafters" / "sps")
    out = tmp_path / "res" / "bench"
    code = main(["bench", "--target", str(tmp_path / "t"), "--methods", "hf-lookup,hf-assisted,hf-greedy", "--domains", "code",
                 "--prompts", "1", "--max-new-tokens", "8", "--runs", "2", "--dtype", "float32",
                 "--drafter-dir", str(tmp_path / "drafters"), "--out", str(out)])
    assert code == 0
    res = json.loads(out.with_suffix(".json").read_text())
    rows = {r["method"]: r for r in res["rows"]}
    assert set(rows) == {"ar", "hf-lookup", "hf-assisted", "hf-greedy"} and res["skipped"] == {}
    for m in peers.PEERS:
        r = rows[m]
        assert r["match_rate"] == 1.0 and r["speedup"] > 0 and r["tokens_per_s"] > 0
        assert r["tau"] is None and r["draft_share"] is None and r["mean_tree_size"] is None
    assert rows["ar"]["tau"] == 1.0
    printed = capsys.readouterr().out
    assert "| hf-lookup |" in printed and "/ - |" in printed


def test_bench_skips_hf_assisted_without_a_draft_model(tmp_path, capsys, monkeypatch):
    import specblock.models as models

    monkeypatch.setattr(models, "drafters_dir", lambda target_dir: tmp_path / "none")
    save_tiny(tmp_path / "t", "llama", vocab=96, ctx=2048)
    out = tmp_path / "bench"
    code = main(["bench", "--target", str(tmp_path / "t"), "--methods", "hf-assisted", "--domains", "chat",
                 "--prompts", "1", "--max-new-tokens", "4", "--runs", "1", "--dtype", "float32", "--out", str(out)])
    assert code == 0
    res = json.loads(out.with_suffix(".json").read_text())
    assert [r["method"] for r in res["rows"]] == ["ar"] and "no SpS draft model" in res["skipped"]["hf-assisted"]
    assert "note: hf-assisted skipped" in capsys.readouterr().out
    assert "Note: hf-assisted skipped" in out.with_suffix(".md").read_text()


def test_a_peer_may_run_on_a_model_of_its_own_dtype(tmp_path, monkeypatch, capsys):
    """``--set hf-greedy@bf16:dtype=bfloat16``: HF's loop on the model loaded in bf16 beside methods on
    ``--dtype float32`` (issue 16's baseline); the same dtype as the bench reuses its model."""
    import torch

    save_tiny(tmp_path / "t", "llama", vocab=96, ctx=2048)
    seen = {}
    build = peers.build

    def spy(method, target, opt, eos):
        seen[method] = target.model.dtype
        return build(method, target, opt, eos)

    monkeypatch.setattr(peers, "build", spy)
    out = tmp_path / "bench"
    code = main(["bench", "--target", str(tmp_path / "t"), "--methods", "hf-greedy,hf-greedy@bf16,hf-greedy@f32",
                 "--set", "hf-greedy@bf16:dtype=bfloat16", "--set", "hf-greedy@f32:dtype=float32", "--domains", "code",
                 "--prompts", "1", "--max-new-tokens", "6", "--runs", "1", "--dtype", "float32", "--out", str(out)])
    assert code == 0
    assert seen == {"hf-greedy": torch.float32, "hf-greedy@bf16": torch.bfloat16, "hf-greedy@f32": torch.float32}
    rows = {r["method"] for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert rows == {"ar", "hf-greedy", "hf-greedy@bf16", "hf-greedy@f32"}
    # one of this project's methods runs on the bench's --dtype, refused in one line before anything loads
    code = main(["bench", "--target", str(tmp_path / "t"), "--methods", "lookup", "--set", "lookup:dtype=bfloat16",
                 "--domains", "code", "--prompts", "1", "--runs", "1", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert code != 0 and "only an HF peer" in err and "Traceback" not in err
