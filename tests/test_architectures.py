"""The architecture matrix: decoder families built from tiny configs (tests/tiny.py MATRIX), saved
and loaded through the runtime's loader, decode with ar, lookup and random trees exactly as HF
``generate`` does at fp32, with prompts and outputs far longer than the sliding window of the
families that have one (Mistral, Mixtral, Starcoder2: every layer; Qwen2, Gemma 2/3, Cohere2:
interleaved). Families with other layer kinds are refused with one line."""

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from specblock.errors import SpecBlockError
from specblock.runtime import attention
from specblock.runtime.drafters import ARDrafter, LookupDrafter, RandomDrafter
from specblock.runtime.engine import Engine
from specblock.runtime.target import TargetModel
from tiny import MATRIX, WINDOW, hf_greedy, tiny_model

V = 12  # a tiny vocabulary: random drafts often match, so long accepted paths (and windows) are crossed
EAGER_ONLY = {"gemma2"}  # transformers 5.23 has no sdpa path for Gemma 2 (soft-capped logits)
SLIDING = {name for name, (_, extra) in MATRIX.items() if "sliding_window" in extra}


def _attn(name: str) -> str:
    return "eager" if name in EAGER_ONLY else "sdpa"


@pytest.mark.parametrize("name", sorted(MATRIX))
def test_family_equals_hf_generate(name, tmp_path):
    model = tiny_model(name, vocab=V, attn=_attn(name))
    model.save_pretrained(tmp_path)  # through the runtime's loader: no weight may be missing or unexpected
    target = TargetModel.load(tmp_path, "float32", "cpu", _attn(name))
    assert (target.layout.window == WINDOW) == (name in SLIDING)
    rng = np.random.default_rng(sum(map(ord, name)))
    longest = 0
    for trial in range(2):
        prompt = rng.integers(2, V, int(rng.integers(2 * WINDOW, 4 * WINDOW)))
        ref = hf_greedy(model, prompt, 32)
        for drafter in (ARDrafter(), RandomDrafter(V, seed=trial), LookupDrafter(branches=3, max_ngram=2)):
            res = Engine(target, drafter, budget=12).generate(prompt, 32)
            assert res.token_ids == ref, (name, drafter.name, trial)
            longest = max(longest, max(res.stats.accepted))
    assert longest >= 2  # trees were really verified, not just their roots


def test_sliding_masks_hide_what_the_window_does_not_cover():
    from specblock.policies.tree import DraftTree

    tree = DraftTree.from_parents(np.arange(4), np.array([-1, 0, 0, 1]), rank=np.zeros(4, dtype=np.int64))
    layout = attention.Layout((attention.FULL, attention.SLIDING), window=3)
    masks = attention.tree_masks(layout, tree, past_len=5, dtype=torch.float32, device=torch.device("cpu"))
    seen = {k: (m[0, 0] == 0).int().tolist() for k, m in masks.items()}
    # node 3 (depth 2, position 7) under node 1: full sees the past and its ancestors 0, 1 and itself
    assert seen[attention.FULL][3] == [1, 1, 1, 1, 1, 1, 1, 0, 1]
    # the window of 3 positions: 5, 6, 7 -> past position 4 is gone, so are 0..3
    assert seen[attention.SLIDING][3] == [0, 0, 0, 0, 0, 1, 1, 0, 1]
    assert seen[attention.SLIDING][2] == [0, 0, 0, 0, 1, 1, 0, 1, 0]  # depth 1, position 6: past 4, the root, itself


@pytest.mark.parametrize("model_type,extra,needle", [
    ("qwen3_next", {"layer_types": ["linear_attention", "full_attention"]}, "linear_attention"),
    ("llama4_text", {"attention_chunk_size": 8}, "chunked_attention"),
    ("bamba", {"attn_layer_indices": [1], "mamba_n_heads": 4, "mamba_d_head": 8, "mamba_d_state": 4,
               "mamba_n_groups": 1, "mamba_expand": 1}, "linear_attention"),  # a Mamba hybrid
])
def test_other_layer_kinds_are_refused_with_one_line(model_type, extra, needle):
    cfg = AutoConfig.for_model(model_type, vocab_size=V, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                               num_key_value_heads=2, num_hidden_layers=2, **extra)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    with pytest.raises(SpecBlockError, match=needle) as e:
        TargetModel(model)
    assert "\n" not in str(e.value)


def test_mixed_layers_without_a_mask_per_type_are_refused(monkeypatch):
    monkeypatch.setattr(attention, "_takes_mask_mapping", lambda model: False)
    with pytest.raises(SpecBlockError, match="one attention mask"):
        TargetModel(tiny_model("qwen2-sw", vocab=V))
    TargetModel(tiny_model("mistral-sw", vocab=V))  # one layer type: one mask is all it needs


def test_eager_only_family_says_which_flag(tmp_path):
    tiny_model("gemma2", vocab=V, attn="eager").save_pretrained(tmp_path)
    with pytest.raises(SpecBlockError, match="--attn eager"):
        TargetModel.load(tmp_path, "float32", "cpu", "sdpa")


@pytest.mark.parametrize("name", sorted(SLIDING))
def test_tree_logits_equal_plain_forwards_past_the_window(name):
    """Every node's logits from one tree forward equal a plain forward over the prompt plus the
    node's root path: what sampling verification relies on, not just the argmax."""
    from specblock.policies.tree import DraftTree

    model = tiny_model(name, vocab=V, attn=_attn(name))
    target = TargetModel(model)
    rng = np.random.default_rng(1)
    prompt = rng.integers(2, V, 3 * WINDOW)
    n = 3 * WINDOW  # deep enough that a node's window drops part of the tree itself
    parent = np.concatenate([[-1], (rng.random(n - 1) * np.arange(1, n)).astype(np.int64)])
    parent[1 : 2 * WINDOW] = np.arange(0, 2 * WINDOW - 1)  # a spine longer than the window
    tree = DraftTree.from_parents(np.concatenate([[prompt[-1]], rng.integers(2, V, n - 1)]), parent)
    target.prefill(prompt[:-1])
    got = target.tree_forward(tree).logits
    for i in range(n):
        path, j = [], i
        while j > 0:
            path.append(int(tree.tokens[j]))
            j = int(tree.parent[j])
        ids = torch.as_tensor(np.concatenate([prompt, np.array(path[::-1], dtype=np.int64)]))[None]
        with torch.no_grad():
            want = model(ids).logits[0, -1]
        torch.testing.assert_close(got[i], want, atol=1e-4, rtol=1e-4, msg=f"{name} node {i}")


@pytest.mark.parametrize("draft", ["mistral-sw", "gemma3"])
def test_sps_draft_model_with_a_sliding_window(draft):
    """A draft model with window layers drafts past its window without crashing; output exact."""
    from specblock.runtime.drafters.sps import SpsDrafter

    model = tiny_model("qwen2-sw", vocab=V)
    target = TargetModel(model)
    drafter = SpsDrafter(tiny_model(draft, vocab=V, seed=1), gamma=4, top_k=2)
    rng = np.random.default_rng(3)
    for _ in range(2):
        prompt = rng.integers(2, V, 3 * WINDOW)
        assert Engine(target, drafter, budget=12).generate(prompt, 32).token_ids == hf_greedy(model, prompt, 32)
