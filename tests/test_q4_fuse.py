"""q4's keyed linears that read the same input, in one call (``specblock_q4::linear_key_cat``) and
fused so by the compiled graph's pass (``compiled/fuse.py``): every output the same bits as its own
linear's call, on both of our kernels."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specblock.q4file import quantize_q4_1
from specblock.runtime import q4, q4_kernel

OURS = q4_kernel.cpu_supports() and q4_kernel.load()
KERNELS = (["fp32"] if OURS else []) + (["int8"] if OURS and q4_kernel.vnni_supports() else [])
pytestmark = pytest.mark.skipif(not OURS, reason="our q4 kernels need AVX512F/AVX512BW")

#: out features of the parts: an int8 block is 16 features, so 16 is a lone block and 80 an odd count.
WIDTHS = (80, 48, 16, 128)


class _Owner:
    """What the keys live as long as."""


def keyed(kernel: str, k: int, seed: int) -> tuple[list[int], _Owner]:
    g = torch.Generator().manual_seed(seed)
    owner = _Owner()
    keys = []
    for n in WIDTHS:
        qs, d, m = quantize_q4_1(torch.randn(n, k, generator=g) * 0.05)
        weights = (q4_kernel.layout8(qs, d, m),) if kernel == "int8" else q4_kernel.layout(qs, d, m)
        keys.append(q4_kernel.register(weights, owner))
    return keys, owner


@settings(max_examples=12, deadline=None)
@given(rows=st.integers(1, 19), threads=st.sampled_from([1, 2]), kernel=st.sampled_from(KERNELS or ["fp32"]),
       seed=st.integers(0, 2**16))
def test_one_call_gives_each_linear_its_own_bits(rows, threads, kernel, seed):
    keys, _owner = keyed(kernel, 96, seed)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(seed))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([q4_kernel.linear_key(x, key, n) for key, n in zip(keys, WIDTHS)], 1)
        together = q4_kernel.linear_key_cat(x, keys, sum(WIDTHS))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(alone, together)


def test_one_call_refuses_a_wrong_width_too_many_keys_and_mixed_kernels():
    keys, _owner = keyed(KERNELS[0], 64, 0)
    with pytest.raises(RuntimeError, match="outputs, not"):
        q4_kernel.linear_key_cat(torch.randn(2, 64), keys, sum(WIDTHS) + 16)
    with pytest.raises(ValueError, match="1 to 4 keys"):
        q4_kernel.linear_key_cat(torch.randn(2, 64), keys + keys[:1], sum(WIDTHS) + WIDTHS[0])
    if len(KERNELS) == 2:
        other, _other_owner = keyed("int8", 64, 1)
        with pytest.raises(RuntimeError, match="both kernels"):
            q4_kernel.linear_key_cat(torch.randn(2, 64), [keys[0], other[0]], WIDTHS[0] * 2)


def q4_linear(n: int, seed: int, kernel: str) -> q4.Int4Linear:
    torch.manual_seed(seed)
    lin = torch.nn.Linear(64, n, bias=False)
    return q4.Int4Linear(lin, *quantize_q4_1(lin.weight), kernel)


def assert_fuses(module: torch.nn.Module, x: torch.Tensor, fused: int, single: int) -> None:
    """Compiled with the pass: ``fused`` fused calls and ``single`` single ones; without it, every
    linear its own call; the same bits either way."""
    with_pass, calls = compiled_calls(module, x, True)
    assert calls == {"linear_key_cat": fused, "linear_key": single}
    without, calls = compiled_calls(module, x, False)
    assert calls == {"linear_key_cat": 0, "linear_key": len([m for m in module.modules() if isinstance(m, q4.Int4Linear)])}
    assert torch.equal(with_pass, without)


def compiled_calls(module: torch.nn.Module, x: torch.Tensor, fused: bool) -> tuple[torch.Tensor, dict[str, int]]:
    """``module`` compiled with or without the pass: its output and its q4 calls by op."""
    from torch._inductor.utils import run_and_get_code

    from specblock.compiled.fuse import FusePackedLinears

    torch._dynamo.reset()
    options = {"post_grad_custom_post_pass": FusePackedLinears()} if fused else {}
    got, code = run_and_get_code(torch.compile(module, fullgraph=True, options=options), x)
    torch._dynamo.reset()
    src = "\n".join(code)
    return got, {op: src.count(f"torch.ops.specblock_q4.{op}.default(") for op in ("linear_key_cat", "linear_key")}


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_pass_fuses_at_most_four_linears_a_call(kernel):
    """Six linears on one input: a call of four and one of two, the same bits as unfused."""

    class Six(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.parts = torch.nn.ModuleList(q4_linear(32, seed, kernel) for seed in range(6))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return sum(p(x) for p in self.parts)

    assert_fuses(Six().requires_grad_(False), torch.randn(1, 3, 64), fused=2, single=0)


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_pass_fuses_q4_linears_that_share_an_input(kernel):
    """q and k read x (each flattening it: the graph keeps a reshape apiece), o reads q: one fused
    call and one single, and the same bits as the graph compiled without the pass."""

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.o = q4_linear(64, 1, kernel), q4_linear(32, 2, kernel), q4_linear(64, 3, kernel)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k = self.q(x), self.k(x)
            return self.o(q * 2) + k.sum(-1, keepdim=True)

    assert_fuses(Block().requires_grad_(False), torch.randn(1, 5, 64), fused=1, single=1)
