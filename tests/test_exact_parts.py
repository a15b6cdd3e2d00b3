"""The RMSNorm op and the rotary table (``runtime/exact_parts.py``): HF's parts, with a row's bits
its own and the same eager and compiled; and on q4's int8 kernel, a compiled step gives the eager
step's logits bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specblock.policies.tree import DraftTree
from specblock.runtime import exact_parts, packed, q4, q4_kernel
from specblock.runtime.drafters import RandomDrafter
from specblock.runtime.engine import Engine
from specblock.runtime.target import TargetModel
from tiny import hf_greedy, save_tiny, save_tiny_q4, tiny_model

pytestmark = pytest.mark.skipif(not exact_parts.load(), reason="the RMSNorm op needs AVX512F")


#: A 5-node tree of the tiny q4 model's tokens (two branches at the root).
TREE = DraftTree.from_parents(np.array([7, 9, 11, 3, 5]), np.array([-1, 0, 0, 1, 3]))


def logits_after(target, prompt: np.ndarray, tree: DraftTree) -> torch.Tensor:
    """``tree``'s logits right after ``prompt``'s prefill, on a fresh cache."""
    target.reset()
    target.prefill(prompt)
    return target.tree_forward(tree).logits


def hf_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@settings(max_examples=25, deadline=None)
@given(h=st.integers(1, 300), rows=st.integers(1, 20), eps=st.sampled_from([1e-5, 1e-6]), seed=st.integers(0, 2**16))
def test_the_norm_op_is_hfs_norm_and_a_rows_bits_are_its_own(h, rows, eps, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, h, generator=g) * 3, torch.rand(h, generator=g) + 0.5
    y = exact_parts.rms_norm(x, w, eps)
    torch.testing.assert_close(y, hf_norm(x, w, eps), rtol=2e-6, atol=2e-6)
    r = int(torch.randint(rows, (1,), generator=g))
    assert torch.equal(exact_parts.rms_norm(x[r:r + 1], w, eps), y[r:r + 1])  # alone as among the others
    assert torch.equal(exact_parts.rms_norm(x.view(1, rows, h), w, eps)[0], y)  # any leading shape


def test_compiled_parts_are_the_eager_bits():
    """What inductor would change (a reduction's order, its own cos/sin) it cannot: both parts are
    the same bits in a compiled function. HF's own modules, compiled, are not (the reason for this)."""
    model = tiny_model("llama", hidden=64)
    norm, rotary = model.model.norm, model.model.rotary_emb
    ours_norm, ours_rot = exact_parts.RowRMSNorm(norm), exact_parts.TableRotary(rotary, 256)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n in (1, 8):
            x = torch.randn(1, n, 64, generator=g) * 3
            pos = torch.arange(100, 100 + n)[None]
            assert torch.equal(torch.compile(ours_norm, dynamic=False)(x), ours_norm(x))
            got, want = torch.compile(ours_rot, dynamic=False)(x, pos), ours_rot(x, pos)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            hf = rotary(x, pos)
            torch.testing.assert_close(want, hf, rtol=0, atol=1e-6)


def test_the_swap_takes_hfs_rms_norms_and_static_rotary_and_nothing_else():
    llama = tiny_model("llama", layers=2, hidden=64)
    assert exact_parts.use_exact_parts(llama) == (2 * 2 + 1, 1)
    assert isinstance(llama.model.norm, exact_parts.RowRMSNorm) and isinstance(llama.model.rotary_emb, exact_parts.TableRotary)
    assert exact_parts.use_exact_parts(llama) == (0, 0)  # swapped parts are not swapped again
    qwen3 = tiny_model("qwen3", layers=2, hidden=64)
    assert exact_parts.use_exact_parts(qwen3) == (2 * 4 + 1, 1)  # each layer's q_norm and k_norm too

    class GemmaLikeRMSNorm(torch.nn.Module):  # (1 + w): the name, another formula
        def __init__(self) -> None:
            super().__init__()
            self.weight, self.variance_epsilon = torch.nn.Parameter(torch.zeros(64)), 1e-6

        def forward(self, x):
            return (1 + self.weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    holder = torch.nn.Sequential(GemmaLikeRMSNorm())
    assert exact_parts.use_exact_parts(holder) == (0, 0) and isinstance(holder[0], GemmaLikeRMSNorm)


@pytest.mark.skipif(not (q4_kernel.cpu_supports() and q4_kernel.load() and q4_kernel.vnni_supports()),
                    reason="the int8 q4 kernel needs AVX512-VNNI")
def test_an_int8_q4_compiled_step_gives_the_eager_steps_logits(tmp_path, monkeypatch):
    """The int8 kernel rounds each linear's input, so any last-bit difference before it may move a
    logit by a whole step: a compiled step (static cache, masked prefill, inductor's graph) must give
    the eager target's logits (HF's cache, its causal prefill) bit for bit, a lone token and a tree."""
    from specblock.compiled.target import StaticTarget

    monkeypatch.setattr(q4, "default_kernel", lambda: "int8")
    path = save_tiny_q4(tmp_path / "t", layers=2)
    eager = TargetModel.load(path, "q4", "cpu")
    assert isinstance(eager.model.model.norm, exact_parts.RowRMSNorm)
    compiled = StaticTarget(TargetModel.load(path, "q4", "cpu").model, compile=True, buckets=(1, 8), saved=False)
    prompt = np.random.default_rng(4).integers(2, 48, 40)
    for tree in (DraftTree.from_parents(np.array([7]), np.array([-1])), TREE):
        assert torch.equal(logits_after(eager, prompt, tree), logits_after(compiled, prompt, tree))


@pytest.mark.skipif(not (q4_kernel.cpu_supports() and q4_kernel.load()), reason="our q4 kernels need AVX512F/AVX512BW")
def test_an_eager_prompt_leaves_the_keys_and_values_of_the_static_caches_prefill(tmp_path, monkeypatch):
    """A prompt without a past carries no mask in HF's eager forward (SDPA's causal flag); the static
    cache's prefill passes one. Both go through the fused attention op (``grouped_rows._fused``), so
    a tree forward after either gives the same bits. Checked on q4's fp32 kernel with these parts
    (rows independent, nothing rounded to absorb a last bit: a different key shows in the logits)."""
    from specblock.compiled.target import StaticTarget

    monkeypatch.setattr(q4, "default_kernel", lambda: "fp32")
    path = save_tiny_q4(tmp_path / "t", layers=2)
    eager = TargetModel.load(path, "q4", "cpu")
    assert exact_parts.use_exact_parts(eager.model) == (5, 1)
    static = StaticTarget(eager.model, compile=False)
    prompt = np.random.default_rng(0).integers(2, 48, 30)
    assert torch.equal(logits_after(eager, prompt, TREE), logits_after(static, prompt, TREE))


@pytest.mark.skipif(not packed.available(), reason="packed fp16 needs torch's fbgemm (an x86 build)")
def test_a_packed_fp16_target_takes_the_parts_for_speed_unless_told_not_to(tmp_path, monkeypatch):
    """Since stop 62 packed-fp16 loads with the parts (6-11% off each eager forward), but not the
    prompts' switch (slower on long prompts, and exactness there is q4's need). Its logits stay HF's
    but for last bits, and greedy decoding stays the same target's own greedy decoding."""
    from specblock.errors import SpecBlockError
    from specblock.runtime import grouped_rows

    path = save_tiny(tmp_path / "t", layers=2, hidden=64)
    ours = TargetModel.load(path, "packed-fp16", "cpu")
    assert sum(isinstance(m, exact_parts.RowRMSNorm) for m in ours.model.modules()) == 5
    assert isinstance(ours.model.model.rotary_emb, exact_parts.TableRotary)
    assert not any(getattr(m, grouped_rows.EXACT_PROMPT, False) for m in ours.model.modules())
    monkeypatch.setenv("SPECBLOCK_EXACT_PARTS", "off")
    hf = TargetModel.load(path, "packed-fp16", "cpu")
    assert not any(isinstance(m, (exact_parts.RowRMSNorm, exact_parts.TableRotary)) for m in hf.model.modules())
    prompt = np.random.default_rng(1).integers(2, 60, 30)
    torch.testing.assert_close(logits_after(ours, prompt, TREE), logits_after(hf, prompt, TREE), rtol=0, atol=1e-4)
    ref = hf_greedy(ours.model, prompt, 16)  # the loaded model as HF's generate runs it (q/k/v shared too)
    for seed in range(3):
        assert Engine(ours, RandomDrafter(64, seed=seed), budget=6).generate(prompt, 16).token_ids == ref
    monkeypatch.setenv("SPECBLOCK_EXACT_PARTS", "yes")
    with pytest.raises(SpecBlockError, match="SPECBLOCK_EXACT_PARTS='yes': use on or off"):
        TargetModel.load(path, "packed-fp16", "cpu")


def test_a_drafters_norm_serves_through_the_op_and_trains_through_the_formula():
    from specblock.runtime.drafters.layers import RMSNorm

    norm = RMSNorm(70, 1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 3, 70, generator=torch.Generator().manual_seed(0)) * 3
    with torch.no_grad():
        formula = norm(x)
        norm.op = True
        served = norm(x)
    torch.testing.assert_close(served, formula, rtol=2e-6, atol=2e-6)
    assert torch.equal(served[1, 2], exact_parts.rms_norm(x[1, 2:3], norm.weight, 1e-6)[0])  # the op's row bits
    x.requires_grad_(True)
    norm(x).square().sum().backward()  # the op has no backward: with grad on, the formula
    assert x.grad is not None and norm.weight.grad is not None


@pytest.mark.skipif(not packed.available(), reason="packed fp16 needs torch's fbgemm (an x86 build)")
def test_a_drafter_beside_a_packed_target_takes_the_op_unless_told_not_to(monkeypatch):
    """``pack_drafter`` (what ``drafters.build`` does beside a packed target) sets every norm to the op,
    as the target's own norms take it; with ``SPECBLOCK_EXACT_PARTS=off`` none."""
    from specblock.runtime import drafters
    from specblock.runtime.drafters.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Net
    from specblock.runtime.drafters.layers import RMSNorm

    def served_norms() -> tuple[int, int]:
        net = Eagle3Net(Eagle3Config(vocab_size=64, hidden_size=32, num_heads=4, intermediate_size=64,
                                     tap_layers=(0, 1, 1), top_k=4)).eval()
        drafters.pack_drafter(Eagle3Drafter(net))
        norms = [m for m in net.modules() if isinstance(m, RMSNorm)]
        return sum(m.op for m in norms), len(norms)

    on, norms = served_norms()
    assert on == norms > 0
    monkeypatch.setenv("SPECBLOCK_EXACT_PARTS", "off")
    assert served_norms() == (0, norms)


def hf_apply(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """transformers' Llama ``apply_rotary_pos_emb`` as written there (the module's global may be patched)."""
    from transformers.models.llama.modeling_llama import rotate_half

    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


@settings(max_examples=25, deadline=None)
@given(half=st.integers(1, 80), heads=st.integers(1, 9), kv=st.integers(1, 3), n=st.integers(1, 12),
       batch=st.integers(1, 2), sliced=st.booleans(), seed=st.integers(0, 2**16))
def test_the_rotary_op_is_hfs_rotary_application_bit_for_bit(half, heads, kv, n, batch, sliced, seed):
    """Any head size (a masked last chunk), q and k as HF's attention hands them over (a transposed
    view of the projection; ``sliced``: columns of a stacked q/k/v product), output strided as the input."""
    d, g = 2 * half, torch.Generator().manual_seed(seed)
    if sliced:
        qkv = torch.randn(batch, n, (heads + 2 * kv) * d, generator=g) * 4
        q, k = qkv[..., :heads * d], qkv[..., heads * d:(heads + kv) * d]
    else:
        q, k = torch.randn(batch, n, heads * d, generator=g) * 4, torch.randn(batch, n, kv * d, generator=g) * 4
    q, k = q.view(batch, n, heads, d).transpose(1, 2), k.view(batch, n, kv, d).transpose(1, 2)
    cos, sin = (torch.rand(2, batch, n, d, generator=g) * 2 - 1).unbind(0)
    got, want = exact_parts.rotary(q, k, cos, sin), hf_apply(q, k, cos, sin)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
        assert [st for st, size in zip(a.stride(), a.shape) if size > 1] == [st for st, size in zip(b.stride(), b.shape) if size > 1]


def test_a_loaded_models_attention_applies_rotary_through_the_op_with_the_same_logits(tmp_path, monkeypatch):
    """On a packed-fp16 load (or wherever the table is), HF's attention calls the op during the
    target's forwards: the logits bit for bit as with HF's function (the same target without its
    swaps, and one loaded with ``SPECBLOCK_ROTARY_OP=off``), the op called once per layer. Another
    model of the family in the process (fp32: HF's own rotary) keeps HF's function."""
    if not packed.available():
        pytest.skip("packed fp16 needs torch's fbgemm (an x86 build)")
    path = save_tiny(tmp_path / "t", layers=2, hidden=64)
    target = TargetModel.load(path, "packed-fp16", "cpu")
    assert isinstance(target.model.model.rotary_emb, exact_parts.TableRotary)
    swaps = getattr(target.model, exact_parts.ROTARY_SWAPS)
    assert len(swaps) == 1
    calls = []
    real = exact_parts.rotary
    monkeypatch.setattr(exact_parts, "rotary", lambda *a: calls.append(1) or real(*a))
    prompt = np.random.default_rng(2).integers(2, 60, 30)
    with_op = logits_after(target, prompt, TREE)
    assert len(calls) == 2 * 2  # two layers, the prompt and the tree
    monkeypatch.setattr(target.model, exact_parts.ROTARY_SWAPS, [])
    without = logits_after(target, prompt, TREE)
    assert len(calls) == 4 and torch.equal(with_op, without)
    fp32 = TargetModel.load(path, "float32", "cpu")
    logits_after(fp32, prompt, TREE)
    assert len(calls) == 4
    monkeypatch.setenv("SPECBLOCK_ROTARY_OP", "off")  # the load-time baseline
    off = TargetModel.load(path, "packed-fp16", "cpu")
    assert isinstance(off.model.model.rotary_emb, exact_parts.TableRotary)
    assert not getattr(off.model, exact_parts.ROTARY_SWAPS, None) and torch.equal(logits_after(off, prompt, TREE), with_op)
    assert len(calls) == 4


def test_the_rotary_op_replaces_only_hfs_formula_and_only_during_a_forward():
    """``use_rotary_op`` prepares a wrapper for a modeling module whose function computes HF's
    half-split formula, and none for one that rotates in another layout; the module's global is the
    wrapper only inside ``rotary_op`` (so compiled graphs and other models never see it)."""
    import sys
    import types

    llama = tiny_model("llama", layers=1, hidden=64)
    module = sys.modules[type(llama.model.layers[0].self_attn).__module__]
    hf = module.apply_rotary_pos_emb
    assert exact_parts.use_rotary_op(llama) == 1 and module.apply_rotary_pos_emb is hf
    with exact_parts.rotary_op(llama):
        assert module.apply_rotary_pos_emb is not hf
        with exact_parts.rotary_op(llama):  # nested: the outer swap comes back
            pass
        assert module.apply_rotary_pos_emb is not hf
    assert module.apply_rotary_pos_emb is hf

    def interleaved(q, k, cos, sin):  # GPT-J's pairs (x0, x1), (x2, x3), ...: another formula, the same name
        def rot(x):
            return torch.stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)
        return q * cos.unsqueeze(1) + rot(q) * sin.unsqueeze(1), k * cos.unsqueeze(1) + rot(k) * sin.unsqueeze(1)

    fake = types.ModuleType("specblock_test_interleaved_rotary")
    fake.apply_rotary_pos_emb = interleaved

    class Attention(torch.nn.Module):
        pass

    Attention.__module__ = fake.__name__
    sys.modules[fake.__name__] = fake
    try:
        holder = torch.nn.Sequential(Attention())
        assert exact_parts.use_rotary_op(holder) == 0
        with exact_parts.rotary_op(holder):
            assert fake.apply_rotary_pos_emb is interleaved
    finally:
        sys.modules.pop(fake.__name__)
