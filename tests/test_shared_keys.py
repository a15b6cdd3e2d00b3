"""Our q4 kernels' sibling linears (q/k/v, gate/up) as one kernel call in eager forwards
(``shared_input.SharedKeys``): the fused call gives each output its own call's bits, so the
logits are those of separate calls exactly, whatever the order and inputs of the calls."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specblock.runtime import q4, q4_kernel, shared_input
from specblock.runtime.target import TargetModel
from tiny import Q4_VOCAB, save_tiny_packed_q4, save_tiny_q4

OURS = q4_kernel.cpu_supports() and q4_kernel.load()
pytestmark = pytest.mark.skipif(not OURS, reason="our q4 kernels need AVX512F/BW and a C++ compiler")

DTYPES = ["packed-q4"] + (["packed-q4-amx"] if OURS and q4_kernel.amx_supports() else []) + \
         (["q4"] if OURS and q4.default_kernel() in q4.OURS else [])


def groups(target: TargetModel) -> int:
    return len({id(m.shared) for m in target.model.modules() if isinstance(getattr(m, "shared", None), shared_input.SharedKeys)})


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_siblings_give_the_separate_calls_logits_bit_for_bit(tmp_path, monkeypatch, dtype):
    path = (save_tiny_q4 if dtype == "q4" else save_tiny_packed_q4)(tmp_path / "t", layers=2)
    shared = TargetModel.load(path, dtype, "cpu")
    monkeypatch.setenv("SPECBLOCK_SHARED_INPUT", "off")
    alone = TargetModel.load(path, dtype, "cpu")
    assert groups(shared) == 2 * 2 and groups(alone) == 0  # q/k/v and gate/up in each layer
    x = torch.as_tensor(np.random.default_rng(0).integers(0, Q4_VOCAB, (1, 23)))
    with torch.no_grad():
        assert torch.equal(shared.model(x).logits, alone.model(x).logits)


def test_each_call_is_its_own_linear_whatever_the_input_and_order(tmp_path):
    target = TargetModel.load(save_tiny_packed_q4(tmp_path / "t", layers=1), "packed-q4", "cpu")
    attn = target.model.model.layers[0].self_attn
    own = lambda lin, x: q4_kernel.linear(x.reshape(-1, x.shape[-1]), *lin._q4, lin.bf16).reshape(*x.shape[:-1], -1)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(1, 4, 64, generator=g), torch.randn(1, 4, 64, generator=g)
    with torch.no_grad():
        for lin in (attn.v_proj, attn.q_proj, attn.k_proj):  # not HF's order: all from one fused call
            assert torch.equal(lin(x), own(lin, x))
        assert torch.equal(attn.k_proj(y), own(attn.k_proj, y))  # another input
        q = attn.q_proj(x)
        x.mul_(2)  # the same tensor, changed in place: its version counter says so
        assert torch.equal(attn.k_proj(x), own(attn.k_proj, x))
        assert torch.equal(q, own(attn.q_proj, x / 2))
        z = torch.randn(1, 2, 64, generator=g)
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj):
            lin(z)
    assert attn.q_proj.shared.x is None and attn.q_proj.shared.out is None  # each sibling served: nothing held
