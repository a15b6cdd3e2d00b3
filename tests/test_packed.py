"""``--dtype packed-fp16``: fp16 weights packed for fbgemm, fp32 arithmetic; lossless like fp32."""

import copy
import gc
import json

import numpy as np
import pytest
import torch

from specblock.errors import SpecBlockError
from specblock.runtime import packed
from specblock.runtime.drafters import LookupDrafter, RandomDrafter, pack_drafter
from specblock.runtime.drafters.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Net
from specblock.runtime.engine import Engine
from specblock.runtime.target import TargetModel
from tiny import FAMILIES, hf_greedy, perturb, run_cli, save_tiny, tiny_model

pytestmark = pytest.mark.skipif(not packed.available(), reason="torch without fbgemm (not an x86 build)")
V = 12


def packed_model(family: str = "llama", seed: int = 0, **kw):
    model = tiny_model(family, vocab=V, seed=seed, **kw)
    assert packed.pack_linears(model) == 7 * model.config.num_hidden_layers + 1  # q k v o gate up down + head
    return model


def test_packed_linear_is_fp32_arithmetic_on_fp16_weights():
    torch.manual_seed(0)
    lin = torch.nn.Linear(40, 24)
    x = torch.randn(5, 3, 40)
    want = torch.nn.functional.linear(x, lin.weight.half().float(), lin.bias)  # fbgemm keeps the bias in fp32
    got = packed.PackedLinear(lin)(x)
    assert got.dtype == torch.float32 and got.shape == (5, 3, 24)
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(got, lin(x), atol=1e-6)  # the weights really are rounded to fp16
    # the op a compiled graph calls finds the weights by key; a copy keeps working once the original is gone
    original = packed.PackedLinear(lin)
    twin = copy.deepcopy(original)
    assert twin._key != original._key
    del original
    gc.collect()
    assert torch.equal(packed.packed_linear(x, twin._key, 24), got)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_drafter_equals_the_packed_models_own_greedy(family):
    model = packed_model(family, layers=3)
    target = TargetModel(model)
    assert target.dtype == torch.float32 and target.drafter_dtype == torch.float32
    assert (target.dtype_name, target.compiled) == ("packed-fp16", False)
    torch.manual_seed(1)  # EAGLE-3 reads the target's head rows and embeddings through .weight
    net = Eagle3Net(Eagle3Config(vocab_size=V, hidden_size=32, num_heads=4, intermediate_size=64,
                                 tap_layers=target.tap_layers, top_k=4))
    net.tie_to_target(model)
    perturb(net, 0.3)
    packed_net = copy.deepcopy(net).eval()
    assert pack_drafter(Eagle3Drafter(packed_net)) > 0 and target.packed  # what drafters.build does beside it
    rng = np.random.default_rng(3)
    accepted = 0
    for trial in range(3):
        prompt = rng.integers(2, V, int(rng.integers(2, 16)))
        ref = hf_greedy(model, prompt, 24)
        for drafter in (RandomDrafter(V, seed=trial), LookupDrafter(branches=3, max_ngram=2), Eagle3Drafter(net.eval()),
                        Eagle3Drafter(packed_net)):
            res = Engine(target, drafter, budget=int(rng.integers(2, 16))).generate(prompt, 24)
            assert res.token_ids == ref, (family, drafter.name, trial)
            accepted += sum(res.stats.accepted)
    assert accepted > 0


def test_load_cli_and_bench_run_packed(tmp_path, capsys):
    path = save_tiny(tmp_path / "t", "llama", vocab=96, ctx=2048)
    target = TargetModel.load(path, "packed-fp16", "cpu")
    assert isinstance(target.model.lm_head, packed.PackedLinear) and target.model.lm_head.weight.dtype == torch.float32
    assert not any(type(m) is torch.nn.Linear for m in target.model.modules())
    code, out, err = run_cli(capsys, "--target", path, "--dtype", "packed-fp16", "--method", "lookup", "--raw",
                             "--prompt", "abcabcabc", "--max-new-tokens", "12", "--compare", "ar", "--json")
    assert code == 0, err
    assert json.loads(out)["identical_to_ar"] is True
    res = tmp_path / "bench"
    code, _, err = run_cli(capsys, "bench", "--target", path, "--dtype", "packed-fp16", "--methods", "lookup,hf-lookup",
                           "--domains", "code", "--prompts", "1", "--max-new-tokens", "4", "--runs", "1", "--out", res)
    assert code == 0, err
    rows = json.loads(res.with_suffix(".json").read_text())
    assert rows["config"]["dtype"] == "packed-fp16"
    assert {r["method"] for r in rows["rows"]} >= {"lookup", "hf-lookup"}  # HF's generate runs the packed model too


def test_refusals_are_one_line(tmp_path):
    with pytest.raises(SpecBlockError, match="fp32 model") as e:
        packed.pack_linears(tiny_model("llama", vocab=V).to(torch.bfloat16))
    assert "\n" not in str(e.value)
    if not torch.cuda.is_available():
        with pytest.raises(SpecBlockError, match="no CUDA device"):
            TargetModel.load(save_tiny(tmp_path / "t", "llama", vocab=V), "packed-fp16", "cuda")


def test_compiled_packed_target_is_one_graph_and_lossless():
    """``--compile`` on packed-fp16: the packed GEMM sits behind an op dynamo traces
    (``packed.packed_linear``), so the forward is one graph, not one per linear, and greedy output is
    the packed model's own. Regional compilation refuses packed linears in one line."""
    import torch._dynamo as dynamo

    from specblock.compiled.target import StaticTarget

    model = packed_model("llama", seed=5, layers=3)
    ids = torch.arange(2, 10)[None]
    with torch.no_grad():
        explained = dynamo.explain(lambda i: model(i).logits)(ids)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    with pytest.raises(SpecBlockError, match="compile-mode whole"):
        StaticTarget(model, compile=False, regions=True)
    target = StaticTarget(model, compile=True, buckets=(1, 8))
    assert target.native and target.fused  # the C++ kernel and q/k/v, gate/up fusion (test_native.py)
    rng = np.random.default_rng(6)
    prompt = rng.integers(2, V, 10)
    ref = hf_greedy(model, prompt, 20)
    for drafter in (RandomDrafter(V, seed=0), LookupDrafter(branches=2, max_ngram=2)):
        assert Engine(target, drafter, budget=7).generate(prompt, 20).token_ids == ref, drafter.name


def test_packing_in_threads_keeps_each_weight_and_a_fixed_key_order():
    """``pack_linears`` packs on torch's threads: each module must still get its own weight, and
    keys must come in the same order every time (saved compiled graphs guard on them)."""
    offsets = []
    for _ in range(2):
        model = packed_model("llama", seed=7, layers=3)
        mods = [m for m in model.modules() if isinstance(m, packed.PackedLinear)]
        keys = [m._key for m in mods]
        assert len(mods) == 3 * 7 + 1 and sorted(keys) == list(range(min(keys), min(keys) + len(keys)))
        offsets.append([k - min(keys) for k in keys])
    assert offsets[0] == offsets[1]
    for m in mods:
        x_in = torch.randn(3, m.in_features)
        assert torch.equal(m(x_in), torch.ops.quantized.linear_dynamic_fp16(x_in, packed.prepack(m)))
