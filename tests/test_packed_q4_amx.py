"""``--dtype packed-q4-amx``: packed-q4's weights (the bf16 checkpoint's, from its 4-bit codes) times
activations rounded to bf16, summed in fp32 on AMX tiles (on AVX512-BF16 dot products where the CPU
has no tiles: these tests run on whichever kernel the CPU has). Another model than packed-q4's (a bf16
matmul's arithmetic), so each method is held to its own greedy decoding, eager and compiled; a row's
outputs must not depend on the rows beside it, whatever their number."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specblock.errors import SpecBlockError
from specblock.q4file import dequantize_q4_1, dequantize_q8_0, quantize_q4_1, quantize_q8_0
from specblock.runtime import q4, q4_kernel
from specblock.runtime.drafters import LookupDrafter, RandomDrafter
from specblock.runtime.engine import Engine
from specblock.runtime.target import TargetModel
from tiny import Q4_VOCAB as V, assert_drafters_match_greedy, hf_greedy, save_tiny_packed_q4

AMX = q4_kernel.cpu_supports() and q4_kernel.amx_supports()
pytestmark = pytest.mark.skipif(not AMX, reason="packed-q4-amx needs AMX-BF16 or AVX512-BF16 (and our q4 library)")


def amx(qb_dm: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return q4_kernel.layout_amx(*qb_dm)


def test_the_weights_are_the_checkpoints_and_sums_are_fp32_sums_of_bf16_products():
    g = torch.Generator().manual_seed(0)
    for qs, d, m in (quantize_q4_1(torch.randn(48, 96, generator=g)), quantize_q4_1(torch.randn(16, 64, generator=g) * 1e-3)):
        w = dequantize_q4_1(qs, d, m).bfloat16().float()
        fp32 = q4_kernel.layout(qs, d, m)
        assert torch.equal(q4_kernel.linear_amx(torch.eye(w.shape[1]), *amx(fp32)).t(), w)  # one product each: exact
        x = torch.randn(5, w.shape[1], generator=g)
        xb = x.bfloat16().float()
        got = q4_kernel.linear_amx(x, *amx(fp32))
        assert torch.allclose(got, q4_kernel.linear(xb, *fp32, True), rtol=1e-5, atol=1e-5)  # only sums reordered
        assert torch.allclose(got, xb @ w.t(), rtol=1e-5, atol=1e-5)
    q, d = quantize_q8_0(torch.randn(32, 64, generator=g))
    w = dequantize_q8_0(q, d).bfloat16().float()
    assert torch.equal(q4_kernel.linear_amx(torch.eye(64), *amx(q4_kernel.layout_q8(q, d))).t(), w)


@settings(max_examples=10, deadline=None)
@given(rows=st.integers(1, 40), seed=st.integers(0, 2**16), threads=st.sampled_from([1, 2]))
def test_rows_are_independent_and_keyed_calls_fused_or_not_give_the_same_bits(rows, seed, threads):
    g = torch.Generator().manual_seed(seed)
    parts = [amx(q4_kernel.layout(*quantize_q4_1(torch.randn(n, 96, generator=g) * 0.05))) for n in (48, 16, 32)]
    x = torch.randn(rows, 96, generator=g)
    owner = type("Owner", (), {})()
    keys = [q4_kernel.register(p, owner, amx=True) for p in parts]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([q4_kernel.linear_amx(x, *p) for p in parts], 1)
        assert torch.equal(q4_kernel.linear_key_cat(x, keys, 96), alone)
        assert torch.equal(q4_kernel.linear_key(x, keys[1], 16), alone[:, 48:64])
        for i in range(rows):  # rows 17.. go in a second pass of 16: the same bits as alone
            assert torch.equal(torch.cat([q4_kernel.linear_amx(x[i:i + 1], *p) for p in parts], 1)[0], alone[i])
    finally:
        torch.set_num_threads(before)
    plain = q4_kernel.register(q4_kernel.layout(*quantize_q4_1(torch.randn(16, 96, generator=g))), owner, bf16=True)
    with pytest.raises(RuntimeError, match="AMX keys and others"):
        q4_kernel.linear_key_cat(x, [keys[0], plain], 64)


def test_every_pass_size_gives_a_row_the_bits_it_has_alone():
    """Each count of rows up to a pass's 8 takes its own pass shape (rows x features at once, up to 28
    accumulators, two reductions where more than 16), and more go in passes of 8 over a decoded tile:
    every one of them must give a row the bits it gets alone. Hypothesis above may skip some sizes."""
    g = torch.Generator().manual_seed(1)
    w = amx(q4_kernel.layout(*quantize_q4_1(torch.randn(64, 160, generator=g) * 0.05)))
    x = torch.randn(19, 160, generator=g)
    alone = torch.cat([q4_kernel.linear_amx(x[i:i + 1], *w) for i in range(len(x))])
    for rows in (*range(1, 11), 13, 16, 17, 19):
        assert torch.equal(q4_kernel.linear_amx(x[:rows], *w), alone[:rows]), rows


def test_every_method_matches_its_greedy_eager_and_compiled(tmp_path):
    from specblock.compiled.target import StaticTarget

    path = save_tiny_packed_q4(tmp_path / "t", layers=2)
    target = TargetModel.load(path, "packed-q4-amx", "cpu")
    assert target.dtype_name == "packed-q4-amx" and target.packed
    mods = list(target.model.modules())
    assert sum(isinstance(m, q4.Int4Linear) and m.kernel == "amx" for m in mods) == 2 * 7
    assert isinstance(target.model.lm_head, q4.Int8Linear) and target.model.lm_head.kernel == "amx"
    ref32 = TargetModel.load(path, "float32", "cpu").model
    prompt = np.random.default_rng(1).integers(2, V, 9)
    with torch.no_grad():  # a bf16 matmul's rounding of the checkpoint's model: close, not equal
        ids = torch.tensor(prompt)[None]
        got, want = target.model(ids).logits, ref32(ids).logits
        assert torch.allclose(got, want, atol=0.05) and not torch.equal(got, want)
    assert_drafters_match_greedy(target, V, seed=3, max_budget=20)
    static = StaticTarget(target.model, compile=True, buckets=(1, 8), saved=False)
    assert (static.dtype_name, static.compiled) == ("packed-q4-amx", True)
    prompt = np.random.default_rng(6).integers(2, V, 10)
    ref = hf_greedy(target.model, prompt, 16)
    for drafter in (RandomDrafter(V, seed=0), LookupDrafter(branches=2, max_ngram=2)):
        assert Engine(static, drafter, budget=7).generate(prompt, 16).token_ids == ref, drafter.name


def test_refusals_are_one_line(tmp_path, monkeypatch):
    with pytest.raises(SpecBlockError, match="amx one, which takes only those"):
        q4.Int4Linear(torch.nn.Linear(64, 16, bias=False), *quantize_q4_1(torch.randn(16, 64)), "amx")
    monkeypatch.setenv("SPECBLOCK_Q4_KERNEL", "amx")  # not a kernel for q4's exact Q4_1 weights
    with pytest.raises(SpecBlockError, match="no q4 kernel; choose one of int8, fp32, bf16; for AMX use --dtype packed-q4-amx"):
        q4.default_kernel()
    monkeypatch.delenv("SPECBLOCK_Q4_KERNEL")
    path = save_tiny_packed_q4(tmp_path / "t", layers=1)
    monkeypatch.setattr(q4_kernel, "amx_supports", lambda: False)
    with pytest.raises(SpecBlockError, match="needs AMX-BF16 or AVX512-BF16.*use packed-q4$") as e:
        TargetModel.load(path, "packed-q4-amx", "cpu")
    assert "\n" not in str(e.value)
