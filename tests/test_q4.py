"""``--dtype q4``: a model's own Q4_1 GGUF weights. Our kernels (fp32, AVX512; int8, AVX512-VNNI
with int8 activations): lossless like fp32, eager and compiled; torch's int4 kernel (the
fallback): lossless like bf16, up to near-ties."""

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specblock.errors import SpecBlockError
from specblock.q4file import (GROUP, Q4_FILE, decode_gguf_q4_1, decode_gguf_q8_0, dequantize_q4_1, dequantize_q8_0,
                              pack_nibbles, quantize_q4_1, quantize_q8_0, save_q4)
from specblock.runtime import packed, q4, q4_kernel
from specblock.runtime.drafters import LookupDrafter, RandomDrafter
from specblock.runtime.engine import Engine
from specblock.runtime.target import TargetModel
from tiny import Q4_VOCAB as V, hf_greedy, run_cli, save_tiny, save_tiny_q4

pytestmark = pytest.mark.skipif(not (q4.available() and packed.available()),
                                reason="torch without the CPU int4 kernel or fbgemm (not an x86 build)")
OURS = q4_kernel.cpu_supports() and q4_kernel.load()
VNNI = OURS and q4_kernel.vnni_supports()
#: The kernels this machine runs: torch's everywhere, ours where the CPU has AVX512 (int8: and VNNI).
KERNELS = ["bf16"] + (["fp32"] if OURS else []) + (["int8"] if VNNI else [])
needs_ours = pytest.mark.skipif(not OURS, reason="the fp32 q4 kernel needs AVX512F/AVX512BW (torch's kernel runs instead)")
needs_vnni = pytest.mark.skipif(not VNNI, reason="the int8 q4 kernel needs AVX512-VNNI")


def q4_linear(n: int = 48, k: int = 64, seed: int = 0, kernel: str = "bf16") -> tuple[q4.Int4Linear, torch.Tensor]:
    torch.manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=False)
    qs, d, m = quantize_q4_1(lin.weight)
    return q4.Int4Linear(lin, qs, d, m, kernel), (qs, d, m)


def kernel_weights(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """What the kernel multiplies by: ``(q - 8) * scale + zero`` with bf16 scale and zero."""
    q = torch.stack([qs & 0xF, qs >> 4], -1).reshape(qs.shape[0], -1, GROUP).float()
    scale = d.float().bfloat16().float()[..., None]
    zero = (m.float() + 8 * d.float()).bfloat16().float()[..., None]
    return ((q - 8) * scale + zero).reshape(qs.shape[0], -1)


def test_torch_kernel_multiplies_by_bf16_rounded_q4_weights():
    lin, (qs, d, m) = q4_linear(kernel="bf16")
    x = torch.randn(2, 5, 64)
    got = lin(x)
    assert got.dtype == torch.float32 and got.shape == (2, 5, 48)
    want = torch.nn.functional.linear(x.bfloat16().float(), kernel_weights(qs, d, m))
    assert torch.allclose(got, want, rtol=1e-2, atol=1e-2)  # the kernel's output is bf16
    # and the scale rounding is small against Q4_1's own step: close to d * q + m too
    assert torch.allclose(kernel_weights(qs, d, m), dequantize_q4_1(qs, d, m), atol=float(d.float().max()) * 0.1)


@needs_ours
def test_our_kernel_multiplies_by_the_exact_q4_weights_in_fp32():
    lin, (qs, d, m) = q4_linear(n=96, k=128, kernel="fp32")
    assert "fp32 kernel" in repr(lin)
    w = dequantize_q4_1(qs, d, m)
    assert torch.equal(lin(torch.eye(128)).t(), w)  # each weight is d * q + m bit for bit
    x = torch.randn(3, 7, 128, dtype=torch.float64).float()
    got = lin(x)
    assert got.dtype == torch.float32 and got.shape == (3, 7, 96)
    want = (x.double() @ w.double().t()).float()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)  # fp32 sums, not bf16
    assert lin(x[:0].reshape(0, 128)).shape == (0, 96)


def quantized_rows(x: torch.Tensor) -> torch.Tensor:
    """What the int8 kernel multiplies by: each row's groups of 32 as ``dx * round(x / dx)`` with
    ``dx = amax / 127`` (ggml's Q8_1)."""
    g = x.reshape(x.shape[0], -1, GROUP)
    amax = g.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return (torch.round(g * scale) * (amax / 127)).reshape(x.shape)


@needs_vnni
@pytest.mark.parametrize("head", [False, True])
def test_int8_kernel_multiplies_int8_rows_by_the_exact_weights(head):
    """Q4_1 (and the Q8_0 head) against activations rounded to int8 per row and group of 32: close
    to that product in fp64, and visibly not the fp32 kernel's product (the rounding is real)."""
    if head:
        lin, (q, d) = q8_linear(n=96, k=128, kernel="int8")
        w = dequantize_q8_0(q, d)
    else:
        lin, quantized = q4_linear(n=96, k=128, kernel="int8")
        w = dequantize_q4_1(*quantized)
    assert "int8 kernel" in repr(lin)
    x = torch.randn(9, 128)
    got = lin(x)
    want = (quantized_rows(x).double() @ w.double().t()).float()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4)
    assert not torch.allclose(got, (x.double() @ w.double().t()).float(), rtol=1e-5, atol=1e-4)
    assert torch.equal(lin(torch.zeros(2, 128)), torch.zeros(2, 96))  # an all-zero group quantizes to zero
    assert lin(x[:0]).shape == (0, 96)


@needs_ours
def test_our_kernel_checks_its_inputs():
    _, (qs, d, m) = q4_linear(kernel="bf16")
    qb, dm = q4_kernel.layout(qs, d, m)
    with pytest.raises(RuntimeError, match="inputs"):
        q4_kernel.linear(torch.randn(2, 96), qb, dm)
    with pytest.raises(RuntimeError, match="float32"):
        q4_kernel.linear(torch.randn(2, 64).double(), qb, dm)
    with pytest.raises(ValueError, match="does not fit the q4 kernel"):
        q4_kernel.layout(qs[:6], d[:6], m[:6])
    with pytest.raises(ValueError, match="does not fit the int8 kernel"):
        q4_kernel.layout8(qs[:8], d[:8], m[:8])
    if VNNI:
        w = q4_kernel.layout8(qs[:32], d[:32], m[:32])
        with pytest.raises(RuntimeError, match="inputs"):
            q4_kernel.linear8(torch.randn(2, 96), w)
        with pytest.raises(RuntimeError, match="uint8"):
            q4_kernel.linear8(torch.randn(2, 64), w[..., :300].contiguous())


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 64), seed=st.integers(0, 2**16), kernel=st.sampled_from(KERNELS))
def test_each_row_is_its_own_dot_products(rows, seed, kernel):
    """Tree verification is lossless only if a token's logits do not depend on the other rows
    (ours: 1-4 rows share a pass over all four features of a block, more go 8 at a time over two)."""
    lin, _ = q4_linear(seed=seed % 7, kernel=kernel)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(seed))
    together = lin(x)
    alone = torch.cat([lin(x[i:i + 1]) for i in range(rows)])
    assert torch.equal(together, alone)


def q8_linear(n: int = 48, k: int = 64, seed: int = 0, kernel: str = "fp32") -> tuple[q4.Int8Linear, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=False)
    q, d = quantize_q8_0(lin.weight)
    return q4.Int8Linear(lin, q, d, kernel), (q, d)


@needs_ours
def test_the_q8_head_multiplies_by_the_exact_q8_weights_in_fp32():
    lin, (q, d) = q8_linear(n=96, k=128)
    w = dequantize_q8_0(q, d)
    assert torch.equal(lin.weight, w)  # what drafters copy is what the kernel multiplies by
    assert torch.equal(lin(torch.eye(128)).t(), w)
    x = torch.randn(3, 7, 128)
    got = lin(x)
    assert got.shape == (3, 7, 96) and "q8_0" in repr(lin)
    assert torch.allclose(got, (x.double() @ w.double().t()).float(), rtol=1e-5, atol=1e-5)
    assert lin.nbytes() == 96 * 128 + 96 * 4 * 4  # a byte a weight, an fp32 scale per 32
    with pytest.raises(SpecBlockError, match="do not fit"):
        q4.Int8Linear(torch.nn.Linear(128, 96, bias=False), q[:, :64], d[:, :2])


@needs_ours
@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 40), seed=st.integers(0, 2**16), kernel=st.sampled_from([k for k in KERNELS if k != "bf16"]))
def test_each_q8_row_is_its_own_dot_products(rows, seed, kernel):
    lin, _ = q8_linear(seed=seed % 5, kernel=kernel)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(lin(x), torch.cat([lin(x[i:i + 1]) for i in range(rows)]))


@needs_ours
def test_prefetching_moves_no_result():
    lin, _ = q4_linear(n=256, k=128, kernel="fp32")
    head, _ = q8_linear(n=256, k=128)
    x = torch.randn(6, 128)
    lin8, _ = (q4_linear(n=256, k=128, kernel="int8") if VNNI else (None, None))
    head8, _ = (q8_linear(n=256, k=128, kernel="int8") if VNNI else (None, None))
    try:
        outs = []
        for ahead in (0, 1, 3):
            torch.ops.specblock_q4.set_prefetch(ahead)
            torch.ops.specblock_q4.set_prefetch8(3 * ahead)
            torch.ops.specblock_q4.set_far8(10 * ahead)  # past a block's groups too: into the next block's
            outs.append((lin(x), head(x), lin(x[:2])) + ((lin8(x), head8(x), lin8(x[:2])) if VNNI else ()))
    finally:
        torch.ops.specblock_q4.set_prefetch(1)
        torch.ops.specblock_q4.set_prefetch8(q4_kernel.PREFETCH8)
        torch.ops.specblock_q4.set_far8(q4_kernel.FAR8)
    assert all(torch.equal(a, b) for out in outs[1:] for a, b in zip(outs[0], out))


def test_gguf_blocks_decode_and_quantize_round_trips():
    rng = np.random.default_rng(0)
    q = rng.integers(0, 16, (4, 64)).astype(np.uint8)
    d = rng.random((4, 2)).astype(np.float16)
    m = (-rng.random((4, 2))).astype(np.float16)
    raw = np.zeros((4, 2, 20), np.uint8)
    raw[..., 0:2] = d.view(np.uint8).reshape(4, 2, 2)
    raw[..., 2:4] = m.view(np.uint8).reshape(4, 2, 2)
    blocks = q.reshape(4, 2, 32)
    raw[..., 4:] = blocks[..., :16] | (blocks[..., 16:] << 4)  # ggml: low nibbles 0..15, high 16..31
    got_q, got_d, got_m = decode_gguf_q4_1(raw.reshape(4, 40))
    assert np.array_equal(got_q, q) and np.array_equal(got_d, d) and np.array_equal(got_m, m)
    q8 = rng.integers(-128, 128, (4, 64)).astype(np.int8)
    raw8 = np.zeros((4, 2, 34), np.uint8)
    raw8[..., 0:2] = d.view(np.uint8).reshape(4, 2, 2)
    raw8[..., 2:] = q8.view(np.uint8).reshape(4, 2, 32)
    got_q8, got_d8 = decode_gguf_q8_0(raw8.reshape(4, 68))
    assert np.array_equal(got_q8, q8) and np.array_equal(got_d8, d)
    w = torch.randn(16, 64)
    q8t, d8 = quantize_q8_0(w)
    assert q8t.dtype == torch.int8 and (dequantize_q8_0(q8t, d8) - w).abs().max() <= d8.float().max() * 0.51 + 1e-3
    qs, d4, m4 = quantize_q4_1(w)
    assert torch.equal(pack_nibbles(torch.stack([qs & 0xF, qs >> 4], -1).reshape(16, 64)), qs)
    assert (dequantize_q4_1(qs, d4, m4) - w).abs().max() <= d4.float().max() * 0.51 + 1e-3


def test_write_q4_reads_a_gguf_in_the_checkpoints_row_order(tmp_path):
    """q/k rows un-permuted as transformers does when it dequantizes the GGUF; other linears as stored."""
    gguf = pytest.importorskip("gguf")
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    from specblock.models.convert import unpermute_rows, write_q4

    rng = np.random.default_rng(1)
    heads, kv_heads, k = 4, 2, 64
    shapes = {"attn_q": 64, "attn_k": 32, "ffn_up": 96}
    raws = {}
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    for kind, rows in shapes.items():
        raw = rng.integers(0, 256, (rows, k // 32 * 20), dtype=np.uint8)
        raw.reshape(rows, -1, 20)[..., 0:4] = np.frombuffer(np.float16([0.01, -0.1]).tobytes(), np.uint8)
        raws[kind] = raw
        w.add_tensor(f"blk.0.{kind}.weight", raw, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    w.add_tensor("blk.0.attn_norm.weight", np.ones(k, np.float32))
    embd = rng.integers(0, 256, (V, k // 32 * 34), dtype=np.uint8)
    embd.reshape(V, -1, 34)[..., 0:2] = np.frombuffer(np.float16([0.01]).tobytes(), np.uint8)
    w.add_tensor("token_embd.weight", embd, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    cfg = {"model_type": "llama", "num_attention_heads": heads, "num_key_value_heads": kv_heads}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert write_q4(tmp_path / "m.gguf", tmp_path) == (3, False)  # an untied head is not the embedding
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    assert write_q4(tmp_path / "m.gguf", tmp_path) == (3, True)
    from safetensors.torch import load_file

    got = load_file(str(tmp_path / Q4_FILE))
    want_q8, want_d8 = decode_gguf_q8_0(embd)
    assert np.array_equal(got["lm_head.q8"].numpy(), want_q8) and np.array_equal(got["lm_head.d8"].numpy(), want_d8)
    for kind, hf in (("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"), ("ffn_up", "mlp.up_proj")):
        q, d, m = decode_gguf_q4_1(raws[kind])
        stored = dequantize_q4_1(torch.from_numpy(q[:, 0::2] | (q[:, 1::2] << 4)), torch.from_numpy(d), torch.from_numpy(m))
        # transformers' own processing of the same (dequantized) matrix
        proc = LlamaTensorProcessor({"num_attention_heads": heads, "num_key_value_heads": kv_heads})
        want = proc.process(stored.numpy(), f"blk.0.{kind}.weight").weights
        if kind != "ffn_up":
            n = heads if kind == "attn_q" else kv_heads
            assert not np.array_equal(unpermute_rows(len(q), n), np.arange(len(q)))  # a real permutation
        name = f"model.layers.0.{hf}"
        ours = dequantize_q4_1(got[f"{name}.qs"], got[f"{name}.d"], got[f"{name}.m"]).numpy()
        assert np.array_equal(ours, want), kind


#: How far apart two tokens' logits may be where a decoding on torch's kernel parts from the
#: reference: that kernel rounds its input and output to bf16, so fp32 differences of 1e-5 between
#: tree shapes (attention over other lengths) can move a logit by a bf16 step. A wrong acceptance
#: parts at a token far below the best (random drafts on this sharpened head: several units).
NEAR_TIE = 0.25


def first_parting(model, prompt, got: list[int], ref: list[int]) -> float | None:
    """None where ``got`` equals ``ref``; else the reference's logit gap between its token and
    ``got``'s at the first difference (the model's own eager forward over the shared prefix)."""
    i = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), None)
    if i is None:
        assert len(got) == len(ref)
        return None
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + ref[:i]])).logits[0, -1]
    return float(logits[ref[i]] - logits[got[i]])


def check_parting(kernel: str, gap: float | None, what) -> None:
    """Ours (fp32, int8): identical (every part of a row's forward is row-independent and the same
    bits eager and compiled). torch's: identical or parted at a near-tie (like bf16)."""
    if kernel in q4.OURS:
        assert gap is None, (what, gap)
    else:
        assert gap is None or abs(gap) < NEAR_TIE, (what, gap)


@pytest.fixture(params=KERNELS)
def kernel(request, monkeypatch):
    """Loads in the test use this kernel (``TargetModel.load`` takes the default one)."""
    monkeypatch.setattr(q4, "default_kernel", lambda: request.param)
    return request.param


def test_load_and_every_method_match_the_q4_models_greedy(tmp_path, capsys, kernel):
    """Our kernels: every output equals the q4 model's greedy decoding (HF's generate on the same
    model object), on the int8 kernel too (its rounding would turn any last-bit difference into a
    step; ``exact_parts.py``). torch's: equal except where a method parts at a near-tie (its bf16
    rounding turns the fp32 attention's tiny differences between tree sizes into whole steps)."""
    path = save_tiny_q4(tmp_path / "t", layers=3)
    target = TargetModel.load(path, "q4", "cpu")
    mods = list(target.model.modules())
    assert sum(isinstance(m, q4.Int4Linear) and m.kernel == kernel for m in mods) == 3 * 7
    # the Q8_0 head in our kernels; torch's has none, so there the head is packed fp16
    assert isinstance(target.model.lm_head, q4.Int8Linear if kernel in q4.OURS else packed.PackedLinear)
    assert not any(type(m) is torch.nn.Linear for m in mods)
    rng = np.random.default_rng(3)
    accepted, equal, runs = 0, 0, 0
    for trial in range(4):
        prompt = rng.integers(2, V, int(rng.integers(2, 16)))
        ref = hf_greedy(target.model, prompt, 24)
        for drafter in (RandomDrafter(V, seed=trial), LookupDrafter(branches=3, max_ngram=2)):
            res = Engine(target, drafter, budget=int(rng.integers(2, 16))).generate(prompt, 24)
            gap = first_parting(target.model, prompt, res.token_ids, ref)
            check_parting(kernel, gap, (drafter.name, trial))
            accepted += sum(res.stats.accepted)
            equal, runs = equal + (gap is None), runs + 1
    assert accepted > 0 and equal >= runs // 2
    code, out, err = run_cli(capsys, "--target", path, "--dtype", "q4", "--method", "lookup", "--raw",
                             "--prompt", "abcabcabc", "--max-new-tokens", "12", "--compare", "ar", "--json")
    assert code == 0, err
    identical = json.loads(out)["identical_to_ar"]
    assert identical is True if kernel in q4.OURS else isinstance(identical, bool)


def test_compiled_q4_target_matches_its_greedy(tmp_path, kernel):
    from specblock.compiled.target import StaticTarget

    path = save_tiny_q4(tmp_path / "t", layers=2)
    model = TargetModel.load(path, "q4", "cpu").model
    target = StaticTarget(model, compile=True, buckets=(1, 8), saved=False)
    assert (target.dtype_name, target.compiled) == ("q4", True)  # serving.json's overrides key on these
    rng = np.random.default_rng(6)
    prompt = rng.integers(2, V, 10)
    ref = hf_greedy(model, prompt, 16)
    for drafter in (RandomDrafter(V, seed=0), LookupDrafter(branches=2, max_ngram=2)):
        gap = first_parting(model, prompt, Engine(target, drafter, budget=7).generate(prompt, 16).token_ids, ref)
        check_parting(kernel, gap, drafter.name)


@needs_ours
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("kernel", [k for k in KERNELS if k in q4.OURS])
def test_q4_gives_a_token_the_same_logits_in_any_tree(tmp_path, kernel, compiled, monkeypatch):
    """Our kernels and the fused attention (``runtime/tree_attention.py``), eager and compiled: a
    chain's logits are the same bits alone, in a larger tree (other slots; compiled, another
    bucket's graph) and one token at a time, so verification is lossless without relying on margins,
    on the int8 kernel too. (With SDPA or the matmul attention they differ in their last bits, which
    int8 rounding can turn into another token: ``experiments/results/q4_partings_int8.md``.)"""
    from specblock.compiled.target import StaticTarget
    from specblock.policies.tree import DraftTree
    from specblock.runtime import tree_attention

    if not tree_attention.load():
        pytest.skip("the fused attention op needs AVX512F/DQ")
    monkeypatch.setattr(q4, "default_kernel", lambda: kernel)
    path = save_tiny_q4(tmp_path / "t", layers=2)
    target = TargetModel.load(path, "q4", "cpu")
    if compiled:
        target = StaticTarget(target.model, compile=True, buckets=(1, 4, 8), saved=False)
    assert target.model.config._attn_implementation == ("specblock_fused_gqa" if compiled else "specblock_sdpa_rows")
    prompt = np.random.default_rng(2).integers(2, V, 12)
    chain = np.array([5, 9, 17, 3])
    outs = []
    for tokens, parents, pick in ((chain, [-1, 0, 1, 2], [0, 1, 2, 3]),
                                  (np.array([5, 30, 9, 31, 17, 3]), [-1, 0, 0, 2, 2, 4], [0, 2, 4, 5]),
                                  (chain[:1], [-1], [0])):
        target.reset()
        target.prefill(prompt)
        outs.append(target.tree_forward(DraftTree.from_parents(tokens, np.array(parents))).logits[pick])
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0][:1], outs[2])


def test_refusals_are_one_line(tmp_path):
    path = save_tiny(tmp_path / "plain", "llama", vocab=V, hidden=64)
    with pytest.raises(SpecBlockError, match=f"no {Q4_FILE}.*packed-fp16") as e:
        TargetModel.load(path, "q4", "cpu")
    assert "\n" not in str(e.value)
    save_q4(path / Q4_FILE, {"model.layers.9.mlp.up_proj": quantize_q4_1(torch.randn(128, 64))})
    with pytest.raises(SpecBlockError, match="no linear of this model"):
        TargetModel.load(path, "q4", "cpu")
    save_q4(path / Q4_FILE, {"model.layers.0.mlp.up_proj": quantize_q4_1(torch.randn(64, 64))})
    with pytest.raises(SpecBlockError, match="do not fit"):
        TargetModel.load(path, "q4", "cpu")
    with pytest.raises(SpecBlockError, match="does not fit the int4 kernels"):
        q4.Int4Linear(torch.nn.Linear(64, 24, bias=False), *quantize_q4_1(torch.randn(24, 64)))
    if not torch.cuda.is_available():
        with pytest.raises(SpecBlockError, match="no CUDA device"):
            TargetModel.load(path, "q4", "cuda")


def test_the_default_kernel_is_the_lossless_one_that_runs_and_the_variable_picks_another(monkeypatch):
    monkeypatch.delenv("SPECBLOCK_Q4_KERNEL", raising=False)
    assert q4.default_kernel() == ("int8" if VNNI else "fp32" if OURS else "bf16")
    for k in KERNELS:
        monkeypatch.setenv("SPECBLOCK_Q4_KERNEL", k)
        assert q4.default_kernel() == k
    monkeypatch.setenv("SPECBLOCK_Q4_KERNEL", "int4")
    with pytest.raises(SpecBlockError, match="no q4 kernel; choose one of int8, fp32, bf16"):
        q4.default_kernel()


@needs_vnni
def test_int8_linears_round_a_copy_and_multiply_by_it():
    """``use_int8_linears``: each bias-free linear that fits runs on its own Q8_0 rounding; biased
    or misfit ones stay (for packing), and a weight shared with someone else is left as it was."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 48, bias=False), torch.nn.Linear(48, 32, bias=True),
                              torch.nn.Linear(40, 16, bias=False)).requires_grad_(False)
    shared = net[0].weight
    before = shared.clone()
    assert q4.use_int8_linears(net) == 1
    assert isinstance(net[0], q4.Int8Linear) and net[0].kernel == "int8"
    assert type(net[1]) is torch.nn.Linear and type(net[2]) is torch.nn.Linear
    assert torch.equal(shared, before) and net[0].weight.data_ptr() != shared.data_ptr()
    q, d = quantize_q8_0(before)
    assert torch.equal(net[0].weight, dequantize_q8_0(q, d))
    x = torch.randn(5, 64)
    assert torch.equal(net[0](x), q4_kernel.linear8(x, q4_kernel.layout8_q8(q, d)))
    four = torch.nn.Sequential(torch.nn.Linear(64, 48, bias=False)).requires_grad_(False)  # bits=4: Q4_1, half the bytes
    w = four[0].weight.clone()
    assert q4.use_int8_linears(four, bits=4) == 1 and isinstance(four[0], q4.Int4Linear) and four[0].kernel == "int8"
    assert torch.equal(four[0](x), q4_kernel.linear8(x, q4_kernel.layout8(*quantize_q4_1(w))))
    with pytest.raises(SpecBlockError, match="4 or 8 bits"):
        q4.use_int8_linears(four, bits=2)


@needs_vnni
def test_drafters_beside_a_packed_target_run_int8_and_stay_lossless(tmp_path, monkeypatch):
    """``drafters.build`` puts a drafter's linears on the int8 kernel beside an eager packed target
    (q4 on either of our kernels, packed-fp16) where the CPU runs it, and packs them fp16 when asked
    (``int8=False``, the bench's ``drafter_int8=false``); the drafts move, the output is the target's.
    Beside a compiled target the default is int8 only where the target runs on our q4 kernels (their
    library is the int8 kernel's)."""
    from specblock.runtime import drafters
    from specblock.runtime.drafters.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Net
    from tiny import perturb

    path = save_tiny_q4(tmp_path / "t", layers=3)
    for kernel, dtype, int8 in (("fp32", "q4", None), ("int8", "q4", None), ("int8", "packed-fp16", None),
                                ("int8", "packed-fp16", False)):
        monkeypatch.setattr(q4, "default_kernel", lambda: kernel)
        target = TargetModel.load(path, dtype, "cpu")
        assert drafters.int8_drafters(target) and drafters.wants_int8(target)
        target.compiled = True  # beside a compiled target: int8 only where the target runs our q4 kernels itself
        assert drafters.wants_int8(target) == (dtype == "q4")
        target.compiled = False
        torch.manual_seed(1)
        net = Eagle3Net(Eagle3Config(vocab_size=V, hidden_size=64, num_heads=4, intermediate_size=128,
                                     tap_layers=target.tap_layers, top_k=4))
        net.tie_to_target(target.model)
        perturb(net, 0.3)
        drafter = Eagle3Drafter(net.eval())
        monkeypatch.setitem(drafters.METHODS, "eagle3", lambda t, opt: drafter)
        assert drafters.build("eagle3", target, {}, int8=int8) is drafter
        mods = list(net.modules())
        assert not any(type(m) is torch.nn.Linear for m in mods)
        assert any(isinstance(m, q4.Int8Linear) for m in mods) == (int8 is None)
        assert any(isinstance(m, packed.PackedLinear) for m in mods) == (int8 is False)
        rng = np.random.default_rng(4)
        accepted = 0
        for trial in range(3):
            prompt = rng.integers(2, V, int(rng.integers(2, 12)))
            res = Engine(target, drafter, budget=6).generate(prompt, 20)
            if dtype == "q4":
                check_parting(kernel, first_parting(target.model, prompt, res.token_ids,
                                                    hf_greedy(target.model, prompt, 20)), trial)
            else:  # packed-fp16: the same tokens as its own plain decoding
                assert res.token_ids == Engine(target, drafters.ARDrafter(), budget=0).generate(prompt, 20).token_ids
            accepted += sum(res.stats.accepted)
        assert accepted > 0


@needs_vnni
def test_drafters_beside_a_bf16_target_load_fp32_and_run_int8(tmp_path, monkeypatch):
    """Beside a bf16 CPU target ``drafters.build`` loads a trained drafter in fp32 and puts its
    linears on the int8 kernel (the kernel takes fp32 activations); the target's own drafter dtype
    comes back after the load (a bench's methods share the target). ``int8=False`` (the bench's
    ``drafter_int8=false``) keeps the drafter in the target's drafter dtype with plain linears."""
    from specblock.runtime import drafters
    from specblock.runtime.drafters.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Net
    from tiny import perturb

    target = TargetModel.load(save_tiny_q4(tmp_path / "t", layers=3), "bfloat16", "cpu")
    assert target.dtype == torch.bfloat16 and drafters.beside_bf16(target) and drafters.wants_int8(target)
    own = target.drafter_dtype

    def fresh_net() -> Eagle3Net:
        torch.manual_seed(1)
        net = Eagle3Net(Eagle3Config(vocab_size=V, hidden_size=64, num_heads=4, intermediate_size=128,
                                     tap_layers=target.tap_layers, top_k=4))
        net.tie_to_target(target.model)
        perturb(net, 0.3)
        return net

    monkeypatch.setitem(drafters.METHODS, "eagle3", lambda t, opt: Eagle3Drafter(fresh_net().to(dtype=t.drafter_dtype).eval()))
    accepted = {}
    for int8 in (None, False):
        drafter = drafters.build("eagle3", target, {}, int8=int8)
        assert target.drafter_dtype == own
        mods = list(drafter.net.modules())
        assert any(isinstance(m, q4.Int8Linear) for m in mods) == (int8 is None)
        assert drafter.dtype == (torch.float32 if int8 is None else own)
        if int8 is False:
            assert any(type(m) is torch.nn.Linear for m in mods)
        res = Engine(target, drafter, budget=6).generate(np.arange(2, 12), 16)
        assert len(res.token_ids) == 16
        accepted[int8] = sum(res.stats.accepted)
    assert accepted[None] > 0 and accepted[False] > 0  # both drafters' drafts are taken: the int8 one drafts too
    # a drafter that arrives in bf16 (built elsewhere) is left as it is: its linears need fp32
    bf = Eagle3Drafter(fresh_net().to(dtype=torch.bfloat16).eval())
    assert drafters.pack_for(bf, target) == 0
    assert drafters.pack_for(LookupDrafter(), target) == 0


def test_no_int8_drafters_where_the_kernel_cannot_run(tmp_path, monkeypatch):
    """Without AVX512-VNNI a drafter beside a packed target is packed fp16; beside a target that is
    not packed it keeps its plain linears; a drafter with no network has nothing to move."""
    from specblock.runtime import drafters
    from specblock.runtime.drafters.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Net

    path = save_tiny_q4(tmp_path / "t", layers=2)
    monkeypatch.setattr(q4_kernel, "vnni_supports", lambda: False)
    for dtype, kind in (("packed-fp16", packed.PackedLinear), ("float32", torch.nn.Linear)):
        target = TargetModel.load(path, dtype, "cpu")
        assert not drafters.int8_drafters(target)
        net = Eagle3Net(Eagle3Config(vocab_size=V, hidden_size=64, num_heads=4, intermediate_size=128,
                                     tap_layers=target.tap_layers, top_k=4))
        net.tie_to_target(target.model)
        drafters.pack_for(Eagle3Drafter(net.eval()), target)
        linears = [m for m in net.modules() if isinstance(m, (torch.nn.Linear, packed.PackedLinear, q4.Int8Linear))]
        assert linears and all(type(m) is kind for m in linears), dtype
        assert drafters.pack_for(LookupDrafter(), target) == 0


def test_the_int8_library_starts_building_only_where_drafters_will_use_it(monkeypatch):
    """``start_int8_build`` (``Session.open``, before the target loads): an eager packed-fp16 or a q4
    target, or an eager bf16 one, on a CPU with VNNI; not a compiled packed-fp16 or bf16 one (``wants_int8``), nor
    fp32, nor without VNNI."""
    from specblock.runtime import drafters

    started = []
    monkeypatch.setattr(q4_kernel, "start_building", lambda: started.append(True))
    for vnni, dtype, compiled, want in ((True, "packed-fp16", False, True), (True, "q4", True, True),
                                        (True, "packed-fp16", True, False), (True, "bfloat16", False, True),
                                        (True, "bfloat16", True, False), (True, "float32", False, False),
                                        (False, "packed-fp16", False, False)):
        monkeypatch.setattr(q4_kernel, "vnni_supports", lambda: vnni)
        started.clear()
        drafters.start_int8_build(dtype, "cpu", compiled)
        assert bool(started) == want, (vnni, dtype, compiled)


def test_bench_refuses_drafter_int8_where_there_are_no_drafter_linears(tmp_path, capsys):
    from specblock.runtime.bench_config import method_options
    from specblock.runtime.cli import main

    flags = ["bench", "--target", "lab", "--domains", "code", "--prompts", "1", "--runs", "1", "--out", str(tmp_path / "b")]
    for m in ("lookup", "ar@x", "hf-greedy"):
        assert main(flags + ["--methods", m, "--set", f"{m}:drafter_int8=false"]) == 2
        err = capsys.readouterr().err.strip()
        assert "only a trained drafter" in err and "\n" not in err
    assert not (tmp_path / "b.json").exists()
    ok = ["specblock+adapt+lookup@p", "eagle3@p"]
    assert all(o["drafter_int8"] is False for o in method_options([f"{m}:drafter_int8=false" for m in ok], ok).values())
