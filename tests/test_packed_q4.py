"""``--dtype packed-q4``: the bf16 checkpoint's own weights, bit for bit, read from the 4-bit codes it
was converted from (each weight ``bf16(d * q + m)``, the head's ``bf16(d * q)``, rounded in the fp32
kernel), with fp32 arithmetic: lossless like fp32, eager and compiled."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specblock.errors import SpecBlockError
from specblock.q4file import Q4_FILE, dequantize_q4_1, dequantize_q8_0, quantize_q4_1, quantize_q8_0
from specblock.runtime import q4, q4_kernel
from specblock.runtime.drafters import LookupDrafter, RandomDrafter
from specblock.runtime.engine import Engine
from specblock.runtime.target import TargetModel
from tiny import Q4_VOCAB as V, assert_drafters_match_greedy, hf_greedy, run_cli, save_tiny_packed_q4, save_tiny_q4

OURS = q4_kernel.cpu_supports() and q4_kernel.load()
pytestmark = pytest.mark.skipif(not OURS, reason="packed-q4 runs on our fp32 q4 kernel (AVX512F/AVX512BW)")


def rounded(w: torch.Tensor) -> torch.Tensor:
    return w.bfloat16().float()


def tie_weights(n: int = 16, k: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 weights ``1 + q / 256``: every odd ``q`` lies halfway between two bf16 values (bf16
    keeps 7 bits after the point), so the rounding's ties to even are exercised both ways."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    qs = q[:, 0::2] | (q[:, 1::2] << 4)
    d = torch.full((n, k // 32), 2.0 ** -8, dtype=torch.float16)
    m = torch.ones((n, k // 32), dtype=torch.float16)
    return qs, d, m


def test_the_kernel_rounds_each_weight_to_bf16_ties_to_even():
    for qs, d, m in (tie_weights(), quantize_q4_1(torch.randn(48, 96))):
        w = dequantize_q4_1(qs, d, m)
        eye = torch.eye(w.shape[1])
        assert torch.equal(q4_kernel.linear(eye, *q4_kernel.layout(qs, d, m), True).t(), rounded(w))
        assert torch.equal(q4_kernel.linear(eye, *q4_kernel.layout(qs, d, m)).t(), w)  # the exact kernel unchanged
    exact = dequantize_q4_1(*tie_weights())
    assert not torch.equal(rounded(exact), exact)  # the ties did round
    q, d = quantize_q8_0(torch.randn(32, 64))
    w = dequantize_q8_0(q, d)
    assert not torch.equal(rounded(w), w)
    assert torch.equal(q4_kernel.linear(torch.eye(64), *q4_kernel.layout_q8(q, d), True).t(), rounded(w))


@settings(max_examples=10, deadline=None)
@given(rows=st.integers(1, 19), seed=st.integers(0, 2**16), threads=st.sampled_from([1, 2]))
def test_rows_are_independent_and_keyed_calls_fused_or_not_give_the_same_bits(rows, seed, threads):
    g = torch.Generator().manual_seed(seed)
    parts = [q4_kernel.layout(*quantize_q4_1(torch.randn(n, 96, generator=g) * 0.05)) for n in (48, 16, 32)]
    x = torch.randn(rows, 96, generator=g)
    owner = type("Owner", (), {})()
    keys = [q4_kernel.register(p, owner, bf16=True) for p in parts]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([q4_kernel.linear(x, *p, True) for p in parts], 1)
        together = q4_kernel.linear_key_cat(x, keys, 96)
        assert torch.equal(alone, together)
        for i in range(rows):  # a row's outputs do not depend on the rows beside it
            assert torch.equal(torch.cat([q4_kernel.linear(x[i:i + 1], *p, True) for p in parts], 1)[0], alone[i])
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="fp32 kernel"):
        q4_kernel.register((torch.empty(1, 1, 1),), owner, bf16=True)


def test_a_packed_q4_target_is_its_checkpoint_in_fp32_and_every_method_matches_its_greedy(tmp_path, capsys):
    path = save_tiny_packed_q4(tmp_path / "t", layers=3)
    target = TargetModel.load(path, "packed-q4", "cpu")
    ref32 = TargetModel.load(path, "float32", "cpu").model
    assert target.dtype_name == "packed-q4" and target.packed
    mods = list(target.model.modules())
    assert sum(isinstance(m, q4.Int4Linear) and m.bf16 and m.kernel == "fp32" for m in mods) == 3 * 7
    assert isinstance(target.model.lm_head, q4.Int8Linear) and target.model.lm_head.bf16
    assert not any(type(m) is torch.nn.Linear for m in mods)
    assert "rounded to bf16" in repr(target.model.lm_head)
    # the checkpoint's weights, bit for bit: through the kernel, each linear equals the fp32 model's
    for name, mod in target.model.named_modules():
        if isinstance(mod, (q4.Int4Linear, q4.Int8Linear)):
            want = dict(ref32.named_modules())[name].weight
            assert torch.equal(mod(torch.eye(mod.in_features)).t(), want), name
    prompt = np.random.default_rng(1).integers(2, V, 9)
    with torch.no_grad():
        ids = torch.tensor(prompt)[None]
        assert torch.allclose(target.model(ids).logits, ref32(ids).logits, rtol=1e-4, atol=1e-4)  # only sums reordered
    assert_drafters_match_greedy(target, V, seed=3, max_budget=16)
    code, out, err = run_cli(capsys, "--target", path, "--dtype", "packed-q4", "--method", "lookup", "--raw",
                             "--prompt", "abcabcabc", "--max-new-tokens", "12", "--compare", "ar", "--json")
    assert code == 0, err
    assert json.loads(out)["identical_to_ar"] is True


def test_compiled_packed_q4_matches_its_greedy(tmp_path):
    from specblock.compiled.target import StaticTarget

    path = save_tiny_packed_q4(tmp_path / "t", layers=2)
    model = TargetModel.load(path, "packed-q4", "cpu").model
    target = StaticTarget(model, compile=True, buckets=(1, 8), saved=False)
    assert (target.dtype_name, target.compiled) == ("packed-q4", True)  # serving.json's overrides key on these
    prompt = np.random.default_rng(6).integers(2, V, 10)
    ref = hf_greedy(model, prompt, 16)
    for drafter in (RandomDrafter(V, seed=0), LookupDrafter(branches=2, max_ngram=2)):
        assert Engine(target, drafter, budget=7).generate(prompt, 16).token_ids == ref, drafter.name


def test_refusals_are_one_line(tmp_path, monkeypatch):
    # q4_1.safetensors made from the fp32 weights, the checkpoint not their rounding: another model
    path = save_tiny_q4(tmp_path / "other", layers=1)
    with pytest.raises(SpecBlockError, match="not this checkpoint's.*use packed-fp16") as e:
        TargetModel.load(path, "packed-q4", "cpu")
    assert "\n" not in str(e.value)
    (path / Q4_FILE).unlink()
    with pytest.raises(SpecBlockError, match=f"no {Q4_FILE}.*packed-q4.*use packed-fp16"):
        TargetModel.load(path, "packed-q4", "cpu")
    monkeypatch.setenv("SPECBLOCK_Q4_KERNEL", "bf16")  # q4's choice of torch's kernel: named, not a build failure
    with pytest.raises(SpecBlockError, match="SPECBLOCK_Q4_KERNEL=bf16.*unset it"):
        TargetModel.load(save_tiny_packed_q4(tmp_path / "t", layers=1), "packed-q4", "cpu")
    monkeypatch.delenv("SPECBLOCK_Q4_KERNEL")
    with pytest.raises(SpecBlockError, match="fp32 kernel"):
        q4.Int4Linear(torch.nn.Linear(64, 16, bias=False), *quantize_q4_1(torch.randn(16, 64)), "bf16", bf16=True)
