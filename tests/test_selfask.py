"""Instructions the target writes itself (training/selfask.py) and chatgen answering them
(``chatgen --instructions``): seeded, deduplicated, junk dropped, their own shard names, one
feature cache for both directories."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from specblock.errors import SpecBlockError
from specblock.runtime.target import load_causal_lm
from specblock.training import chatgen, selfask
from specblock.training.featcache import build_cache, target_identity
from tests import test_chatgen
from tests.tiny import save_tiny, tiny_model

chat_target = test_chatgen.chat_target  # the same tiny chat target (a fixture)


def test_sampling_is_seeded_and_top1_is_greedy():
    model = tiny_model("llama", seed=4, vocab=64).eval()
    prompts = [[5, 9, 11], [7] * 9, [3, 4, 5, 6]]
    greedy = chatgen.generate_batch(model, prompts, 10, frozenset(), pad=0)

    def sample(seed, **kw):
        return chatgen.generate_batch(model, prompts, 10, frozenset(), pad=0, temperature=1.0,
                                      generator=torch.Generator().manual_seed(seed), **kw)

    assert sample(1) == sample(1) and sample(1) != sample(2)
    assert sample(1) != greedy  # 30 tokens of a near-uniform tiny model: a sample is not the argmax
    assert sample(3, top_k=1) == greedy  # top-1 leaves only the argmax, whatever the seed


def test_clean_keeps_instructions_and_drops_junk():
    assert selfask.clean("  who built the  first bridge ", "ask-qa") == "who built the first bridge"
    assert selfask.clean("Write a poem about rain.", "ask-chat") == "Write a poem about rain."
    assert selfask.clean("Write a poem about rain.", "ask-qa") is None  # not a question
    assert selfask.clean("who invented the telephone", "ask-qa") is None  # an example copied
    assert selfask.clean("hi there", "ask-chat") is None  # too short
    assert selfask.clean("5. Write a list of", "ask-chat") is None
    assert selfask.clean("List three things:", "ask-chat") is None  # cut at a colon


def test_prompt_lists_three_examples_then_asks_for_line_four():
    text = selfask.prompt_text("ask-qa", random.Random(0))
    lines = text.split("\n")
    assert lines[0] == selfask.FAMILIES["ask-qa"][0] and lines[-1] == "4."
    assert [ln.split(". ", 1)[1] in selfask.FAMILIES["ask-qa"][1] for ln in lines[1:4]] == [True] * 3
    assert text == selfask.prompt_text("ask-qa", random.Random(0))


def test_write_instructions_dedupes_and_alternates(monkeypatch):
    written = iter(["what is a comet", "What is a comet", None, "Tell me a joke about cats.", "x",
                    "how far away is the moon", "Describe a quiet forest at night."] * 10)
    calls = []

    def fake_lines(model, tok, prompts, max_new, seed):
        calls.append((len(prompts), seed))
        return [next(written) for _ in prompts]

    monkeypatch.setattr(selfask, "sample_lines", fake_lines)
    rows = selfask.write_instructions(None, None, 4, seed=7, batch=3)
    assert [r["text"] for r in rows] == ["what is a comet", "Tell me a joke about cats.", "how far away is the moon",
                                         "Describe a quiet forest at night."]
    # prompt j's family alternates over all tries (j = 0, 1, ...): the last line came as a question (j = 6, dropped:
    # no question word) and was kept as a request (j = 11)
    assert [r["domain"] for r in rows] == ["ask-qa", "ask-chat", "ask-chat", "ask-chat"]
    assert [r["id"] for r in rows] == [f"selfask/7/{i}" for i in range(4)]
    assert len({s for _, s in calls}) == len(calls)  # every batch its own sampling seed
    monkeypatch.setattr(selfask, "sample_lines", lambda m, t, prompts, n, s: [None] * len(prompts))
    with pytest.raises(SpecBlockError, match="does not continue"):
        selfask.write_instructions(None, None, 2, seed=0, batch=4)


def test_chatgen_answers_an_instructions_file(chat_target, tmp_path):
    items = tmp_path / "ask.jsonl"
    items.write_text("".join(json.dumps({"id": f"a/{i}", "domain": "ask-chat", "text": "ab c" * (1 + i)}) + "\n"
                             for i in range(5)))
    out = tmp_path / "gen"
    base = ["--target", str(chat_target), "--out", str(out), "--shard-size", "2", "--batch", "2", "--max-new-tokens", "6",
            "--dtype", "float32", "--threads", "1", "--instructions", str(items)]
    assert chatgen.main(base) == 0
    man = json.loads((out / "manifest.json").read_text())
    assert list(man["shards"]) == ["ask_00000", "ask_00001", "ask_00002"] and man["heldout_shards"] == []
    rows = [json.loads(x) for f in sorted(out.glob("ask_*.jsonl")) for x in f.read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == [f"a/{i}" for i in range(5)] and {r["domain"] for r in rows} == {"ask-chat"}
    items.write_text(items.read_text() + json.dumps({"id": "a/9", "domain": "ask-chat", "text": "zz"}) + "\n")
    with pytest.raises(SpecBlockError, match="settings"):  # another list of instructions: another directory
        chatgen.main(base)
    plain = tmp_path / "plain"  # the ask directory's manifest under the data set's settings
    plain.mkdir()
    man["settings"].pop("instructions_sha256")
    (plain / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(SpecBlockError, match="ask_"):  # the data set's instructions into an ask_ directory
        chatgen.main(base[:-2] + ["--out", str(plain)])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1}\n')
    with pytest.raises(SpecBlockError, match="not a jsonl"):
        chatgen.main(base[:-2] + ["--instructions", str(bad), "--out", str(tmp_path / "never")])
    assert not (tmp_path / "never").exists()  # nothing written for a bad file


def test_a_second_list_of_instructions_gets_its_own_shard_prefix(chat_target, tmp_path):
    """selfask's seed 1 beside seed 0: a feature cache keys shards by name, so ask1_ and not ask_ again."""
    items = tmp_path / "ask1.jsonl"
    items.write_text("".join(json.dumps({"id": f"b/{i}", "domain": "ask-qa", "text": "q " * (2 + i)}) + "\n" for i in range(3)))
    base = ["--target", str(chat_target), "--shard-size", "2", "--batch", "2", "--max-new-tokens", "4",
            "--dtype", "float32", "--threads", "1"]
    out = tmp_path / "gen1"
    assert chatgen.main(base + ["--out", str(out), "--instructions", str(items), "--shard-prefix", "ask1_"]) == 0
    assert list(json.loads((out / "manifest.json").read_text())["shards"]) == ["ask1_00000", "ask1_00001"]
    assert sorted(p.name for p in out.glob("*.jsonl")) == ["ask1_00000.jsonl", "ask1_00001.jsonl"]
    with pytest.raises(SpecBlockError, match="holds ask1_"):  # one prefix per directory
        chatgen.main(base + ["--out", str(out), "--instructions", str(items), "--shard-prefix", "ask2_"])
    for bad in (["--instructions", str(items), "--shard-prefix", "Ask_"], ["--instructions", str(items), "--shard-prefix", "ref_"],
                ["--instructions", str(items), "--shard-prefix", "shard_"], ["--shard-prefix", "ask1_"]):
        with pytest.raises(SpecBlockError, match="--shard-prefix"):
            chatgen.main(base + ["--out", str(tmp_path / "never")] + bad)
    assert not (tmp_path / "never").exists()


def test_one_cache_holds_both_directories_and_holds_out_shard_0_only(tmp_path):
    target = save_tiny(tmp_path / "t", layers=9)
    sha = target_identity(target)["weights_sha256"]
    rng = np.random.default_rng(0)
    for name, prefix, held in (("gen", "shard_", [0]), ("ask", "ask_", [])):
        d = tmp_path / name
        d.mkdir()
        man = {"target": "tiny", "target_sha256": sha, "heldout_shards": held, "shard_prefix": prefix, "shards": {}}
        for s in range(2):
            rows = [{"id": f"{s}/{i}", "domain": "chat", "prompt_ids": rng.integers(3, 64, 4).tolist(),
                     "answer_ids": rng.integers(3, 64, 6).tolist(), "stopped": True} for i in range(3)]
            (d / f"{prefix}{s:05d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            man["shards"][f"{prefix}{s:05d}"] = {"sequences": 3}
        (d / "manifest.json").write_text(json.dumps(man))
    model = load_causal_lm(target, "float32", "cpu", "sdpa", False).eval()
    man = build_cache([tmp_path / "gen", tmp_path / "ask"], tmp_path / "cache", target, model, k=4, log=lambda s: None)
    assert sorted(man["shards"]) == ["ask_00000", "ask_00001", "shard_00000", "shard_00001"]
    assert man["heldout_shards"] == ["shard_00000"]


def test_an_existing_list_is_kept_or_refused_before_any_model_loads(tmp_path, capsys):
    out = tmp_path / "ask.jsonl"
    out.write_text("".join(json.dumps({"id": f"a/{i}", "domain": "ask-qa", "text": "who is it"}) + "\n" for i in range(3)))
    assert selfask.main(["--target", str(tmp_path / "no-such-model"), "--out", str(out), "--count", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["existed"] is True
    with pytest.raises(SpecBlockError, match="already holds 3 instructions"):
        selfask.main(["--target", str(tmp_path / "no-such-model"), "--out", str(out), "--count", "5"])
