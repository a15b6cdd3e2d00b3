"""q/k/v as one GEMM in eager packed-fp16 forwards (``runtime/shared_input.py``): each call still
returns its own linear's product, whatever the inputs and their order, and decoding stays lossless."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specblock.errors import SpecBlockError
from specblock.runtime import packed, shared_input
from specblock.runtime.drafters import LookupDrafter, RandomDrafter
from specblock.runtime.engine import Engine
from specblock.runtime.target import TargetModel
from tiny import FAMILIES, hf_greedy, save_tiny, tiny_model

pytestmark = pytest.mark.skipif(not packed.available(), reason="packed fp16 needs torch's fbgemm (an x86 build)")


def packed_pair(family: str, **kw):
    """The same tiny model packed twice, the second with its q/k/v shared."""
    plain, shared = tiny_model(family, vocab=16, seed=3, **kw), tiny_model(family, vocab=16, seed=3, **kw)
    packed.pack_linears(plain)
    packed.pack_linears(shared)
    assert shared_input.share_inputs(shared) == shared.config.num_hidden_layers
    return plain.eval(), shared.eval()


@pytest.mark.parametrize("family", FAMILIES)  # qwen2's q/k/v carry biases
def test_a_shared_forward_gives_the_separate_calls_logits_and_greedy_stays_lossless(family):
    plain, shared = packed_pair(family, layers=3)
    x = torch.as_tensor(np.random.default_rng(0).integers(0, 16, (1, 20)))
    with torch.no_grad():
        torch.testing.assert_close(shared(x).logits, plain(x).logits, rtol=1e-5, atol=1e-5)
    target = TargetModel(shared)
    rng = np.random.default_rng(1)
    for trial in range(3):
        prompt = rng.integers(2, 16, int(rng.integers(2, 12)))
        ref = hf_greedy(shared, prompt, 16)
        for drafter in (RandomDrafter(16, seed=trial), LookupDrafter(branches=3, max_ngram=2)):
            assert Engine(target, drafter, budget=int(rng.integers(2, 10))).generate(prompt, 16).token_ids == ref


def test_each_call_is_its_own_linear_whatever_the_input_and_order():
    _, shared = packed_pair("llama")
    attn = shared.model.layers[0].self_attn
    own = lambda lin, x: torch.ops.quantized.linear_dynamic_fp16(x, lin._packed)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(1, 4, 32, generator=g), torch.randn(1, 4, 32, generator=g)
    with torch.no_grad():
        for lin in (attn.v_proj, attn.q_proj, attn.k_proj):  # not HF's order: all from one stacked product
            torch.testing.assert_close(lin(x), own(lin, x), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(attn.k_proj(y), own(attn.k_proj, y), rtol=1e-6, atol=1e-6)  # another input
        q = attn.q_proj(x)
        x.mul_(2)  # the same tensor, changed in place: its version counter says so
        torch.testing.assert_close(attn.k_proj(x), own(attn.k_proj, x), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(q, own(attn.q_proj, x / 2), rtol=1e-6, atol=1e-6)


def test_a_forward_leaves_no_tensor_held_by_the_groups():
    """Each group lets go of its input and product once its three calls are served: a long
    prompt's would otherwise stay alive in every layer until the next forward."""
    _, shared = packed_pair("llama", layers=3)
    with torch.no_grad():
        shared(torch.arange(12)[None])
    groups = {id(m.shared): m.shared for m in shared.modules() if getattr(m, "shared", None) is not None}
    assert len(groups) == 3 and all(g.x is None and g.out is None for g in groups.values())


def test_a_repacked_part_restacks_the_shared_weights():
    _, shared = packed_pair("llama")
    attn = shared.model.layers[1].self_attn
    x = torch.randn(1, 3, 32)
    with torch.no_grad():
        attn.k_proj.weight.mul_(-1)
        attn.k_proj.repack()
        torch.testing.assert_close(attn.k_proj(x), torch.nn.functional.linear(x, attn.k_proj.weight), rtol=1e-2, atol=1e-3)


def test_load_shares_packed_fp16_unless_told_not_to(tmp_path, monkeypatch):
    path = save_tiny(tmp_path / "t", layers=2, hidden=64)
    count = lambda t: sum(isinstance(getattr(m, "shared", None), shared_input.SharedInput) for m in t.model.modules())
    assert count(TargetModel.load(path, "packed-fp16", "cpu")) == 2 * 3
    assert count(TargetModel.load(path, "float32", "cpu")) == 0
    monkeypatch.setenv("SPECBLOCK_SHARED_INPUT", "off")
    assert count(TargetModel.load(path, "packed-fp16", "cpu")) == 0
    monkeypatch.setenv("SPECBLOCK_SHARED_INPUT", "1")
    with pytest.raises(SpecBlockError, match="SPECBLOCK_SHARED_INPUT='1': use on or off"):
        TargetModel.load(path, "packed-fp16", "cpu")
