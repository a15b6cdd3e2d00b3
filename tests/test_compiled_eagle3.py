"""EAGLE-3's step on static buffers (``compiled/eagle3.py``): the same trees as the eager
drafter, whatever the padding, the stale drafted slots and the spans, and lossless compiled."""

import numpy as np
import pytest
import torch

from specblock.compiled import compile_drafter
from specblock.compiled.drafter import ROWS
from specblock.compiled.eagle3 import StaticEagle3Drafter
from specblock.compiled.target import StaticTarget
from specblock.runtime.drafters.eagle3 import Eagle3Drafter
from specblock.runtime import tree_attention
from specblock.runtime.drafters.lookup_branch import LookupBranch
from test_baseline_eagle3 import make
from test_compiled_drafter import check_one_span, decode
from tiny import hf_greedy


@pytest.mark.parametrize("depth,top_k,budget", [(2, 2, 2), (5, 4, 12), (6, 3, 24)])
def test_static_step_proposes_the_eager_trees(depth, top_k, budget):
    """Padded frontiers, stale drafted slots and the span mask change nothing: tree for tree the
    eager drafter's proposals, for prompts of 20, 1 and 5 tokens in one drafter reused across them
    (the first flush after a long prompt runs unpadded), with noisy weights so trees branch."""
    model, target, net = make(seed=depth, noise=0.5)
    eager = Eagle3Drafter(net, depth=depth, top_k=top_k)
    static = StaticEagle3Drafter(Eagle3Drafter(net, depth=depth, top_k=top_k), target.max_context, compile=False)
    rng = np.random.default_rng(depth)
    for length in (20, 1, 5):
        prompt = rng.integers(2, 16, length)
        a, trees_a = decode(target, eager, prompt, budget=budget)
        b, trees_b = decode(target, static, prompt, budget=budget)
        assert a.token_ids == b.token_ids == hf_greedy(model, prompt, 30)
        assert len(trees_a) == len(trees_b) and max(len(t[0]) for t in trees_b) > 2
        for (ta, pa), (tb, pb) in zip(trees_a, trees_b):
            np.testing.assert_array_equal(ta, tb)
            np.testing.assert_array_equal(pa, pb)


def test_long_accepted_chains_flush_unpadded():
    """More than ROWS positions accepted at once (lookup's chain on a repeated text) make a flush
    of more rows than the padded step holds: it runs unpadded, in step with the eager drafter."""
    model, target, net = make(seed=4)
    prompt = np.tile(np.arange(2, 12), 4)
    eager = LookupBranch(Eagle3Drafter(net, depth=3, top_k=2), nodes=ROWS + 4)
    static = LookupBranch(StaticEagle3Drafter(Eagle3Drafter(net, depth=3, top_k=2), target.max_context, compile=False),
                          nodes=ROWS + 4)
    rows = []
    real = static.inner._flush_step
    static.inner._flush_step = lambda taps, *a: rows.append(taps.shape[0]) or real(taps, *a)
    a, trees_a = decode(target, eager, prompt, n=40, budget=20)
    b, trees_b = decode(target, static, prompt, n=40, budget=20)
    assert a.token_ids == b.token_ids == hf_greedy(model, prompt, 40)
    assert len(trees_a) == len(trees_b)
    for (ta, pa), (tb, pb) in zip(trees_a, trees_b):
        np.testing.assert_array_equal(ta, tb)
        np.testing.assert_array_equal(pa, pb)
    assert max(rows) > ROWS and set(rows) & {4, ROWS}  # both an unpadded and a padded flush ran


def test_compiled_step_is_lossless_on_the_compiled_target():
    """Compiled for real (inductor on CPU): decoding equals HF's greedy output, and each shape met
    compiled one graph (flush per span, depth per rows and span)."""
    model, target, net = make(seed=7, noise=0.5)
    static_target = StaticTarget.wrap(target, compile=True)
    drafter = compile_drafter(Eagle3Drafter(net, depth=3, top_k=2), static_target)
    assert isinstance(drafter, StaticEagle3Drafter) and drafter.compiled
    prompt = np.arange(2, 9)
    res, trees = decode(static_target, drafter, prompt, n=24, budget=4)
    assert res.token_ids == hf_greedy(model, prompt, 24)
    assert max(len(t[0]) for t in trees) > 2
    assert drafter.flush.shapes and drafter.depth_step.shapes  # both kinds of step ran compiled


def test_frontier_past_the_buffers_is_refused():
    """A seed policy that returns more than top_k frontier nodes would write past the drafted
    slots the buffers hold: refused with a message, not an out-of-bounds write."""
    from specblock.policies.seeds import SeedPolicy

    class Greedy(SeedPolicy):
        def select(self, tree, nodes, width):
            return nodes  # every new node, whatever the width

    from specblock.runtime.drafters.base import DraftRequest

    model, target, net = make(seed=2, noise=0.5)
    drafter = StaticEagle3Drafter(Eagle3Drafter(net, depth=3, top_k=2, seeds=Greedy()), target.max_context,
                                  compile=False)
    prompt = np.arange(2, 9)
    target.want_features = True
    drafter.prefill(prompt, target.prefill(prompt[:-1]))
    with pytest.raises(RuntimeError, match="frontier nodes"):
        drafter.propose(DraftRequest(tokens=prompt, budget=8, max_depth=8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (experiments/gpu_check.sh runs it where one is)")
def test_cuda_graph_steps_propose_the_eager_trees():
    """CUDA: the buffers on the device, flush and depth steps as CUDA graphs (mode='reduce-overhead')."""
    model, _, net = make(seed=7, noise=0.5)
    prompt = np.random.default_rng(0).integers(2, 16, 12)
    ref = hf_greedy(model, prompt, 24)  # on the CPU copy, before the move
    model, net = model.cuda(), net.cuda()
    target = StaticTarget(model, compile=True, buckets=(8,))
    static = compile_drafter(Eagle3Drafter(net, depth=3, top_k=2), target)
    _, trees_a = decode(StaticTarget(model, compile=False, buckets=(8,)), Eagle3Drafter(net, depth=3, top_k=2), prompt,
                        n=24, budget=4)
    b, trees_b = decode(target, static, prompt, n=24, budget=4)
    assert b.token_ids == ref
    assert [t[0].tolist() for t in trees_a] == [t[0].tolist() for t in trees_b]


def test_warm_compiles_the_steps_before_decoding_and_leaves_them_empty(monkeypatch, tmp_path):
    """``Session.warm_compiled`` calls a compiled drafter's ``warm``: every flush row bucket and
    every depth width compiled at the first span, the buffers left empty, and decoding afterwards
    compiles nothing more at that span and stays lossless."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model, target, net = make(seed=7, noise=0.5)
    static_target = StaticTarget.wrap(target, compile=True)
    drafter = compile_drafter(Eagle3Drafter(net, depth=3, top_k=2), static_target)
    shapes = drafter.warm()
    assert {s[:2] for s in shapes} == {("flush", 4), ("flush", 8), ("depth", 1), ("depth", 2)}
    assert drafter.cached == 0 and drafter._new is None
    graphs = counters["stats"]["unique_graphs"]
    static_target.want_features = True  # as Session.warm_compiled sets it for a drafter that reads taps
    static_target.warm(5)  # the budget's tree: root + 4 nodes, as Session.warm_compiled
    after_target = counters["stats"]["unique_graphs"]
    prompt = np.arange(2, 9)
    res, _ = decode(static_target, drafter, prompt, n=24, budget=4)
    assert res.token_ids == hf_greedy(model, prompt, 24)
    assert counters["stats"]["unique_graphs"] == after_target
    assert len(drafter.flush.shapes) + len(drafter.depth_step.shapes) == len(shapes)
    assert graphs <= after_target


@pytest.mark.skipif(not tree_attention.load(), reason="the fused attention op needs AVX512F/DQ and a compiler")
def test_one_span_serves_every_context_once_warmed(monkeypatch, tmp_path):
    """Where the drafter attends in the fused op, its compiled flush and depth steps attend over the
    whole buffer: a decode that grows past 256 slots after ``warm`` compiles no drafter graph, with
    the eager drafter's trees; with power-of-two spans (``one_span = False``) the same decode
    compiles the next span's steps mid-request (what a server paid before)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model, _, net = make(seed=7, noise=0.5)
    check_one_span(model, lambda: Eagle3Drafter(net, depth=3, top_k=2), budget=4)
