"""Reference answers (training/refanswers.py) and a feature cache over two data directories."""

from __future__ import annotations

import json

from specblock.runtime.target import load_causal_lm
from specblock.training import refanswers
from specblock.training.featcache import FeatureCache, build_cache, target_identity
from tests.test_featcache import _fake_chatgen
from tests.tiny import save_tiny


def _fake_refs(data, target_dir) -> None:
    data.mkdir()
    man = {"kind": "specblock-reference", "target": "tiny", "target_sha256": target_identity(target_dir)["weights_sha256"],
           "heldout_shards": [], "shards": {}}
    rows = [{"id": f"r/{i}", "domain": "math", "prompt_ids": [5, 6, 7], "answer_ids": [8, 9, 10, 11, 12], "stopped": True}
            for i in range(3)]
    (data / "ref_00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    man["shards"]["ref_00000"] = {"sequences": 3}
    (data / "manifest.json").write_text(json.dumps(man))


def test_cache_takes_chatgen_shards_first_then_reference(tmp_path):
    target = save_tiny(tmp_path / "t", layers=9)
    model = load_causal_lm(target, "float32", "cpu", "sdpa", False).eval()
    gen, refs, out = tmp_path / "gen", tmp_path / "refs", tmp_path / "cache"
    _fake_chatgen(gen, target, shards=1)
    _fake_refs(refs, target)
    man = build_cache([refs, gen][::-1], out, target, model, k=2, max_shards=1, log=lambda s: None)
    assert list(man["shards"]) == ["shard_00000"]  # the target's own answers go first
    man = build_cache([gen, refs], out, target, model, k=2, log=lambda s: None)
    assert sorted(man["shards"]) == ["ref_00000", "shard_00000"]
    assert man["heldout_shards"] == ["shard_00000"]  # held out: the target's own answers only
    assert set(man["sources"].values()) == {"specblock-chatgen", "specblock-reference"}
    sh = FeatureCache(out, target).shard("ref_00000")
    assert sh.tokens[:8].tolist() == [5, 6, 7, 8, 9, 10, 11, 12]


def test_pairs_are_training_data_only():
    pairs = refanswers.all_pairs()
    ids = {inst.id for inst, _ in pairs}
    assert all(int(i.split("/")[1]) < 700 for i in ids if i.startswith("alpaca_eval/"))  # 700+ are evaluation prompts
    math = [a for inst, a in pairs if inst.domain == "math"]
    assert math and not any("<<" in a for a in math)  # calculator annotations removed
    code = [(inst.text, a) for inst, a in pairs if inst.domain == "code"][:20]
    for prompt, answer in code:  # the answer is the whole function whose head the prompt shows
        head = prompt.split("```python\n", 1)[1].rstrip("`")
        assert answer.startswith("```python\n" + head.splitlines()[0])
        assert len(answer) > len(head)
