"""The static-shape target: padding, stale cache slots and compilation never change a result.

Most tests run the padded step eagerly (``compile=False``: the same code, no compile time on two
cores); one test compiles it for real, with two buckets only. Both compile modes are checked:
``regions=True`` (one layer step shared by all layers, eager embedding/norm/head) and
``regions=False`` (the whole forward).
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from specblock.runtime import tree_attention
from specblock.compiled.target import BUCKETS, StaticTarget, bucket_of, span_of
from specblock.policies.tree import DraftTree
from specblock.runtime.drafters import ARDrafter, LookupDrafter, RandomDrafter
from specblock.runtime.engine import Engine
from specblock.runtime.target import TargetModel
from specblock.runtime.verify import SamplingVerifier
from tiny import FAMILIES, hf_greedy, tiny_config, tiny_model

VOCAB = 12
MODEL = tiny_model("qwen3", vocab=32, seed=1)
EAGER = TargetModel(MODEL)
STATIC = StaticTarget(MODEL, compile=False)
STATICS = {True: StaticTarget(MODEL, compile=False, regions=True), False: STATIC}
REGIONS = pytest.mark.parametrize("regions", [True, False], ids=["regions", "whole"])


def random_tree(rng: np.random.Generator, n: int, root: int, vocab: int = 32) -> DraftTree:
    parent = np.concatenate([[-1], (rng.random(n - 1) * np.arange(1, n)).astype(np.int64)])
    tokens = rng.integers(0, vocab, n)
    tokens[0] = root
    return DraftTree.from_parents(tokens, parent)


def test_buckets_and_spans():
    assert [bucket_of(n) for n in (1, 2, 5, 7, 8, 9, 33, 64, 65, 130)] == [1, 2, 6, 8, 8, 12, 48, 64, 128, 192]
    assert bucket_of(5, (1, 4)) == 8 and BUCKETS == (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
    assert [span_of(n, 1088) for n in (1, 256, 257, 600, 1088)] == [256, 256, 512, 1024, 1088]


@REGIONS
@settings(max_examples=30, deadline=None)
@given(st.integers(1, 40), st.integers(1, 40), st.integers(0, 10**6))
def test_padded_tree_gives_the_unpadded_logits(regions, prompt_len, n_nodes, seed):
    """Real rows of a padded tree forward equal the eager, unpadded one; and the same after a
    commit, with stale tree slots (rejected nodes, padding) left in the static buffers."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 32, prompt_len)
    tree = random_tree(rng, n_nodes, int(prompt[-1]))
    path = tree.path_to(int(rng.integers(0, n_nodes)))
    nxt = random_tree(rng, int(rng.integers(1, 10)), int(rng.integers(0, 32)))
    outs = []
    for target in (EAGER, STATICS[regions]):
        target.prefill(prompt[:-1])
        first = target.tree_forward(tree).logits
        target.commit(path)
        outs.append((first, target.tree_forward(nxt).logits, target.past_len))
    (a1, a2, pa), (b1, b2, pb) = outs
    assert pa == pb == prompt_len - 1 + len(path)
    assert b1.shape == a1.shape and b2.shape == a2.shape
    torch.testing.assert_close(b1, a1, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b2, a2, atol=1e-5, rtol=1e-5)


@REGIONS
def test_garbage_in_padding_and_unused_slots_changes_nothing(regions):
    """Fill every slot past the committed context with noise, pad with other tokens: same logits."""
    STATIC = STATICS[regions]
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 32, 17)
    tree = random_tree(rng, 5, int(prompt[-1]))
    STATIC.prefill(prompt[:-1])
    clean = STATIC.tree_forward(tree).logits.clone()
    STATIC.commit(np.zeros(1, dtype=np.int64))
    STATIC.past_len = len(prompt) - 1  # back to the prompt: slots from here on are stale
    with torch.no_grad():
        for t in STATIC.static.keys + STATIC.static.values:
            t[:, :, STATIC.past_len :] = torch.randn_like(t[:, :, STATIC.past_len :]) * 100
    torch.testing.assert_close(STATIC.tree_forward(tree).logits, clean, atol=1e-5, rtol=1e-5)
    STATIC.commit(np.zeros(1, dtype=np.int64))
    STATIC.past_len = len(prompt) - 1
    more = DraftTree.from_parents(np.concatenate([tree.tokens, [7, 8, 9]]), np.concatenate([tree.parent, [0, 0, 1]]))
    logits = STATIC.tree_forward(more).logits[: tree.size]  # later leaves are no real row's ancestors
    torch.testing.assert_close(logits, clean, atol=1e-5, rtol=1e-5)


@REGIONS
@pytest.mark.parametrize("family", FAMILIES)
def test_static_path_is_lossless(family, regions):
    """ar / lookup / random on the padded static path equal HF generate, token for token (fp32)."""
    model = tiny_model(family, vocab=VOCAB)
    target = StaticTarget(model, compile=False, regions=regions)
    rng = np.random.default_rng(5)
    accepted = 0
    for trial in range(3):
        prompt = rng.integers(2, VOCAB, int(rng.integers(1, 20)))
        ref = hf_greedy(model, prompt, 30)
        for drafter in (ARDrafter(), RandomDrafter(VOCAB, seed=trial), LookupDrafter(branches=3, max_ngram=2)):
            res = Engine(target, drafter, budget=int(rng.integers(1, 40))).generate(prompt, 30)
            assert res.token_ids == ref, (family, drafter.name, trial)
            accepted += sum(res.stats.accepted)
    assert accepted > 0


@REGIONS
def test_context_limit_and_features_match_eager(regions):
    """At the context limit (padding must fit the buffer) and with hidden-state taps on (every
    hidden state, the embeddings and the final-norm one included)."""
    model = tiny_model("llama", vocab=VOCAB, ctx=40, layers=3)
    eager, static = TargetModel(model, (0, 1, 2, 3)), StaticTarget(model, (0, 1, 2, 3), compile=False, regions=regions)
    prompt = np.arange(2, 12)
    ref = Engine(eager, LookupDrafter(branches=2), budget=30).generate(prompt, 100)
    res = Engine(static, LookupDrafter(branches=2), budget=30).generate(prompt, 100)
    assert res.stopped == ref.stopped == "context" and res.token_ids == ref.token_ids
    rng = np.random.default_rng(1)
    tree = random_tree(rng, 11, int(prompt[-1]), VOCAB)
    outs = []
    for t in (eager, static):
        t.want_features = True
        pre = t.prefill(prompt[:-1])
        outs.append((pre, t.tree_forward(tree)))
        t.want_features = False
    for a, b in zip(*outs):
        for x, y in ((a.logits, b.logits), (a.top, b.top), (a.taps, b.taps)):
            torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-5)


@REGIONS
def test_growing_context_crosses_attention_spans(regions):
    """A decode whose context grows past a span (256 -> 512) stays equal to HF generate."""
    model = tiny_model("llama", vocab=VOCAB, ctx=1024, seed=6)
    target = StaticTarget(model, compile=False, regions=regions)
    prompt = np.random.default_rng(2).integers(2, VOCAB, 240)
    ref = hf_greedy(model, prompt, 40)
    spans = set()
    forward = target.tree_forward

    def spy(tree):
        spans.add(span_of(target.past_len + bucket_of(tree.size), target.capacity))
        return forward(tree)

    target.tree_forward = spy
    res = Engine(target, RandomDrafter(VOCAB, seed=3), budget=20).generate(prompt, 40)
    assert res.token_ids == ref
    assert spans == {256, 512}  # both spans really ran


def test_sampling_matches_eager_target():
    """Lossless sampling draws the same tokens on both targets (same seed, same logits)."""
    model = tiny_model("qwen2", vocab=VOCAB, seed=2)
    prompt = np.arange(2, 9)
    runs = [Engine(t, RandomDrafter(VOCAB, seed=1), SamplingVerifier(0.8, 1.0, 0), budget=12).generate(prompt, 24, seed=4)
            for t in (TargetModel(model), StaticTarget(model, compile=False))]
    assert runs[0].token_ids == runs[1].token_ids


def test_cli_hook_and_refusals():
    """``--compile`` reaches the static target only when asked; sliding windows are refused."""
    from transformers import AutoModelForCausalLM, MistralConfig

    from specblock.errors import SpecBlockError
    from specblock.runtime.cli import build_parser, maybe_compile

    assert build_parser().parse_args(["--compile"]).compile and not build_parser().parse_args([]).compile
    assert build_parser().parse_args([]).compile_mode == "whole"
    assert build_parser().parse_args(["--compile-mode", "regions"]).compile_mode == "regions"
    assert maybe_compile(EAGER, False) is EAGER
    wrapped = maybe_compile(EAGER, True)  # compiles lazily, on a bucket's first forward: nothing runs here
    assert isinstance(wrapped, StaticTarget) and wrapped.compiled and wrapped.model is MODEL and not wrapped.regions
    assert maybe_compile(EAGER, True, "regions").regions
    with pytest.raises(SpecBlockError, match="compile mode"):
        maybe_compile(EAGER, True, "layers")
    cfg = MistralConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, sliding_window=8)
    with pytest.raises(SpecBlockError, match="sliding-window"):
        StaticTarget(AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa"), compile=False)


def test_regions_refuse_a_model_forward_they_do_not_rebuild():
    """Regions call the layers, norm and head themselves: a model whose own forward does more (here
    it doubles the last hidden state) is refused at construction, and runs in the whole mode."""
    from specblock.errors import SpecBlockError

    model = tiny_model("llama", vocab=VOCAB, seed=7)
    inner, forward = model.model, model.model.forward

    def doubled(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.last_hidden_state = out.last_hidden_state * 2
        return out

    inner.forward = doubled
    with pytest.raises(SpecBlockError, match="compile-mode whole"):
        StaticTarget(model, compile=False, regions=True)
    assert not StaticTarget(model, compile=False).regions


@REGIONS
def test_compiled_path_is_lossless(regions, monkeypatch, tmp_path):
    """The real thing: compiled with inductor (two buckets to bound compile time on two cores).
    Regions: one graph per bucket however many layers (the layers share the compiled step); an
    empty cache, so that none of them is loaded from an earlier run's saved graphs."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model = tiny_model("llama", vocab=VOCAB, seed=4, layers=3)
    target = StaticTarget(model, compile=True, buckets=(1, 8), regions=regions)
    # whole forwards: a shape met before runs on dynamo's differentiating guards only; the features
    # step below is a new shape after those, so it must still go through every guard and compile
    assert target.skip_guards is (not regions)
    graphs = counters["stats"]["unique_graphs"]
    rng = np.random.default_rng(11)
    for trial in range(2):
        prompt = rng.integers(2, VOCAB, 12)
        ref = hf_greedy(model, prompt, 24)
        for drafter in (ARDrafter(), RandomDrafter(VOCAB, seed=trial), LookupDrafter(branches=2, max_ngram=2)):
            res = Engine(target, drafter, budget=7).generate(prompt, 24)
            assert res.token_ids == ref, (drafter.name, trial)
    if regions:
        # buckets 1 and 8, one span: the inputs, one layer step and the head each; not 3 layers x 2
        assert counters["stats"]["unique_graphs"] - graphs == 6
    eager = TargetModel(model)  # hidden-state taps (trained drafters read them) through the compiled graph
    tree = random_tree(rng, 6, int(prompt[-1]), VOCAB)
    outs = []
    for t in (eager, target):
        t.want_features = True
        t.prefill(prompt[:-1])
        outs.append(t.tree_forward(tree))
    for x, y in ((outs[0].logits, outs[1].logits), (outs[0].top, outs[1].top), (outs[0].taps, outs[1].taps)):
        torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (experiments/gpu_check.sh runs it where one is)")
@REGIONS
def test_cuda_graphs_path_is_lossless(regions):
    """CUDA: static buffers on the device, compiled with mode='reduce-overhead' (CUDA graphs)."""
    model = tiny_model("llama", vocab=VOCAB, seed=4).cuda()
    target = StaticTarget(model, compile=True, buckets=(1, 8, 16), regions=regions)
    assert target.mode == "reduce-overhead" and target.static.keys[0].is_cuda
    rng = np.random.default_rng(12)
    for trial in range(3):
        prompt = rng.integers(2, VOCAB, 12)
        out = model.generate(torch.tensor(prompt, device="cuda")[None], max_new_tokens=32, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        ref = out[0, len(prompt):].tolist()
        for drafter in (ARDrafter(), RandomDrafter(VOCAB, seed=trial), LookupDrafter(branches=3, max_ngram=2)):
            res = Engine(target, drafter, budget=15).generate(prompt, 32)
            assert res.token_ids == ref, (drafter.name, trial)


def test_features_step_is_one_graph_on_a_fresh_model():
    """Drafters that read the target's hidden states (SpecBlock, EAGLE-3, Medusa, ...) need the
    features step; on a model that never returned hidden states, transformers installs its capture
    hooks under a lock dynamo cannot enter, which split the compiled step into 4 graphs. The
    compiled target installs them eagerly first (nothing is compiled here: dynamo only traces)."""
    import torch._dynamo as dynamo

    n = 8
    args = (torch.zeros(n, dtype=torch.long), torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril(),
            torch.tensor(3), span_of(3 + n, 64), True, False)
    for compile, graphs in ((False, 4), (True, 1)):  # compile=False never installs them: the split shows
        target = StaticTarget(tiny_model("llama", vocab=32, seed=2, layers=2), compile=compile)
        explained = dynamo.explain(target._step)(*args)
        assert explained.graph_count == graphs, (compile, explained.break_reasons)


FUSED = tree_attention.load()


@pytest.mark.parametrize("kernel", ["math", "sdpa"] + (["fused"] if FUSED else []))
@pytest.mark.parametrize("rows", [1, 4, 8, 13])
def test_gqa_attention_equals_repeat_kv(rows, kernel, monkeypatch):
    """Every grouped attention of compiled CPU graphs gives HF's ``repeat_kv`` result on a tree mask
    (additive or boolean) over keys read in place from a longer cache, at one row and at several;
    outside a trace, and for the SDPA one past ``SDPA_MAX_ROWS`` rows, they are HF's own function.
    The fused op computes each row alone (the same result whatever the other rows)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from specblock.compiled.gqa import KERNELS, SDPA_MAX_ROWS
    from specblock.runtime.grouped_rows import sdpa_rows_forward

    forward = KERNELS[kernel][1]
    g = torch.Generator().manual_seed(rows)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 3, True
    q = torch.randn(1, 6, rows, 16, generator=g)
    k, v = torch.randn(2, 1, 2, 64, 16, generator=g)[:, :, :, :40]  # the static cache's first 40 slots
    visible = torch.rand(rows, 40, generator=g) > 0.4
    visible[:, 0] = True
    mask = torch.where(visible, 0.0, torch.finfo(torch.float32).min)[None, None]
    ref, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=16**-0.5)
    same, _ = forward(module, q, k, v, mask, scaling=16**-0.5)
    assert torch.equal(same, sdpa_rows_forward(module, q, k, v, mask, scaling=16**-0.5)[0])  # not tracing: the eager path
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    out, _ = forward(module, q, k, v, mask, scaling=16**-0.5)
    assert out.shape == ref.shape == (1, rows, 6, 16)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    if kernel == "sdpa" and rows > SDPA_MAX_ROWS:
        assert torch.equal(out, ref)  # traced: HF's repeat_kv path
    if kernel == "fused":
        assert torch.equal(out, tree_attention.tree_attention(q, k, v, mask, 16**-0.5))  # the op ran
        alone = torch.cat([forward(module, q[:, :, i:i + 1], k, v, mask[:, :, i:i + 1], scaling=16**-0.5)[0]
                           for i in range(rows)], 1)
        assert torch.equal(out, alone)
    if kernel in ("math", "fused"):  # the fused one hands these to the math kernel
        out, _ = forward(module, q, k, v, visible[None, None], scaling=16**-0.5)  # a boolean mask: True is visible
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
        half, _ = forward(module, q.bfloat16(), k.bfloat16(), v.bfloat16(), mask.bfloat16(), scaling=16**-0.5)
        assert half.dtype == torch.bfloat16
        torch.testing.assert_close(half.float(), ref, atol=2e-2, rtol=2e-2)
        if rows > 1:  # several rows without a mask: HF's causal flag, so HF's function
            eager, _ = sdpa_rows_forward(module, q, k, v, None, scaling=16**-0.5)
            assert torch.equal(forward(module, q, k, v, None, scaling=16**-0.5)[0], eager)


@pytest.mark.parametrize("kernel", ["math", "sdpa"] + (["fused"] if FUSED else []))
def test_gqa_attention_only_where_it_applies(kernel):
    """Switched on by compiled CPU targets of SDPA models with grouped heads, and it reaches the
    graph (math: matmuls and no SDPA call; sdpa: an SDPA call with ``enable_gqa`` up to its row
    limit); eager attention, ungrouped heads, the eager padded step and ``gqa=False`` keep the
    model's own setting."""
    import torch._dynamo as dynamo
    from transformers import AutoModelForCausalLM

    from specblock.compiled.gqa import KERNELS, SDPA_MAX_ROWS, use_gqa_attention

    assert not use_gqa_attention(tiny_model("llama", vocab=32, attn="eager"))
    cfg = tiny_config("llama", vocab=32)
    cfg.num_key_value_heads = cfg.num_attention_heads
    assert not use_gqa_attention(AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa"))
    with pytest.raises(ValueError, match="unknown grouped-attention kernel"):
        use_gqa_attention(tiny_model("llama", vocab=32), "flash")
    name = KERNELS[kernel][0]
    for kw, switched in (({"compile": False}, False), ({"compile": True, "gqa": False}, False), ({"compile": True}, True)):
        model = tiny_model("llama", vocab=32, seed=3)
        target = StaticTarget(model, gqa_kernel=kernel, **kw)
        assert target.gqa == switched and (model.config._attn_implementation == name) == switched, kw
    for n in (1, SDPA_MAX_ROWS, SDPA_MAX_ROWS + 1):
        args = (torch.zeros(n, dtype=torch.long), torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril(),
                torch.tensor(3), span_of(3 + n, 64), False, False)
        graph = dynamo.explain(target._step)(*args).graphs[0]
        sdpa = [nd for nd in graph.graph.nodes if nd.target is torch._C._nn.scaled_dot_product_attention]
        if kernel == "math":
            matmuls = [nd for nd in graph.graph.nodes if nd.target is torch.matmul]
            assert not sdpa and len(matmuls) == 4, n  # two layers, two matmuls each
        elif kernel == "fused":
            ops = [nd for nd in graph.graph.nodes if "tree_attention" in str(nd.target)]
            assert not sdpa and len(ops) == 2, n  # one op a layer
        else:
            assert len(sdpa) == 2 and all(bool(nd.kwargs.get("enable_gqa")) == (n <= SDPA_MAX_ROWS) for nd in sdpa), n


def test_compiled_artefacts_go_under_specblock_home(monkeypatch, tmp_path):
    """Importing inductor writes its /tmp default into TORCHINDUCTOR_CACHE_DIR; that value counts as
    unset (artefacts go under $SPECBLOCK_HOME), a directory the user chose is kept."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from specblock.compiled.precompile import use_disk_cache

    monkeypatch.setenv("SPECBLOCK_HOME", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    assert use_disk_cache() == tmp_path / "inductor" and (tmp_path / "inductor").is_dir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert use_disk_cache() == tmp_path / "mine"


def test_each_compiled_target_has_its_own_dynamo_cache():
    """Dynamo keeps compiled graphs per code object and walks their guards before each call: two
    targets compiling the same ``_step`` would each check the other's graphs first (``own_code``)."""
    a, b = (StaticTarget(tiny_model("llama", vocab=32, seed=s), compile=True, buckets=(1, 2)) for s in (2, 3))
    for t in (a, b):
        for n in (1, 2):
            t.prefill(np.array([1, 2, 3]))
            t.tree_forward(DraftTree.from_parents(np.ones(n, dtype=np.int64), np.arange(-1, n - 1)))
    fns = [fn._torchdynamo_orig_callable for t in (a, b) for fn in t.step_fns.values()]
    codes = [f.__func__.__code__ for f in fns]
    assert len(codes) == 4 and len({id(c) for c in codes}) == 4  # a code object per target and per shape
    assert all(c is not StaticTarget._step.__code__ for c in codes)
    assert all(f.__self__ is a for f in fns[:2])


def test_warm_compiles_every_bucket_a_budget_meets_before_decoding(monkeypatch, tmp_path):
    """What a server runs before it listens (``Session.warm_compiled``): the buckets up to the
    budget's tree compiled at the first span, so decoding afterwards compiles nothing; an eager
    target warms nothing."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model = tiny_model("llama", vocab=VOCAB, seed=6, layers=2)
    target = StaticTarget(model, compile=True, buckets=(1, 4, 8))
    assert target.warm(3) == [1, 4] and target.past_len == 0
    graphs = counters["stats"]["unique_graphs"]
    prompt = np.random.default_rng(2).integers(2, VOCAB, 10)
    res = Engine(target, RandomDrafter(VOCAB, seed=1), budget=3).generate(prompt, 16)
    assert res.token_ids == hf_greedy(model, prompt, 16)
    assert max(res.stats.tree_size) > 1 and counters["stats"]["unique_graphs"] == graphs
    assert StaticTarget(model, compile=False).warm(3) == []




def test_warm_with_sizes_pads_other_trees_up_to_a_warmed_bucket(monkeypatch, tmp_path):
    """A drafter that names its tree sizes (``Drafter.tree_sizes``: EAGLE-3, Medusa) gets only their
    buckets warmed; a tree of another size pads up to the next warmed bucket instead of compiling
    mid-request, with the same tokens."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model = tiny_model("llama", vocab=VOCAB, seed=6, layers=2)
    target = StaticTarget(model, compile=True, buckets=(1, 2, 4, 8))
    assert target.warm(3, (3,)) == [4] and target.warmed == (4,)
    assert [target.bucket(n) for n in (1, 3, 4, 5)] == [4, 4, 4, 8]
    graphs = counters["stats"]["unique_graphs"]
    prompt = np.random.default_rng(4).integers(2, VOCAB, 20)
    res = Engine(target, LookupDrafter(max_ngram=3, min_ngram=3), budget=3).generate(prompt, 24)  # trees of 1 and 4
    assert res.token_ids == hf_greedy(model, prompt, 24)
    assert {1, 4} <= set(res.stats.tree_size) and counters["stats"]["unique_graphs"] == graphs
    assert target.warm(1, (1,)) == [1] and target.warmed == (1, 4)  # engines on one target: the union

@pytest.mark.skipif(not tree_attention.load(), reason="the fused attention op needs AVX512F/DQ and a compiler")
def test_one_span_serves_every_context_once_warmed(monkeypatch, tmp_path):
    """Where every layer's attention is the fused op, compiled steps attend over the whole buffer:
    a decode that grows past 256 and 512 slots after ``warm`` compiles nothing more, and stays HF's
    greedy decoding; with ``one_span=False`` the same decode compiles its later spans."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model = tiny_model("llama", vocab=VOCAB, seed=6, layers=2, ctx=1024)
    prompt = np.random.default_rng(3).integers(2, VOCAB, 500)
    ref = hf_greedy(model, prompt, 30)
    for one_span in (True, False):
        target = StaticTarget(model, compile=True, buckets=(1, 4), one_span=one_span)
        assert target.one_span is one_span
        target.warm(3)
        graphs = counters["stats"]["unique_graphs"]
        res = Engine(target, RandomDrafter(VOCAB, seed=1), budget=3).generate(prompt, 30)
        assert res.token_ids == ref
        assert (counters["stats"]["unique_graphs"] == graphs) is one_span


def test_the_server_warms_every_tree_size_with_compile(tmp_path, monkeypatch):
    """``serve --compile``: the service warms the buckets of its budget before it listens (the
    target is compiled for real by the test above; here its static step runs eagerly)."""
    from specblock.runtime import cli
    from specblock.serve.cli import open_service, parse
    from tiny import save_tiny

    model_dir = save_tiny(tmp_path / "m", "llama", vocab=96, ctx=64)
    warmed = []
    monkeypatch.setattr(cli, "maybe_compile", lambda t, c, m="whole": StaticTarget.wrap(t, compile=False) if c else t)
    def fake_warm(self, n, sizes=None, then=None):  # ``then``: the drafter's steps, while helpers compile
        warmed.append(n)
        if then is not None:
            then()
        return []

    monkeypatch.setattr(StaticTarget, "warm", fake_warm)
    cfg, opts = parse(["--target", str(model_dir), "--dtype", "float32", "--method", "random", "--budget", "5",
                       "--compile", "--port", "0"])
    open_service(cfg, opts)
    assert warmed == [6]  # the budget's tree: root + 5 nodes
    cfg, opts = parse(["--target", str(model_dir), "--dtype", "float32", "--method", "ar", "--budget", "5",
                       "--compile", "--port", "0"])
    open_service(cfg, opts)
    assert warmed.pop() == 1  # plain decoding's trees are its root alone: one bucket, whatever the budget
    cfg, opts = parse(["--target", str(model_dir), "--dtype", "float32", "--method", "random", "--budget", "5",
                       "--compile", "--no-warmup", "--port", "0"])
    open_service(cfg, opts)
    assert warmed == [6]
    # A compiled drafter's steps are warmed too, under a lookup branch as well (compiled/drafter.py's warm)
    drafter_warmed = []

    def compiled_drafter(d, target):
        d.warm = lambda: drafter_warmed.append(type(d).__name__) or []
        return d

    monkeypatch.setattr(cli, "maybe_compile_drafter", compiled_drafter)
    cfg, opts = parse(["--target", str(model_dir), "--dtype", "float32", "--method", "random", "--budget", "5",
                       "--lookup-branch", "2", "--compile", "--port", "0"])
    open_service(cfg, opts)
    assert warmed == [6, 6] and len(drafter_warmed) == 1


def test_the_bench_warms_each_engine_before_timing(tmp_path, monkeypatch):
    """The bench's untimed warm-up compiles every shape an engine can meet (``Engine.warm_compiled``)
    so no timed run pays a first-use compile; an eager target warms nothing (the compiled target is
    compiled for real by the tests above; here its static step runs eagerly)."""
    from specblock.runtime import cli
    from specblock.runtime.engine import Engine

    monkeypatch.setattr(cli, "maybe_compile", lambda t, c, m="whole": StaticTarget.wrap(t, compile=False) if c else t)
    warmed = []
    real = Engine.warm_compiled
    monkeypatch.setattr(Engine, "warm_compiled", lambda self: warmed.append(type(self.target).__name__) or real(self))
    out = tmp_path / "b"
    assert cli.main(["bench", "--target", "lab", "--methods", "ar,lookup@c", "--set", "lookup@c:compiled=true",
                     "--domains", "code", "--prompts", "1", "--runs", "1", "--max-new-tokens", "8", "--out", str(out)]) == 0
    assert sorted(warmed) == ["StaticTarget", "TargetModel"]
