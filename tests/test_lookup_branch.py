"""Prompt lookup's chain grafted onto a drafter's tree (``METHOD+lookup``,
``runtime/drafters/lookup_branch.py``): the graft shares what the tree already has, the node
budget holds, and the output stays the target's greedy decoding."""

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from specblock.policies.tree import DraftTree
from specblock.runtime.cli import main
from specblock.runtime.drafters import RandomDrafter
from specblock.runtime.drafters.base import DraftRequest, Drafter
from specblock.runtime.drafters.lookup import LookupDrafter, find_continuations, first_match, trie_from_paths
from specblock.runtime.drafters.lookup_branch import LookupBranch, graft, has_lookup
from specblock.runtime.engine import Engine
from specblock.runtime.target import TargetModel
from tiny import hf_greedy, save_tiny, tiny_model

V = 32


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), min_size=1, max_size=40), depth=st.integers(0, 6),
       budget=st.integers(0, 6), max_ngram=st.integers(1, 4))
def test_one_chain_fast_path_equals_the_trie_of_the_first_continuation(tokens, depth, budget, max_ngram):
    """``first_match`` (the branch's and ``branches=1``'s path) is ``find_continuations``' first
    row without its padding, and lookup's one-chain tree is the trie built from that row."""
    seq = np.asarray(tokens, dtype=np.int64)
    want = np.zeros(0, dtype=np.int64)
    for n in range(max_ngram, 0, -1):
        cont = find_continuations(seq, n, depth, 1)
        if cont.shape[0]:
            want = cont[0][cont[0] >= 0]
            break
    np.testing.assert_array_equal(first_match(seq, max_ngram, 1, depth), want)
    tree = LookupDrafter(max_ngram=max_ngram, depth=depth).propose(DraftRequest(seq, budget, 8))
    ref = trie_from_paths(int(seq[-1]), want[None] if want.size else np.zeros((0, 0), np.int64), budget)
    np.testing.assert_array_equal(tree.tokens, ref.tokens)
    np.testing.assert_array_equal(tree.parent, ref.parent)


def test_graft_follows_the_tree_and_adds_only_what_differs():
    tree = DraftTree.from_parents(np.array([9, 1, 2, 3]), np.array([-1, 0, 1, 0]))  # 9 -> 1 -> 2, 9 -> 3
    assert graft(tree, np.array([1, 5, 6])) == 2  # shares node 1, then 5 -> 6 below it
    assert tree.tokens[4:].tolist() == [5, 6] and tree.parent[4:].tolist() == [1, 4]
    assert tree.depth[4:].tolist() == [2, 3]
    assert graft(tree, np.array([1, 2])) == 0  # already a path of the tree
    assert graft(tree, np.array([7])) == 1 and tree.parent[-1] == 0
    tree.check()


class Fixed(Drafter):
    """A drafter that always proposes the same chain (records the budgets it was given)."""

    name = "fixed"

    def __init__(self, chain):
        self.chain, self.budgets = np.asarray(chain), []

    def propose(self, req: DraftRequest) -> DraftTree:
        self.budgets.append(req.budget)
        n = min(req.budget, len(self.chain))
        return DraftTree.from_parents(np.concatenate([[req.tokens[-1]], self.chain[:n]]), np.arange(-1, n))


def test_the_budget_is_shared_and_never_exceeded():
    inner = Fixed([4, 4, 4, 4, 4])
    drafter = LookupBranch(inner, nodes=3)
    tokens = np.array([1, 2, 3, 1, 2, 3, 1, 2])  # lookup: 1 2 -> 3 1 2
    tree = drafter.propose(DraftRequest(tokens, budget=6, max_depth=10))
    assert inner.budgets == [3] and tree.size - 1 == 6
    assert tree.tokens[tree.path_to(tree.size - 1)].tolist() == [2, 3, 1, 2]  # lookup's branch
    tree = drafter.propose(DraftRequest(np.array([5, 6]), budget=6, max_depth=10))  # no match: all to the drafter
    assert inner.budgets[-1] == 6 and tree.size - 1 == 5


def test_on_top_the_drafter_keeps_its_budget_whatever_lookup_finds():
    """``on_top``: lookup's chain adds nodes where it has a guess and never takes the drafter's."""
    inner = Fixed([4, 4, 4, 4, 4])
    drafter = LookupBranch(inner, nodes=3, inner_budget=2)
    tree = drafter.propose(DraftRequest(np.array([1, 2, 3, 1, 2, 3, 1, 2]), budget=5, max_depth=10))
    assert inner.budgets == [2] and tree.size - 1 == 5  # the drafter's 2, lookup's 3 on top
    tree = drafter.propose(DraftRequest(np.array([5, 6]), budget=5, max_depth=10))  # no match: no more for the drafter
    assert inner.budgets[-1] == 2 and tree.size - 1 == 2
    tree = drafter.propose(DraftRequest(np.array([1, 2, 3, 1, 2, 3, 1, 2]), budget=3, max_depth=10))
    assert inner.budgets[-1] == 0 and tree.size - 1 == 3  # near the context's end the budget still holds
    with pytest.raises(ValueError, match="at least 0"):
        LookupBranch(inner, nodes=3, inner_budget=-1)



class Full(Fixed):
    """``Fixed`` whose chain always fills the budget, and says so (``tree_sizes``)."""

    def tree_sizes(self, budget):
        return (min(budget, len(self.chain)) + 1,)


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=2, max_size=30), budget=st.integers(0, 9), nodes=st.integers(1, 4),
       own=st.one_of(st.none(), st.integers(0, 5)))
def test_the_branchs_trees_take_the_sizes_it_names(tokens, budget, nodes, own):
    """A compiled server warms ``tree_sizes`` alone (``Engine.warm_compiled``): whatever lookup
    finds, the grafted tree's size is among them, shared or on top (``own``: the drafter's own
    budget); an inner drafter of every size gives every size."""
    drafter = LookupBranch(Full(np.arange(10, 30)), nodes=nodes, inner_budget=own)
    tree = drafter.propose(DraftRequest(np.asarray(tokens), budget=budget, max_depth=20))
    assert tree.size in drafter.tree_sizes(budget) and tree.size <= budget + 1
    assert LookupBranch(Full(np.arange(10, 30)), nodes=3).tree_sizes(6) == (4, 5, 6, 7)
    assert LookupBranch(Full(np.arange(10, 30)), nodes=3, inner_budget=1).tree_sizes(4) == (2, 3, 4, 5)
    assert LookupBranch(Fixed(np.arange(10, 30)), nodes=3).tree_sizes(6) == tuple(range(1, 8))

@pytest.mark.parametrize("inner", ["random", "lookup"])
def test_decoding_with_a_lookup_branch_is_the_targets_greedy_decoding(inner):
    model = tiny_model("llama", vocab=V, seed=3, layers=2)
    target = TargetModel(model)
    base = RandomDrafter(V, seed=1) if inner == "random" else __import__(
        "specblock.runtime.drafters", fromlist=["LookupDrafter"]).LookupDrafter(max_ngram=2)
    rng = np.random.default_rng(4)
    accepted = {}
    for name, drafter in (("alone", base), ("branch", LookupBranch(base, nodes=3))):
        engine = Engine(target, drafter, budget=6)
        acc = []
        for _ in range(3):
            prompt = np.tile(rng.integers(2, V, 5), 3)  # repeats: lookup has something to find
            res = engine.generate(prompt, 24)
            assert res.token_ids == hf_greedy(model, prompt, 24)
            assert max(res.stats.tree_size) <= 7
            acc += res.stats.accepted
        accepted[name] = np.mean(acc)
    if inner == "random":  # a random drafter's trees rarely hit; lookup's branch on a repeating text does
        assert accepted["branch"] > accepted["alone"]


def test_bench_runs_a_lookup_branch_and_refuses_bad_uses(tmp_path, capsys):
    assert has_lookup("eagle3+lookup") and has_lookup("eagle3+lookup@b4") and not has_lookup("eagle3@x+lookup")
    save_tiny(tmp_path / "t", "llama", vocab=96, ctx=2048)
    out = tmp_path / "b"
    flags = ["bench", "--target", str(tmp_path / "t"), "--domains", "code", "--prompts", "1", "--max-new-tokens", "8",
             "--runs", "1", "--dtype", "float32", "--budget", "4", "--out", str(out)]
    assert main(flags + ["--methods", "random,random+lookup", "--set", "random+lookup:lookup_nodes=2"]) == 0
    rows = {r["method"]: r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert rows["random+lookup"]["match_rate"] == 1.0 and rows["random+lookup"]["mean_tree_size"] <= 5
    capsys.readouterr()
    for bad, needle in ((["--methods", "random", "--set", "random:lookup_nodes=2"], "for a METHOD+lookup method"),
                        (["--methods", "random", "--set", "random:lookup_on_top=true"], "for a METHOD+lookup method"),
                        (["--methods", "specblock+lookup+adapt"], "the branch goes last")):
        assert main(flags[:-2] + ["--out", str(tmp_path / "bad")] + bad) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and "\n" not in err
    assert not (tmp_path / "bad.json").exists()


def test_cli_lookup_branch_is_identical_to_plain_decoding_and_refuses_bad_values(tmp_path, capsys):
    from tiny import run_cli

    model_dir = save_tiny(tmp_path / "m", "llama", vocab=96, ctx=64)
    flags = ["--target", model_dir, "--prompt", "abcabcabc", "--max-new-tokens", 12, "--dtype", "float32"]
    code, out, _ = run_cli(capsys, *flags, "--method", "random", "--lookup-branch", 3, "--json", "--compare", "ar")
    rec = json.loads(out.strip().splitlines()[0])
    assert code == 0 and rec["method"] == "random" and rec["lookup_branch"] == 3 and rec["identical_to_ar"] is True
    code, _, err = run_cli(capsys, *flags, "--method", "random", "--lookup-branch", 3, "--compare", "ar")
    assert code == 0 and "[random + lookup branch]" in err + _ and "identical to ar: True" in err + _
    code, out, _ = run_cli(capsys, *flags, "--method", "random", "--lookup-branch", 3, "--lookup-on-top", "--budget", 2,
                           "--json", "--compare", "ar")
    rec = json.loads(out.strip().splitlines()[0])
    assert code == 0 and rec["lookup_on_top"] is True and rec["identical_to_ar"] is True
    for bad, needle in ((["--method", "random", "--lookup-branch", 0], "--lookup-branch"),
                        (["--method", "random", "--lookup-on-top"], "give --lookup-branch N")):
        code, _, err = run_cli(capsys, *flags, *bad)
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1


def test_bench_budget_of_a_lookup_method_is_the_drafters_plus_the_branch_unless_set():
    """The drafter keeps its measured budget and lookup's branch comes on top (it was starved once:
    RunConfig's options carry budget=None, which read as a budget the user had set)."""
    import argparse

    from specblock.runtime import bench, drafters

    target = TargetModel(tiny_model("llama", vocab=V, seed=3, layers=2))
    targets = bench.Targets(target, "whole")

    def engine(method, *items, flag=None):
        args = argparse.Namespace(drafter_dir=None, set=list(items), method_options=None, budget=flag, compile=False)
        return bench.build_engine(method, targets, args, frozenset())

    def budget(method, *items, flag=None):
        return engine(method, *items, flag=flag).budget

    assert budget("random+lookup") == drafters.DEFAULT_BUDGET + 3
    assert engine("random+lookup").drafter.inner_budget == drafters.DEFAULT_BUDGET  # measured: the drafter's own
    assert budget("random+lookup", "random+lookup:lookup_nodes=5") == drafters.DEFAULT_BUDGET + 5
    assert budget("random+lookup", "random+lookup:budget=6") == 6  # the whole tree's, as set, and shared
    assert engine("random+lookup", "random+lookup:budget=6").drafter.inner_budget is None
    assert budget("random+lookup", flag=9) == 9
    # on top: a budget set stays the drafter's own too, the chain comes on top of it
    assert budget("random+lookup", "random+lookup:budget=6", "random+lookup:lookup_on_top=true") == 9
    assert engine("random+lookup", "random+lookup:budget=6", "random+lookup:lookup_on_top=true").drafter.inner_budget == 6


def test_the_server_takes_lookup_branch_from_the_runtime_flags(tmp_path):
    """The server's decoding flags are the CLI's (serve/cli.py): --lookup-branch reaches its engine."""
    from specblock.serve.cli import open_service, parse

    model_dir = save_tiny(tmp_path / "m", "llama", vocab=96, ctx=64)
    cfg, opts = parse(["--target", str(model_dir), "--dtype", "float32", "--method", "random", "--budget", "5",
                       "--lookup-branch", "2", "--port", "0"])
    engine = open_service(cfg, opts).session.engine
    assert isinstance(engine.drafter, LookupBranch) and engine.drafter.nodes == 2 and engine.budget == 5
