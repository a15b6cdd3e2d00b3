"""A datastore of the target's own answers (``runtime/drafters/datastore.py``) as a second chain
of the lookup branch: the majority continuation of the longest n-gram found, never across two
answers, a file that round-trips, clear errors, and output that stays the target's greedy decoding."""

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from specblock.errors import SpecBlockError
from specblock.runtime.drafters import RandomDrafter
from specblock.runtime.drafters.base import DraftRequest
from specblock.runtime.drafters.datastore import MAX_NGRAM, MIN_NGRAM, Datastore, open_datastore, resolve
from specblock.runtime.drafters.lookup_branch import LookupBranch
from specblock.runtime.engine import Engine
from specblock.runtime.target import TargetModel
from specblock.training.datastore import main as build_main
from test_lookup_branch import Fixed, Full
from tiny import hf_greedy, tiny_model

V = 32


def test_the_majority_continuation_of_the_longest_ngram():
    store = Datastore.from_sequences([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 4, 6], [9, 3, 4, 7]], V)
    assert store.tokens == 19
    assert store.chain(np.array([0, 1, 2, 3, 4]), 3).tolist() == [6]  # 2 votes to 1; the answer ends there
    assert store.chain(np.array([2, 3]), 3).tolist() == [4, 6]  # the 2-gram's majority path
    assert store.chain(np.array([9, 3, 4]), 2).tolist() == [7]  # the 3-gram (9 3 4) beats the 2-gram (3 4 -> 5/6)
    assert store.chain(np.array([8, 8]), 3).size == 0  # nothing found
    assert store.chain(np.array([4]), 3).size == 0  # shorter than the shortest n-gram
    assert store.chain(np.array([1, 2, 3]), 0).size == 0


def test_an_ngram_never_spans_two_answers():
    store = Datastore.from_sequences([[1, 2], [3, 4, 5]], V)
    assert store.chain(np.array([2, 3]), 2).size == 0  # 2 | 3 sits across the separator
    assert store.chain(np.array([1, 2]), 2).size == 0  # an answer's end continues into nothing


@settings(max_examples=150, deadline=None)
@given(seqs=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=20), min_size=1, max_size=6),
       ctx=st.lists(st.integers(0, 5), min_size=1, max_size=8), depth=st.integers(1, 6))
def test_a_chain_is_a_continuation_found_in_the_store(seqs, ctx, depth):
    """Whatever it returns follows the context's last n tokens somewhere in one answer, for the
    longest n (MIN_NGRAM..MAX_NGRAM) that occurs; nothing only when no n-gram does."""
    store = Datastore.from_sequences(seqs, 6)
    ctx = np.asarray(ctx, dtype=np.int64)
    got = store.chain(ctx, depth).tolist()
    assert len(got) <= depth

    def follows(n: int) -> list[list[int]]:
        k = ctx[-n:].tolist()
        return [s[i + n:] for s in seqs for i in range(len(s) - n + 1) if s[i:i + n] == k and len(ctx) >= n]

    found = [n for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1) if follows(n) and any(len(c) for c in follows(n))]
    if not found:
        assert got == []
        return
    conts = follows(found[0])
    assert got and any(c[:len(got)] == got for c in conts)


def test_save_and_load_round_trip_and_clear_errors(tmp_path):
    store = Datastore.from_sequences([[1, 2, 3, 4], [5, 1, 2, 3, 7]], V)
    path = tmp_path / "ds.npz"
    store.save(path)
    back = Datastore.load(path)
    np.testing.assert_array_equal(back.stream, store.stream)
    assert back.chain(np.array([1, 2]), 3).tolist() == store.chain(np.array([1, 2]), 3).tolist()
    with pytest.raises(SpecBlockError, match="no datastore at"):
        Datastore.load(tmp_path / "missing.npz")
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(SpecBlockError, match="is not a datastore"):
        Datastore.load(tmp_path / "bad.npz")
    with pytest.raises(SpecBlockError, match="no shipped datastore"):
        resolve("shipped", "no-such-model")
    assert resolve(str(path), "x") == path and open_datastore(str(path), "x", V).tokens == store.tokens
    with pytest.raises(SpecBlockError, match="built for a vocabulary of 32 tokens, the target has 64"):
        open_datastore(str(path), "x", 64)


def test_the_shipped_datastore_loads_and_finds_the_chat_templates_header():
    store = open_datastore("shipped", "smollm2-135m-instruct", 49152)
    assert store.tokens > 100_000 and store.vocab == 49152
    header = store.stream[:3]  # every answer starts after its prompt's last tokens
    assert store.chain(header, 2).size == 2


def _chatgen(root, name, target, shards, heldout):
    root.mkdir(parents=True)
    for i, rows in enumerate(shards):
        (root / f"shard_{i:05d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    man = {"target": target, "shard_prefix": "shard_", "heldout_shards": heldout,
           "shards": {f"shard_{i:05d}": {} for i in range(len(shards))}}
    (root / "manifest.json").write_text(json.dumps(man))
    return root


def test_the_builder_leaves_held_out_shards_out_and_refuses_another_targets_data(tmp_path, capsys):
    rows = [[{"prompt_ids": [7, 8, 9, 1, 2], "answer_ids": [3, 4]}], [{"prompt_ids": [5, 1, 2], "answer_ids": [6, 6, 6]}]]
    data = _chatgen(tmp_path / "gen", "gen", "tgt", rows, heldout=[0])
    out = tmp_path / "out" / "ds.npz"
    out.parent.mkdir()
    assert build_main(["--data", str(data), "--target", "tgt", "--vocab", str(V), "--out", str(out)]) == 0
    store = Datastore.load(out)
    assert store.stream.tolist() == [5, 1, 2, 6, 6, 6, -1]  # the prompt's last 3 tokens, the answer; shard 0 held out
    info = json.loads(out.with_suffix(".json").read_text())
    assert info["tokens"] == 6 and info["sources"][0]["shards"] == ["shard_00001"]
    with pytest.raises(SpecBlockError, match="holds answers of 'tgt'"):
        build_main(["--data", str(data), "--target", "other", "--vocab", str(V), "--out", str(tmp_path / "o2.npz")])
    with pytest.raises(SpecBlockError, match="outside --vocab"):
        build_main(["--data", str(data), "--vocab", "4", "--out", str(tmp_path / "o3.npz")])
    assert not (tmp_path / "o2.npz").exists() and not (tmp_path / "o3.npz").exists()


def test_the_branch_takes_the_stores_chain_only_where_the_prompt_has_no_match():
    """One chain either way: the prompt's match first (the text at hand), else the store's, so
    the branch's nodes, its budget and the sizes a compiled server warms stay lookup's."""
    store = Datastore.from_sequences([[1, 2, 3, 4, 5]], V)
    inner = Fixed([20, 21, 22])
    drafter = LookupBranch(inner, nodes=3, inner_budget=2, datastore=store)
    tree = drafter.propose(DraftRequest(np.array([9, 1, 2]), budget=5, max_depth=10))  # the prompt: no match
    assert inner.budgets == [2] and tree.size - 1 == 5
    assert tree.tokens[tree.path_to(tree.size - 1)].tolist() == [2, 3, 4, 5]  # the store's chain below the root
    tree = drafter.propose(DraftRequest(np.array([7, 2, 8, 1, 2]), budget=5, max_depth=10))  # the prompt: 2 -> 8 1 2
    assert tree.tokens[tree.path_to(tree.size - 1)].tolist() == [2, 8, 1, 2]
    assert drafter.tree_sizes(5) == LookupBranch(inner, nodes=3, inner_budget=2).tree_sizes(5)


@settings(max_examples=100, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=2, max_size=30), budget=st.integers(0, 9), nodes=st.integers(1, 4),
       own=st.one_of(st.none(), st.integers(0, 5)))
def test_with_a_store_the_trees_take_the_sizes_the_branch_names(tokens, budget, nodes, own):
    store = Datastore.from_sequences([[0, 1, 2, 3, 0, 2, 1, 3], [3, 3, 2, 2, 1, 1]], 4)
    drafter = LookupBranch(Full(np.arange(10, 30)), nodes=nodes, inner_budget=own, datastore=store)
    tree = drafter.propose(DraftRequest(np.asarray(tokens), budget=budget, max_depth=20))
    assert tree.size in drafter.tree_sizes(budget) and tree.size <= drafter.max_tree(budget)


def test_decoding_with_a_datastore_chain_is_the_targets_greedy_decoding():
    model = tiny_model("llama", vocab=V, seed=3, layers=2)
    target = TargetModel(model)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(2, V, 6) for _ in range(3)]
    # a store of the target's own continuations: its chains are often right, and never change the output
    store = Datastore.from_sequences([hf_greedy(model, p, 16) for p in prompts[:2]], V)
    engine = Engine(target, LookupBranch(RandomDrafter(V, seed=1), nodes=3, datastore=store), budget=6)
    accepted = []
    for p in prompts:
        res = engine.generate(p, 20)
        assert res.token_ids == hf_greedy(model, p, 20)
        accepted += res.stats.accepted
    assert np.mean(accepted) > 0.5  # the stored answers are found again


def test_bench_and_cli_take_a_datastore_and_refuse_bad_uses(tmp_path, capsys):
    from specblock.runtime.cli import main
    from tiny import run_cli, save_tiny

    save_tiny(tmp_path / "t", "llama", vocab=96, ctx=2048)
    store = tmp_path / "ds.npz"
    Datastore.from_sequences([[5, 6, 7, 8, 9]] * 3, 96).save(store)
    out = tmp_path / "b"
    flags = ["bench", "--target", str(tmp_path / "t"), "--domains", "code", "--prompts", "1", "--max-new-tokens", "8",
             "--runs", "1", "--dtype", "float32", "--budget", "4", "--out", str(out)]
    assert main(flags + ["--methods", "random,random+lookup", "--set", f"random+lookup:lookup_datastore={store}"]) == 0
    rows = {r["method"]: r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert rows["random+lookup"]["match_rate"] == 1.0
    capsys.readouterr()
    for bad, needle in ((["--methods", "random", "--set", f"random:lookup_datastore={store}"], "for a METHOD+lookup method"),
                        (["--methods", "random+lookup", "--set", f"random+lookup:lookup_datastore={tmp_path / 'no.npz'}"],
                         "no datastore at")):
        assert main(flags[:-2] + ["--out", str(tmp_path / "bad")] + bad) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and "\n" not in err
    assert not (tmp_path / "bad.json").exists()
    cli = ["--target", str(tmp_path / "t"), "--prompt", "abcabc", "--max-new-tokens", 10, "--dtype", "float32",
           "--method", "random"]
    code, out_, _ = run_cli(capsys, *cli, "--lookup-branch", 2, "--lookup-datastore", str(store), "--json", "--compare", "ar")
    rec = json.loads(out_.strip().splitlines()[0])
    assert code == 0 and rec["lookup_datastore"] == str(store) and rec["identical_to_ar"] is True
    code, _, err = run_cli(capsys, *cli, "--lookup-datastore", str(store))
    assert code == 2 and "give --lookup-branch N" in err and len(err.strip().splitlines()) == 1
