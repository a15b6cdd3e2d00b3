"""Medusa's heads as one static-shape graph (``compiled/medusa.py``): the eager drafter's trees,
and lossless compiled."""

import numpy as np
import pytest
import torch

from specblock.compiled import compile_drafter
from specblock.compiled.medusa import StaticMedusaDrafter
from specblock.compiled.target import StaticTarget
from specblock.runtime.drafters.medusa import MedusaDrafter
from test_baseline_medusa import make
from test_compiled_drafter import decode
from tiny import hf_greedy


@pytest.mark.parametrize("compile", [False, True])
def test_static_heads_propose_the_eager_trees(compile):
    """Packed on device and unpacked on the host, the heads' candidates build the eager drafter's
    trees, tree for tree; compiled, on the compiled target, decoding stays lossless."""
    model, target, net = make(seed=3, noise=0.5)
    static = StaticMedusaDrafter(MedusaDrafter(net), compile=compile)
    served = StaticTarget.wrap(target, compile=True) if compile else target
    rng = np.random.default_rng(1)
    for length in (12, 1, 5):
        prompt = rng.integers(2, 16, length)
        a, trees_a = decode(target, MedusaDrafter(net), prompt, budget=8)
        b, trees_b = decode(served, static, prompt, budget=8)
        assert a.token_ids == b.token_ids == hf_greedy(model, prompt, 30)
        assert len(trees_a) == len(trees_b) and max(len(t[0]) for t in trees_b) > 2
        for (ta, pa), (tb, pb) in zip(trees_a, trees_b):
            np.testing.assert_array_equal(ta, tb)
            np.testing.assert_array_equal(pa, pb)
    assert (static.heads is not None and static.heads.shapes == {(1, 32)}) == compile


def test_compile_drafter_builds_it_and_warm_compiles_its_graph(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model, target, net = make()
    drafter = compile_drafter(MedusaDrafter(net), target)
    assert isinstance(drafter, StaticMedusaDrafter) and drafter.compiled and not drafter.heads.shapes
    assert drafter.warm() == [(1, 32)] and drafter.heads.shapes == {(1, 32)}
    assert StaticMedusaDrafter(MedusaDrafter(net), compile=False).warm() == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (experiments/gpu_check.sh runs it where one is)")
def test_cuda_graph_heads_propose_the_eager_trees():
    model, target, net = make(seed=3, noise=0.5)
    prompt = np.random.default_rng(0).integers(2, 16, 12)
    ref = hf_greedy(model, prompt, 24)
    model, net = model.cuda(), net.cuda()
    served = StaticTarget(model, compile=True, buckets=(8,))
    static = compile_drafter(MedusaDrafter(net), served)
    _, trees_a = decode(StaticTarget(model, compile=False, buckets=(8,)), MedusaDrafter(net), prompt, n=24, budget=6)
    b, trees_b = decode(served, static, prompt, n=24, budget=6)
    assert b.token_ids == ref
    assert [t[0].tolist() for t in trees_a] == [t[0].tolist() for t in trees_b]
