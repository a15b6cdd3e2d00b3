"""Greedy speculative decoding equals HF generate(do_sample=False), token for token, for any drafter."""

import numpy as np
import pytest

from specblock.runtime.drafters import ARDrafter, LookupDrafter, RandomDrafter
from specblock.runtime.engine import Engine
from specblock.runtime.target import TargetModel
from tiny import FAMILIES, tiny_model, hf_greedy

VOCAB = 12  # tiny, so random drafts often match and long accepted paths occur



@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_greedy_equals_hf_generate(family, attn):
    model = tiny_model(family, vocab=VOCAB, attn=attn)
    target = TargetModel(model)
    rng = np.random.default_rng(hash(family) % 1000)
    accepted_any = 0
    for trial in range(4):
        prompt = rng.integers(2, VOCAB, int(rng.integers(1, 20)))
        ref = hf_greedy(model, prompt, 30)
        for drafter in (ARDrafter(), RandomDrafter(VOCAB, seed=trial), LookupDrafter(branches=3, max_ngram=2)):
            res = Engine(target, drafter, budget=int(rng.integers(1, 20))).generate(prompt, 30)
            assert res.token_ids == ref, (family, attn, drafter.name, trial)
            accepted_any += sum(res.stats.accepted)
    assert accepted_any > 0  # the drafts were really exercised


def test_random_trees_many_seeds_llama():
    model = tiny_model("llama", vocab=6, seed=3)
    target = TargetModel(model)
    rng = np.random.default_rng(7)
    for seed in range(12):
        prompt = rng.integers(2, 6, int(rng.integers(1, 12)))
        ref = hf_greedy(model, prompt, 24)
        res = Engine(target, RandomDrafter(6, seed=seed), budget=16).generate(prompt, 24)
        assert res.token_ids == ref


def test_stops_at_eos_and_context():
    model = tiny_model("llama", vocab=VOCAB, ctx=40)
    target = TargetModel(model)
    prompt = np.arange(2, 12)
    ref = hf_greedy(model, prompt, 60)  # HF stops at max_position too? we only compare prefixes
    res = Engine(target, LookupDrafter(branches=2), budget=10).generate(prompt, 100)
    assert res.stopped == "context" and len(prompt) + len(res.token_ids) == 40
    assert res.token_ids == ref[: len(res.token_ids)]
    eos = ref[5]
    res = Engine(target, RandomDrafter(VOCAB), budget=8, eos_ids=frozenset({eos})).generate(prompt, 50)
    assert res.stopped == "eos" and res.token_ids == ref[: ref.index(eos) + 1]
