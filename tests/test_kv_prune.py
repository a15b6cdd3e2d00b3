"""After any accepted path, the pruned cache gives the same next logits as a fresh forward."""

import numpy as np
import torch
from hypothesis import given, settings, strategies as st

from specblock.policies.tree import DraftTree
from specblock.runtime.target import TargetModel
from tiny import tiny_model

MODEL = tiny_model("qwen3", vocab=32, seed=1)
TARGET = TargetModel(MODEL)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 30), st.integers(1, 24), st.integers(0, 10**6))
def test_pruned_cache_matches_fresh_forward(prompt_len, n_nodes, seed):
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 32, prompt_len)
    parent = np.concatenate([[-1], (rng.random(n_nodes - 1) * np.arange(1, n_nodes)).astype(np.int64)])
    tokens = rng.integers(0, 32, n_nodes)
    tokens[0] = prompt[-1]
    tree = DraftTree.from_parents(tokens, parent)
    path = tree.path_to(int(rng.integers(0, n_nodes)))

    TARGET.prefill(prompt[:-1])
    TARGET.tree_forward(tree)
    TARGET.commit(path)
    committed = np.concatenate([prompt[:-1], tree.tokens[path]])
    assert TARGET.past_len == len(committed)
    nxt = int(rng.integers(0, 32))
    got = TARGET.tree_forward(DraftTree.root_only(nxt)).logits[-1]
    with torch.no_grad():
        ref = MODEL(torch.tensor(np.concatenate([committed, [nxt]]))[None]).logits[0, -1]
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_tree_logits_match_each_path_forward():
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 32, 9)
    tree = DraftTree.from_parents(rng.integers(0, 32, 10), np.array([-1, 0, 0, 1, 1, 2, 3, 3, 6, 5]))
    tree.tokens[0] = prompt[-1]
    TARGET.prefill(prompt[:-1])
    logits = TARGET.tree_forward(tree).logits
    for leaf in np.nonzero(tree.is_leaf)[0]:
        path = tree.path_to(int(leaf))
        with torch.no_grad():
            ref = MODEL(torch.tensor(np.concatenate([prompt[:-1], tree.tokens[path]]))[None]).logits[0, -len(path):]
        torch.testing.assert_close(logits[path], ref, atol=1e-5, rtol=1e-5)
