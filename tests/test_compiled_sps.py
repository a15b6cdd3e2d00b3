"""SpS's draft model behind a ``StaticTarget`` (``compiled/sps.py``): the eager drafter's chains,
whatever the padding and the stale drafted slots, lossless compiled; trees stay eager."""

import numpy as np
import pytest

from specblock.compiled import compile_drafter
from specblock.compiled.sps import StaticSpsDrafter
from specblock.compiled.target import StaticTarget
from specblock.runtime.drafters.sps import SpsDrafter
from test_baseline_sps import make
from test_compiled_drafter import decode
from tiny import hf_greedy


@pytest.mark.parametrize("compile", [False, True])
def test_static_draft_model_proposes_the_eager_chains(compile):
    """Chain for chain the eager drafter's proposals (gamma 4, prompts of 12, 1 and 5 tokens in one
    drafter), decoding equal to HF's greedy output; compiled, on the compiled target too."""
    model, target, net = make(seed=1, copy=False)
    draft = net.model.eval()
    static = StaticSpsDrafter(SpsDrafter(draft, gamma=4), compile=compile)
    served = StaticTarget.wrap(target, compile=True) if compile else target
    rng = np.random.default_rng(2)
    for length in (12, 1, 5):
        prompt = rng.integers(2, 16, length)
        a, trees_a = decode(target, SpsDrafter(draft, gamma=4), prompt, budget=4)
        b, trees_b = decode(served, static, prompt, budget=4)
        assert a.token_ids == b.token_ids == hf_greedy(model, prompt, 30)
        assert len(trees_a) == len(trees_b) and max(len(t[0]) for t in trees_b) > 2
        for (ta, pa), (tb, pb) in zip(trees_a, trees_b):
            np.testing.assert_array_equal(ta, tb)
            np.testing.assert_array_equal(pa, pb)


def test_trees_stay_eager():
    model, target, net = make(seed=1)
    tree_drafter = SpsDrafter(net.model.eval(), gamma=3, top_k=3)
    assert compile_drafter(tree_drafter, target) is tree_drafter
    with pytest.raises(ValueError, match="chains"):
        StaticSpsDrafter(tree_drafter, compile=False)
    assert isinstance(compile_drafter(SpsDrafter(net.model.eval(), gamma=3), target), StaticSpsDrafter)


def test_warm_compiles_the_draft_models_buckets(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model, target, net = make(seed=1)
    drafter = StaticSpsDrafter(SpsDrafter(net.model.eval(), gamma=3), compile=True)
    assert drafter.warm() == [1, 2, 4] and drafter.static.past_len == 0
