"""Self-generated chat data (training/chatgen.py): no evaluation prompt leaks in, the target's own
greedy answers are stored, runs resume and refuse other settings."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from specblock.errors import SpecBlockError
from specblock.prompts import DOMAINS, load_prompts
from specblock.training import chatgen
from tests.tiny import save_tiny

TEMPLATE = ("{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>{% endif %}")


def test_instructions_mix_every_domain_and_hold_no_evaluation_prompt():
    items = chatgen.all_instructions(0)
    assert len({i.id for i in items}) == len(items)
    counts = Counter(i.domain for i in items)
    assert counts["chat"] == 700 and counts["math"] == 7473 and counts["code"] > 500 and counts["prose"] > 500
    assert set(Counter(i.domain for i in items[:64])) == {"chat", "math", "code", "prose"}  # any prefix mixes
    texts = {i.text for i in items}
    joined = "\n".join(texts)
    for domain in DOMAINS:
        for p in load_prompts(domain):
            core = p.text.strip()
            if domain == "math":
                core = core.removeprefix("Question:").split("\nAnswer:")[0].strip()
            elif domain in ("chat", "qa", "mtbench"):
                core = core.removeprefix("### Instruction:").split("### Response:")[0].strip()
            assert core not in texts and (len(core) < 40 or core not in joined), (domain, p.id)
    code = next(i for i in items if i.domain == "code")
    assert code.text.startswith("Complete the following Python function.\n\n```python\ndef ") and code.text.endswith("```")


@pytest.fixture()
def chat_target(tmp_path, monkeypatch):
    path = save_tiny(tmp_path / "t", layers=2)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    items = [chatgen.Instruction(f"x/{i}", "chat", "abc def"[: 2 + i % 6] * (1 + i % 3)) for i in range(10)]
    monkeypatch.setattr(chatgen, "all_instructions", lambda seed=0: items)
    return path


def test_answers_are_the_targets_greedy_and_runs_resume(chat_target, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "gen"
    base = ["--target", str(chat_target), "--out", str(out), "--shard-size", "4", "--batch", "3", "--max-new-tokens", "12",
            "--dtype", "float32", "--threads", "1"]
    assert chatgen.main(base + ["--max-shards", "1"]) == 0
    man = json.loads((out / "manifest.json").read_text())
    assert list(man["shards"]) == ["shard_00000"] and man["heldout_shards"] == [0]
    first = (out / "shard_00000.jsonl").read_text()
    assert chatgen.main(base) == 0  # resumes: the remaining shards, the first untouched
    man = json.loads((out / "manifest.json").read_text())
    assert list(man["shards"]) == ["shard_00000", "shard_00001", "shard_00002"]
    assert (out / "shard_00000.jsonl").read_text() == first
    assert man["totals"]["sequences"] == 10
    assert man["totals"]["answer_tokens"] == sum(s["answer_tokens"] for s in man["shards"].values())
    model = AutoModelForCausalLM.from_pretrained(chat_target, dtype=torch.float32).eval()
    rows = [json.loads(x) for f in sorted(out.glob("shard_*.jsonl")) for x in f.read_text().splitlines()]
    for r in rows:  # batched with left padding, each answer is the target's own greedy continuation
        ids = torch.tensor([r["prompt_ids"]])  # an explicit mask: the template's <s> is also the pad id
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
        assert r["answer_ids"] == ref[:len(r["answer_ids"])]
        assert r["stopped"] == (1 in ref) and (not r["stopped"] or r["answer_ids"][-1] == 1)
    with pytest.raises(SpecBlockError, match="settings"):
        chatgen.main(base[:-6] + ["--max-new-tokens", "20", "--dtype", "float32", "--threads", "1"])


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_rows_that_stop_leave_the_batch_and_the_rest_stay_greedy(family):
    """generate_batch drops a stopped row from the batch and its KV cache; every row still gets
    its own unpadded greedy answer, cut after its first stop token, and stops at different steps."""
    from tests.tiny import hf_greedy, tiny_model

    model = tiny_model(family, seed=3, vocab=64).eval()
    with torch.no_grad():  # sharp attention: a wrong position (left padding ignored) changes the answers
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6.0)
            layer.self_attn.k_proj.weight.mul_(6.0)
    prompts = [[5, 9, 11], [7] * 9, [3, 4, 5, 6, 7, 8], [12, 40], list(range(20, 60)), [33, 2, 50, 17] * 5]
    full = [hf_greedy(model, p, 16) for p in prompts]
    counts = Counter(t for f in full for t in f[:8])
    stops = frozenset(t for t, _ in counts.most_common(2))  # frequent early tokens: rows end at different steps
    got = chatgen.generate_batch(model, prompts, 16, stops, pad=0)
    cuts = []
    for (ans, stopped), ref in zip(got, full):
        cut = next((i + 1 for i, t in enumerate(ref) if t in stops), len(ref))
        assert ans == ref[:cut] and stopped == (cut < len(ref) or ref[-1] in stops)
        cuts.append(cut)
    assert len(set(cuts)) > 1 and min(cuts) < 16  # some rows left early, others went on
