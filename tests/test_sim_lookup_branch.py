"""Prompt lookup's branch in the sim (``method.lookup_nodes``, specblock/sim/lookup.py): the drafter's
synthetic tree with replayed lookup chains grafted on, as the runtime's ``METHOD+lookup`` does."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from specblock.policies.acceptance import accept_longest
from specblock.policies.tree import DraftTree
from specblock.sim.config import MethodCfg, SimConfig, build_method
from specblock.sim.engine import simulate
from specblock.sim.lookup import LookupBranchModel, chain_of, drafter_part, graft_chain
from specblock.sim.methods import Drafted
from specblock.sim.traces import TraceRecord

ROOT = Path(__file__).resolve().parents[1]
TABLE = {"t1_ms": 10.0, "verify_ms": 10.0, "n_ref": 1, "slope_ms_per_token": 0.5, "draft_ms_per_forward": {"sps": 1.0}}

# An iteration of a real ``specblock+lookup`` trace (runs/traces_smollm2_packed, code): three
# drafter candidates under the root, then lookup's chain, which follows the drafter's first
# candidate (its first token) and adds two nodes below it.
REAL = {"iter": 1, "ctx": 168, "tree_size": 6, "depth": 3, "accepted": 1, "draft_s": 0.0047, "verify_s": 0.033,
        "commit_s": 0.0009, "domain": "code",
        "nodes": {"parent": [-1, 0, 0, 0, 1, 4], "depth": [0, 1, 1, 1, 2, 3], "rank": [-1, 0, 1, 2, -1, -1],
                  "bucket": [-1, 0, 0, 0, -1, -1], "block": [-1, 0, 0, 0, 0, 0], "correct": [1, 1, 0, 0, 0, 1]},
        "cuts": {"parent": [], "bucket": [], "block": []},
        "positions": {"node": [0, 1], "logp": [[-0.1, -2.0], [-0.2, -3.0]], "target_rank": [0, 0], "block": [0, 0],
                      "pos": [0, 1], "bucket": [0, 0]}}


def test_a_traced_iteration_splits_into_the_drafters_tree_and_lookups_chain():
    rec = TraceRecord.model_validate(REAL)
    assert chain_of(rec) == (3, 1)  # root -> 1 (shared, right) -> 4 (wrong) -> 5
    part = drafter_part(rec)
    assert part.nodes.parent == [-1, 0, 0, 0] and part.nodes.rank == [-1, 0, 1, 2]
    assert part.tree_size == 4 and part.depth == 1 and part.accepted == 1
    assert part.positions.node == [0, 1]
    plain = TraceRecord.model_validate(dict(REAL, nodes=dict(REAL["nodes"], rank=[-1, 0, 1, 2, 0, 0])))
    assert chain_of(plain) == (0, 0) and drafter_part(plain) is plain  # no lookup node: nothing to split


@st.composite
def drafted_and_chain(draw):
    n = draw(st.integers(1, 12))
    parent = np.array([-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)], dtype=np.int64)
    tree = DraftTree.from_parents(np.arange(n, dtype=np.int64), parent, rank=np.array([-1] + [0] * (n - 1)))
    correct = np.array([True] + draw(st.lists(st.booleans(), min_size=n - 1, max_size=n - 1)))
    size = draw(st.integers(0, 6))
    return Drafted(tree, correct, accept_longest(tree, correct), [3]), size, draw(st.integers(0, size))


@settings(max_examples=200, deadline=None)
@given(drafted_and_chain())
def test_a_grafted_chain_accepts_the_longer_guess_and_adds_only_the_tokens_it_does_not_share(args):
    d, size, right = args
    before = d.tree.size
    out = graft_chain(d, size, right, host_ms=0.5)
    shared = min(right, d.acceptance.accepted)
    assert out.acceptance.accepted == max(d.acceptance.accepted, right)
    assert out.tree.size == before + max(size - shared, 0)
    assert d.tree.size == before  # the drafted tree (maybe pooled) is not touched
    assert (out.tree.rank[before:] == -1).all() and out.forwards == [3] and out.host_ms == 0.5
    out.tree.check()


def _write_branch_trace(path: Path, n: int = 400, seed: int = 0) -> float:
    """``sps+lookup``-like records: SpS's 2-token chain always wrong at its first token, and about
    half the time lookup's 3-token chain under the root, all of it right. Returns the share with a chain."""
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(n):
        parent, depth, rank, block, correct = [-1, 0, 1], [0, 1, 2], [-1, 0, 0], [-1, 0, 1], [1, 0, 1]
        if rng.random() < 0.5:
            parent += [0, 3, 4]
            depth += [1, 2, 3]
            rank += [-1, -1, -1]
            block += [0, 0, 0]
            correct += [1, 1, 1]
        lines.append(json.dumps({
            "iter": i, "ctx": 100 + i, "tree_size": len(parent), "depth": max(depth), "accepted": 3 if len(parent) > 3 else 0,
            "draft_s": 0.002, "verify_s": 0.01, "commit_s": 0.0005, "domain": "code",
            "nodes": {"parent": parent, "depth": depth, "rank": rank, "bucket": [-1] * len(parent), "block": block,
                      "correct": correct}}))
    path.write_text("\n".join(lines) + "\n")
    return sum('"rank": [-1, 0, 0, -1' in x for x in lines) / n


def _cfg(path: Path, **method) -> SimConfig:
    return SimConfig.model_validate({
        "preset": "table", "table": TABLE, "method": dict({"name": "sps", "gamma": 2, "budget": 5}, **method),
        "acceptance": {"kind": "traces", "traces": [str(path)]}, "workload": {"requests": 30, "tokens": 128},
        "seed": 3})


def test_the_sim_replays_lookups_chains_beside_the_fitted_drafter(tmp_path):
    p = tmp_path / "sps+lookup.code.jsonl"
    share = _write_branch_trace(p)
    branch = simulate(_cfg(p, lookup_nodes=3))
    assert branch["tau"] == pytest.approx(1 + share * 3, rel=0.04)  # the drafter never right: lookup's chains alone
    assert simulate(_cfg(p, lookup_nodes=2))["tau"] == pytest.approx(1 + share * 2, rel=0.04)  # chains cut to 2
    alone = simulate(_cfg(p))  # the same traces without the branch: the drafter's own nodes only
    assert alone["tau"] == pytest.approx(1.0, abs=0.02)
    # the chain's 3 nodes come out of the whole budget; SpS's 2 fit either way: 2 + 3 when it matched
    assert branch["tree_size"] == pytest.approx(1 + 2 + share * 3, rel=0.05)


def test_the_chain_takes_its_nodes_from_the_whole_budget(tmp_path):
    p = tmp_path / "sps+lookup.code.jsonl"
    _write_branch_trace(p)
    m = build_method(_cfg(p, gamma=5, budget=5, lookup_nodes=3).method)
    assert isinstance(m, LookupBranchModel) and m.name == "sps+lookup" and m.drafter == "sps"
    assert m._at(5).budget == 5 and m._at(2).budget == 2  # no match: all 5 to SpS; a 3-token chain: 2 left
    res = simulate(_cfg(p, gamma=5, budget=5, lookup_nodes=3))
    assert res["tree_size"] <= 1 + 5 + 1e-9
    on_top = build_method(_cfg(p, gamma=4, budget=None, lookup_nodes=3).method)  # no budget: the branch on top
    assert on_top.budget == 4 + 3 and on_top.inner_budget == 4  # and the drafter's default stays its own


def test_on_top_the_drafter_keeps_its_budget(tmp_path):
    """``method.lookup_on_top`` (the runtime's ``--lookup-on-top``): the budget stays SpS's own and
    the chain comes on top, so the tree grows by the chain only where lookup matched."""
    p = tmp_path / "sps+lookup.code.jsonl"
    share = _write_branch_trace(p)
    m = build_method(_cfg(p, gamma=5, budget=2, lookup_nodes=3, lookup_on_top=True).method)
    assert m.budget == 2 + 3 and m.inner_budget == 2
    res = simulate(_cfg(p, gamma=5, budget=2, lookup_nodes=3, lookup_on_top=True))
    assert res["tree_size"] == pytest.approx(1 + 2 + share * 3, rel=0.05)  # SpS's 2 always, lookup's 3 where it matched
    shared = simulate(_cfg(p, gamma=5, budget=5, lookup_nodes=3))
    assert shared["tree_size"] > res["tree_size"] + 1  # shared, SpS takes all 5 where lookup found nothing
    with pytest.raises(ValidationError, match="set method.lookup_nodes too"):
        _cfg(p, lookup_on_top=True)


def test_a_branch_needs_a_drafter_and_traces(tmp_path):
    p = tmp_path / "sps+lookup.code.jsonl"
    _write_branch_trace(p)
    with pytest.raises(ValidationError, match="needs a drafter"):
        _cfg(p, name="lookup", lookup_nodes=3)
    with pytest.raises(ValidationError, match="acceptance.kind=traces"):
        SimConfig.model_validate({"preset": "table", "table": TABLE, "method": {"name": "eagle3", "lookup_nodes": 3}})


def _fidelity_settings():
    spec = importlib.util.spec_from_file_location("sim_fidelity_settings", ROOT / "experiments" / "sim_fidelity_settings.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_fidelity_reads_a_branch_row_as_the_bench_ran_it(tmp_path):
    fs = _fidelity_settings()
    assert fs.sim_name("eagle3+lookup@c") == "eagle3" and fs.sim_name("specblock+lookup") == "specblock"
    assert fs.sim_name("hf-lookup") is None and fs.sim_name("lookup") == "lookup"
    (tmp_path / "eagle3").mkdir()
    (tmp_path / "eagle3" / "serving.json").write_text(json.dumps({"budget": 2}))
    cfg = {"drafter_dir": str(tmp_path)}
    m, _ = fs.sim_method("eagle3+lookup", cfg)  # the engine's rule: served budget kept, the branch on top
    assert m["name"] == "eagle3" and m["lookup_nodes"] == 3 and m["budget"] == 2 and m["lookup_on_top"]
    built = build_method(MethodCfg.model_validate(m))
    assert built.budget == 2 + 3 and built.inner_budget == 2
    m, _ = fs.sim_method("eagle3+lookup", dict(cfg, set=["eagle3+lookup:lookup_nodes=2"]))
    assert m["lookup_nodes"] == 2 and m["budget"] == 2 and m["lookup_on_top"]
    m, _ = fs.sim_method("eagle3+lookup", dict(cfg, budget=6))  # a budget given is the whole tree's
    assert m["budget"] == 6 and "lookup_on_top" not in m
    m, _ = fs.sim_method("eagle3+lookup", dict(cfg, budget=6, set=["eagle3+lookup:lookup_on_top=true"],
                                               method_options={"eagle3+lookup": {"lookup_on_top": True}}))  # as the bench wrote it
    assert m["budget"] == 6 and m["lookup_on_top"]
    assert "lookup_nodes" not in fs.sim_method("eagle3", cfg)[0]


def test_the_split_check_recovers_every_logged_acceptance(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("lookup_branch_split", ROOT / "experiments" / "lookup_branch_split.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    share = _write_branch_trace(tmp_path / "sps+lookup.code.jsonl")
    assert mod.main([str(tmp_path), "--out", str(tmp_path / "o")]) == 0
    row = json.loads((tmp_path / "o.json").read_text())["rows"][0]
    assert row["split_equals_logged"] == row["records"] == 400
    assert row["tau_logged"] == pytest.approx(1 + 3 * share) and row["chain_share"] == pytest.approx(share, abs=1e-3)
    # the drafter is never right here, so pairing the parts at random changes nothing
    assert row["tau_paired"] == pytest.approx(row["tau_logged"]) and row["tau_paired_same_size"] == pytest.approx(row["tau_logged"])
    assert row["draft_ms_drafted"] == pytest.approx(2.0) and row["draft_ms_no_node"] is None  # SpS always drafted here
    assert mod.main([str(tmp_path / "none")]) == 2 and "no *+lookup*" in capsys.readouterr().err


def test_fidelity_and_the_budget_sweep_simulate_a_branch_row(tmp_path):
    """A ``specblock+lookup`` bench row written by the sim itself (its drafter fitted from the
    bench's SpecBlock traces, lookup's chains from the bench's lookup traces): sim_fidelity fits it
    back within the goal, and the budget sweep moves the branch's share with chains from ``lookup``."""
    from test_sim_fidelity import LATENCY, METHOD, PROMPTS, TOKENS, _make_inputs, sf

    bench, traces, lat = _make_inputs(tmp_path)
    lat_file = tmp_path / "lat_true.json"
    lat_file.write_text(json.dumps(LATENCY))
    cfg = SimConfig.model_validate({
        "preset": "cpu-calibrated", "latency_file": str(lat_file), "method": dict(METHOD, lookup_nodes=3),
        "acceptance": {"kind": "traces", "traces": [str(traces / "specblock.code.jsonl")],
                       "lookup_traces": [str(traces / "lookup.code.jsonl")]},
        "workload": {"requests": PROMPTS, "tokens": TOKENS, "prompt_len": 100}, "tree_pool": 0, "seed": 12})
    res = simulate(cfg, trace_out=str(traces / "specblock+lookup.code.jsonl"))
    b = json.loads(bench.read_text())
    b["config"]["set"].append("specblock+lookup:widths=2,4,6,4")  # as for the specblock row: --set is per method
    b["rows"].append({"method": "specblock+lookup", "domain": "code", "speedup": round(res["speedup"], 4),
                      "speedup_decode": round(res["speedup"], 4), "tau": round(res["tau"], 4), "draft_share": 0.1,
                      "mean_tree_size": round(res["tree_size"], 2), "new_tokens": PROMPTS * TOKENS})
    bench.write_text(json.dumps(b))
    out = tmp_path / "fid"
    assert sf.main(["--bench", str(bench), "--traces", str(traces), "--latency", str(lat), "--requests", "20",
                    "--n-seeds", "1", "--tree-pool", "256", "--out", str(out)]) == 0
    row = next(r for r in json.loads(out.with_suffix(".json").read_text())["rows"] if r["method"] == "specblock+lookup")
    assert row["sim_method"]["lookup_nodes"] == 3 and row["sim_method"]["budget"] == 24  # the bench gave 24: the whole tree's
    assert abs(row["tau_err"]) <= 0.05 and abs(row["spd_err"]) <= 0.10

    spec = importlib.util.spec_from_file_location("budget_sweep_sim", ROOT / "experiments" / "budget_sweep_sim.py")
    bs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bs)
    sweep = tmp_path / "sweep"
    assert bs.main(["--bench", str(bench), "--traces", str(traces), "--latency", str(lat), "--methods", "specblock+lookup",
                    "--budgets", "8,24", "--lookup-nodes", "1,3,8", "--chains-from", "lookup", "--requests", "20",
                    "--n-seeds", "1", "--tree-pool", "256", "--out", str(sweep)]) == 0
    rows = {(r["lookup_nodes"], r["budget"]): r for r in json.loads(sweep.with_suffix(".json").read_text())["rows"]}
    assert set(rows) == {(n, b) for n in (1, 3, 8) for b in (8, 24)}
    assert [k for k, r in rows.items() if r["served"]] == [(3, 24)]
    assert rows[1, 24]["tau_sim"] < rows[8, 24]["tau_sim"]  # lookup's traces hold chains up to 8 long
    assert "specblock+lookup (8 lookup nodes)" in sweep.with_suffix(".md").read_text()
    assert bs.main(["--bench", str(bench), "--traces", str(traces), "--latency", str(lat), "--methods", "medusa",
                    "--out", str(sweep)]) == 2


def test_the_cli_runs_a_branch_from_a_config_file(tmp_path, capsys):
    from specblock.sim.__main__ import main

    p = tmp_path / "sps+lookup.code.jsonl"
    share = _write_branch_trace(p)
    conf = tmp_path / "c.json"
    conf.write_text(_cfg(p, lookup_nodes=3).model_dump_json())
    assert main(["run", "--config", str(conf), "--requests", "20"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("table sps+lookup (3 nodes) mean: ")
    tau = float(out.split("tau ")[1].split()[0])
    assert tau == pytest.approx(1 + 3 * share, rel=0.05)


def test_a_drafter_left_no_node_still_runs_its_first_forward(tmp_path):
    """Where lookup's chain takes the whole budget, SpS (like SpecBlock and EAGLE-3) still feeds the
    committed tokens through its first forward, as the runtime's propose does; it drafts no node."""
    p = tmp_path / "sps+lookup.code.jsonl"
    share = _write_branch_trace(p)
    res = simulate(_cfg(p, gamma=2, budget=3, lookup_nodes=3))  # a chain of 3 leaves SpS nothing
    assert res["tree_size"] == pytest.approx(1 + 3 * share + 2 * (1 - share), rel=0.05)
    # 1 ms a forward (TABLE): 2 forwards without a chain, the first one alone with it
    assert res["t_draft_ms"] == pytest.approx(2 * (1 - share) + 1 * share, rel=0.05)
