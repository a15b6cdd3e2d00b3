"""Grouped rows (``runtime/grouped_rows.py``): a tree forward that folds the query heads onto the
key/value heads gives HF's logits, and never copies the keys per query head."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import transformers.integrations.sdpa_attention as hf_sdpa
from specblock.policies.tree import DraftTree
from specblock.runtime.grouped_rows import NAME, use_grouped_rows, use_hf_sdpa
from specblock.runtime.target import TargetModel
from tiny import FAMILIES, tiny_model

MODELS = {f: tiny_model(f, vocab=32, seed=3).float() for f in FAMILIES}


def random_tree(rng: np.random.Generator, n: int, vocab: int = 32) -> DraftTree:
    parent = np.concatenate([[-1], (rng.random(n - 1) * np.arange(1, n)).astype(np.int64)])
    return DraftTree.from_parents(rng.integers(0, vocab, n), parent)


def logits(target: TargetModel, prompt, tree, path, nxt):
    target.prefill(prompt)
    first = target.tree_forward(tree).logits
    target.commit(path)
    return first, target.tree_forward(nxt).logits


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=15, deadline=None)
@given(st.integers(1, 30), st.integers(1, 24), st.integers(0, 10**6))
def test_grouped_rows_give_hf_logits(family, prompt_len, n_nodes, seed):
    """Same logits at fp32 as HF's SDPA path, for a tree and for the tree after a commit."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 32, prompt_len)
    tree = random_tree(rng, n_nodes)
    path = tree.path_to(int(rng.integers(0, n_nodes)))
    nxt = random_tree(rng, int(rng.integers(1, 10)))
    target = TargetModel(MODELS[family])
    use_hf_sdpa(target.model)
    want = logits(target, prompt, tree, path, nxt)
    assert use_grouped_rows(target.model)
    try:
        got = logits(target, prompt, tree, path, nxt)
    finally:
        use_hf_sdpa(target.model)
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_a_tree_forward_copies_no_keys(monkeypatch):
    """Under grouped rows (the target's default here) a masked tree forward never reaches
    ``repeat_kv``; HF's path does (so the check can fail)."""
    calls = []
    real = hf_sdpa.repeat_kv
    monkeypatch.setattr(hf_sdpa, "repeat_kv", lambda *a: calls.append(1) or real(*a))
    target = TargetModel(MODELS["llama"])
    assert target.grouped_rows  # on by default for a CPU SDPA model with grouped heads
    use_hf_sdpa(target.model)
    tree = random_tree(np.random.default_rng(0), 6)
    target.prefill(np.arange(5))
    target.tree_forward(tree)
    assert calls, "HF's own path should have copied the keys"
    calls.clear()
    assert use_grouped_rows(target.model) and target.model.config._attn_implementation == NAME
    try:
        target.prefill(np.arange(5))
        target.tree_forward(tree)
    finally:
        use_hf_sdpa(target.model)
    assert not calls
    assert target.model.config._attn_implementation == "sdpa"


def test_other_models_are_left_alone():
    """No grouped heads, or not SDPA: nothing to fold, the model keeps its attention."""
    from transformers import AutoModelForCausalLM

    from tiny import tiny_config

    cfg = tiny_config("llama", vocab=32)
    cfg.num_key_value_heads = cfg.num_attention_heads
    plain = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    assert not use_grouped_rows(plain) and plain.config._attn_implementation == "sdpa"
    eager = tiny_model("llama", vocab=32, attn="eager")
    assert not use_grouped_rows(eager) and eager.config._attn_implementation == "eager"


def test_the_mask_is_tiled_once_a_forward(monkeypatch):
    """All layers of a forward share one tiled mask; a new forward, or a mask changed in place,
    tiles again (a stale tile would give wrong logits, which the hypothesis test above checks).
    The fold is the path of forwards the fused op does not take (bf16, a CPU without AVX512)."""
    import specblock.runtime.grouped_rows as gr

    monkeypatch.setattr(gr, "USE_FUSED", False)
    tiles = []
    real = gr._tile
    monkeypatch.setattr(gr, "_tile", lambda m, g: tiles.append(1) or real(m, g))
    target = TargetModel(MODELS["llama"])
    assert target.grouped_rows and target.model.config.num_hidden_layers > 1
    target.prefill(np.arange(5))
    target.tree_forward(random_tree(np.random.default_rng(0), 6))
    assert len(tiles) == 1
    mask = torch.zeros(1, 1, 3, 7)
    first = gr.tiled_mask(mask, 3)
    assert gr.tiled_mask(mask, 3) is first and len(tiles) == 2
    mask[..., 0] = -1.0  # in place: the version counter moves
    again = gr.tiled_mask(mask, 3)
    assert again is not first and len(tiles) == 3 and torch.equal(again[0, 0, :3], mask[0, 0])
    assert torch.equal(gr.tiled_mask(mask, 2), mask.repeat(1, 1, 2, 1))


def test_fp32_forwards_take_the_fused_op_one_row_included(monkeypatch):
    """Where the op runs, every layer of an fp32 forward calls it: trees and lone tokens alike (so a
    token's bits are the same in both), and the logits stay HF's. A prompt without a mask (HF's
    causal flag) keeps SDPA unless the model is marked (``exact_parts``, ``tests/test_exact_parts.py``)."""
    import specblock.runtime.grouped_rows as gr
    from specblock.runtime import tree_attention

    if not tree_attention.load():
        pytest.skip("the fused attention op needs AVX512F/DQ")
    calls = []
    real = tree_attention.tree_attention
    monkeypatch.setattr(tree_attention, "tree_attention", lambda *a: calls.append(a[0].shape[2]) or real(*a))
    target = TargetModel(MODELS["llama"])
    layers = target.model.config.num_hidden_layers
    target.prefill(np.arange(5))
    tree = random_tree(np.random.default_rng(0), 6)
    got = target.tree_forward(tree).logits
    target.reset()
    target.prefill(np.arange(5))
    target.tree_forward(random_tree(np.random.default_rng(1), 1))
    assert calls == [6] * layers + [1] * layers
    monkeypatch.setattr(gr, "USE_FUSED", False)
    target.reset()
    target.prefill(np.arange(5))
    torch.testing.assert_close(got, target.tree_forward(tree).logits, atol=1e-5, rtol=1e-5)

