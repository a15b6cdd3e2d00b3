"""Properties of DraftTree, acceptance and the tree policies (hypothesis)."""

import numpy as np
import pytest
from hypothesis import given, strategies as st

from specblock.policies.acceptance import accept_longest, reachable
from specblock.policies.branching import (
    ChainBranching,
    DynamicBranching,
    RankBucketBranching,
    TopKBranching,
    fit_budget,
    grow_block,
)
from specblock.policies.tree import DraftTree, rank_to_bucket


@st.composite
def trees(draw, max_nodes=40):
    n = draw(st.integers(1, max_nodes))
    fr = draw(st.lists(st.floats(0, 0.999), min_size=n - 1, max_size=n - 1))
    parent = np.array([-1] + [int(f * i) for i, f in enumerate(fr, start=1)], dtype=np.int64)
    tokens = np.array(draw(st.lists(st.integers(0, 9), min_size=n, max_size=n)))
    lp = -np.array(draw(st.lists(st.floats(0, 5), min_size=n, max_size=n)), dtype=np.float32)
    lp[0] = 0
    return DraftTree.from_parents(tokens, parent, logprob=lp)


def naive_ancestors(parent, i):
    out = {i}
    while parent[i] >= 0:
        i = int(parent[i])
        out.add(i)
    return out


@given(trees())
def test_mask_is_ancestor_closure_and_positions_are_depth(t):
    t.check()
    for i in range(t.size):
        assert set(np.nonzero(t.ancestor_mask[i])[0]) == naive_ancestors(t.parent, i)
        assert t.depth[i] == len(naive_ancestors(t.parent, i)) - 1
    assert (t.position_ids(7) == 7 + t.depth).all()


@given(trees())
def test_paths_walk_parent_links(t):
    for path in t.leaf_paths():
        assert path[0] == 0 and t.is_leaf[path[-1]]
        assert (t.parent[path[1:]] == path[:-1]).all()
        assert (t.depth[path] == np.arange(len(path))).all()


@given(trees(), st.data())
def test_accepted_path_is_longest_correct_chain(t, data):
    correct = np.array(data.draw(st.lists(st.booleans(), min_size=t.size, max_size=t.size)))
    acc = accept_longest(t, correct)
    correct[0] = True
    assert acc.path[0] == 0 and correct[acc.path].all()
    assert (t.parent[acc.path[1:]] == acc.path[:-1]).all()
    # No longer correct chain exists: check every node by brute force.
    for i in range(t.size):
        if all(correct[j] for j in naive_ancestors(t.parent, i)):
            assert t.depth[i] <= acc.accepted
    assert reachable(t, correct)[acc.path].all()


@given(trees(), st.integers(0, 40))
def test_subtree_and_prune_keep_structure(t, budget):
    pruned = DynamicBranching().prune(t, budget)
    pruned.check()
    assert pruned.size - 1 <= budget
    assert pruned.tokens[0] == t.tokens[0]


@given(trees(), st.data())
def test_subtree_remaps_logged_positions(t, data):
    """meta["positions"] follows its nodes through a cut: each row keeps its own node's token."""
    node = np.array(data.draw(st.lists(st.integers(0, t.size - 1), max_size=t.size, unique=True)), dtype=np.int64)
    t.meta["positions"] = {"node": node, "tok": t.tokens[node], "logp": np.zeros((node.size, 3))}
    keep = np.array(data.draw(st.lists(st.booleans(), min_size=t.size, max_size=t.size)))
    keep[0] = True
    keep = ~(t.ancestor_mask & ~keep[None, :]).any(axis=1)  # ancestor-closed
    cut, idx = t.subtree(keep)
    pos = cut.meta["positions"]
    assert pos["node"].size == keep[node].sum() == pos["logp"].shape[0]
    assert (cut.tokens[pos["node"]] == pos["tok"]).all() and (idx[pos["node"]] == node[keep[node]]).all()


@given(st.integers(1, 6), st.integers(1, 8), st.integers(0, 30), st.data())
def test_fit_budget_keeps_sorted_prefixes(p, k, budget, data):
    w = np.array(data.draw(st.lists(st.integers(0, k), min_size=p, max_size=p)))
    score = -np.array(data.draw(st.lists(st.floats(0, 5), min_size=p, max_size=p)))
    lp = -np.sort(np.array(data.draw(st.lists(st.floats(0, 5), min_size=p * k, max_size=p * k))).reshape(p, k), axis=1)
    out = fit_budget(w, score, lp, budget)
    assert (out <= w).all() and out.sum() <= max(budget, 0)
    assert out.sum() == min(w.sum(), max(budget, 0))


def test_rank_buckets_match_the_paper():
    assert rank_to_bucket(np.arange(12)).tolist() == [0, 1, 1, 1, 2, 2, 2, 2, 2, 2, 3, 3]


@given(st.integers(1, 3), st.integers(1, 5), st.integers(0, 30), st.integers(0, 10**6))
def test_grow_block_spine_and_budget(s, kdepth, budget, seed):
    rng = np.random.default_rng(seed)
    tree = DraftTree.root_only(0)
    ct = rng.integers(0, 50, (s, kdepth, 10))
    cl = -np.sort(rng.random((s, kdepth, 10)) * 5, axis=-1)
    buckets = rng.integers(0, 4, (s, kdepth))
    policy = RankBucketBranching((2, 4, 10, 0))
    spine = grow_block(tree, np.zeros(s, dtype=np.int64), ct, cl, buckets, policy, budget, block=0)
    tree.check()
    assert tree.size - 1 <= budget
    for si in range(s):
        for d in range(kdepth):
            node = spine[si, d]
            if node >= 0:  # the spine is the top-1 candidate chain under the seed
                assert tree.tokens[node] == ct[si, d, 0] and tree.depth[node] == d + 1
                assert policy.widths_by_bucket[buckets[si, d]] > 0


def test_policies_widths():
    lp = np.log(np.full((3, 4), 0.25))
    score = np.zeros(3)
    assert ChainBranching().widths(score, lp, None, 10).tolist() == [1, 1, 1]
    assert TopKBranching(k=3).widths(score, lp, None, 10).tolist() == [3, 3, 3]
    assert RankBucketBranching((2, 4, 10, 0)).widths(score, lp, np.array([0, 1, 3]), 10).tolist() == [2, 4, 0]
    assert TopKBranching(k=4).widths(score, lp, None, 5).sum() == 5


@given(trees(max_nodes=20), st.data())
def test_incremental_caches_equal_a_rebuild(t, data):
    t.ancestor_mask, t.cum_logprob, t.is_leaf  # computed, so extend must grow them
    k = data.draw(st.integers(1, 6))
    parents = np.array(data.draw(st.lists(st.integers(0, t.size - 1), min_size=k, max_size=k)))
    t.extend(parents, np.zeros(k, dtype=np.int64), logprob=-np.arange(k, dtype=np.float32))
    grown = (t.ancestor_mask.copy(), t.cum_logprob.copy(), t.is_leaf.copy())
    t._invalidate()
    assert (grown[0] == t.ancestor_mask).all() and (grown[2] == t.is_leaf).all()
    np.testing.assert_allclose(grown[1], t.cum_logprob, rtol=1e-5, atol=1e-4)  # float32 sums, other order


@given(st.integers(1, 3), st.integers(1, 5), st.integers(0, 40), st.integers(0, 10**6), st.booleans())
def test_grow_block_equals_the_depth_by_depth_form(s, kdepth, budget, seed, with_bucket):
    """The one-extend grow_block builds exactly the tree the per-depth loop builds (same nodes,
    same order, same spine and meta), for seeds deeper in a tree and any budget."""
    from specblock.policies.branching import _grow_block_stepwise

    rng = np.random.default_rng(seed)
    ct = rng.integers(0, 50, (s, kdepth, 10))
    cl = (-np.sort(rng.random((s, kdepth, 10)) * 5, axis=-1)).astype(np.float32)
    buckets = rng.integers(0, 4, (s, kdepth)) if with_bucket else None
    policy = RankBucketBranching((2, 4, 10, 0)) if with_bucket else TopKBranching(k=2)
    trees, spines = [], []
    for grow in (grow_block, _grow_block_stepwise):
        t = DraftTree.root_only(0)
        t.extend(np.array([0, 0, 1]), np.array([5, 6, 7]), logprob=np.array([-0.5, -1.0, -0.25], dtype=np.float32))
        seeds = np.array([3, 2, 0, 1][:s])
        spines.append(grow(t, seeds, ct, cl, buckets, policy, budget + 3, block=1))
        trees.append(t)
    a, b = trees
    for name in ("tokens", "parent", "depth", "logprob", "rank", "bucket", "block"):
        assert (getattr(a, name) == getattr(b, name)).all(), name
    assert (spines[0] == spines[1]).all()
    for key in ("block_nodes", "block_rows", "block_pos"):
        assert (a.meta[key] == b.meta[key]).all(), key
    np.testing.assert_array_equal(a.cum_logprob, b.cum_logprob)


def test_extend_takes_parents_from_its_own_batch():
    t = DraftTree.root_only(0)
    t.cum_logprob, t.is_leaf
    ids = t.extend(np.array([0, 1, 2, 1]), np.array([1, 2, 3, 4]), logprob=np.full(4, -1.0, dtype=np.float32))
    assert ids.tolist() == [1, 2, 3, 4] and t.depth.tolist() == [0, 1, 2, 3, 2]
    assert t.cum_logprob.tolist() == [0, -1, -2, -3, -2] and t.is_leaf.tolist() == [False, False, False, True, True]
    t.check()
    with pytest.raises(ValueError):
        t.extend(np.array([6]), np.array([1]))  # a parent after its child
    with pytest.raises(ValueError):
        t.extend(np.array([0, 5]), np.array([1, 2]), levels=[slice(0, 2)])  # wrong levels hint
