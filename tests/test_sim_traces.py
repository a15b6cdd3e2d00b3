"""Trace-driven acceptance: the EM fit recovers the model that wrote synthetic traces, and uses
the rank head's cuts (issue 7)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specblock.policies.branching import RankBucketBranching
from specblock.sim.acceptance import ParametricShape, RankModel, default_confusion
from specblock.sim.config import SimConfig
from specblock.sim.engine import simulate
from specblock.sim.methods import SpecBlockDrafter
from specblock.sim.traces import fit_traces, has_cuts, read_traces, specblock_forwards


def _cfg(**acc) -> SimConfig:
    return SimConfig.model_validate({
        "method": {"name": "specblock", "widths": [2, 4, 6, 4]}, "tree_pool": 0, "seed": 4,
        "acceptance": dict({"kind": "parametric", "a1": 0.8}, **acc),
        "workload": {"requests": 12, "tokens": 256}})


def test_fit_recovers_rank_pmf_and_confusion(tmp_path):
    path = tmp_path / "t.jsonl"
    simulate(_cfg(), trace_out=str(path))
    rm = fit_traces([path])
    truth = ParametricShape(decay=0.93, block_decay=0.95).rank_model(0.8)
    np.testing.assert_allclose(rm.pmf[0, :4, 0], truth.pmf[0, :4, 0], atol=0.06)
    np.testing.assert_allclose(rm.pmf[1, :2, 0], truth.pmf[1, :2, 0], atol=0.06)
    # Only b0 and b1 are identifiable under widths (2, 4, 6, 4): no width reaches rank 10, so
    # b2 (ranks 5-10) and b3 (> 10) are never told apart (see traces.py).
    np.testing.assert_allclose(np.diag(rm.confusion)[:2], np.diag(default_confusion(0.7))[:2], atol=0.06)


def test_traces_drive_the_sim_to_the_same_tau(tmp_path):
    path = tmp_path / "t.jsonl"
    orig = simulate(_cfg(), trace_out=str(path))
    refit = simulate(_cfg(kind="traces", traces=[str(path)]))
    assert refit["tau"] == pytest.approx(orig["tau"], rel=0.04)


def test_bad_trace_lines(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"iter": 0}) + "\n")
    with pytest.raises(ValueError, match="not a trace record"):
        read_traces([p])
    with pytest.raises(FileNotFoundError):
        read_traces([tmp_path / "none.jsonl"])


# ------------------------------------------------------------------ rank-head cuts (issue 7)
WIDTHS = (2, 4, 10, 0)


def _cutting_model() -> RankModel:
    """A drafter whose rank head ends a branch (b3) at 55% of the positions under a wrong parent,
    and at the reachable ones draws buckets from the default confusion: like the lab drafter,
    whose trees stay small because most positions hang under a wrong parent."""
    base = ParametricShape(decay=0.93, block_decay=0.95).rank_model(0.5)
    off = np.tile([0.15, 0.25, 0.05, 0.55], base.pmf.shape[:2] + (1,))
    return RankModel(pmf=base.pmf, confusion=base.confusion, kappa=base.kappa, pred_off=off)


def _drafter(**kw) -> SpecBlockDrafter:
    return SpecBlockDrafter(policy=RankBucketBranching(WIDTHS), **dict(dict(K=4, M=2, max_seeds=2, budget=24), **kw))


def _record(i: int, d) -> dict:
    """The runtime's trace record for one drafted tree (what engine._write_trace writes)."""
    t = d.tree
    return {"iter": i, "ctx": 100 + i, "tree_size": t.size, "depth": t.max_depth, "accepted": d.acceptance.accepted,
            "draft_s": 0.01, "verify_s": 0.01, "commit_s": 0.001, "domain": "code",
            "nodes": {"parent": t.parent.tolist(), "depth": t.depth.tolist(), "rank": t.rank.tolist(),
                      "bucket": t.bucket.tolist(), "block": t.block.tolist(), "correct": d.correct.astype(int).tolist()},
            "cuts": {"parent": [c[0] for c in d.cuts], "bucket": [c[1] for c in d.cuts], "block": [c[2] for c in d.cuts]}}


def _write_trace(path, n: int = 1500, seed: int = 0) -> list:
    rng, drafter, rm = np.random.default_rng(seed), _drafter(), _cutting_model()
    drafts = [drafter.draft(rng, rm) for _ in range(n)]
    path.write_text("".join(json.dumps(_record(i, d)) + "\n" for i, d in enumerate(drafts)))
    return drafts


def _mean_tree(rm, n: int = 3000, seed: int = 1) -> tuple[float, float]:
    rng, drafter = np.random.default_rng(seed), _drafter()
    ds = [drafter.draft(rng, rm) for _ in range(n)]
    return float(np.mean([d.tree.size for d in ds])), 1 + float(np.mean([d.acceptance.accepted for d in ds]))


def test_cuts_make_the_fit_grow_trees_as_small_as_the_source(tmp_path):
    path = tmp_path / "t.jsonl"
    src = _write_trace(path)
    size_src = float(np.mean([d.tree.size for d in src]))
    tau_src = 1 + float(np.mean([d.acceptance.accepted for d in src]))
    stripped = tmp_path / "nocuts.jsonl"
    stripped.write_text("".join(json.dumps({k: v for k, v in json.loads(x).items() if k != "cuts"}) + "\n"
                                for x in path.read_text().splitlines()))
    assert has_cuts(read_traces([path])) and not has_cuts(read_traces([stripped]))
    size_cut, tau_cut = _mean_tree(fit_traces([path]))
    size_nocut, tau_nocut = _mean_tree(fit_traces([stripped]))
    assert size_cut == pytest.approx(size_src, rel=0.10) and tau_cut == pytest.approx(tau_src, rel=0.04)
    # Without cuts the fit never sees a b3 and the spines never end: the issue-7 symptom.
    assert size_nocut > 1.5 * size_cut and tau_nocut > tau_cut


def test_unreachable_buckets_are_fitted_apart(tmp_path):
    path = tmp_path / "t.jsonl"
    _write_trace(path)
    rm = fit_traces([path])
    assert rm.pred_off is not None and rm.joint is not None
    np.testing.assert_allclose(rm.pred_off[0, 1:4, 3], 0.55, atol=0.06)  # the source's b3 share
    assert rm.joint[0, 0].sum(0)[3] < 0.2  # at the root the head mostly predicts from the rank


def test_trace_fit_sim_is_deterministic_and_warns_on_old_traces(tmp_path):
    path = tmp_path / "t.jsonl"
    _write_trace(path, n=400)
    cfg = lambda p: SimConfig.model_validate({
        "method": {"name": "specblock", "widths": list(WIDTHS), "M": 2, "max_seeds": 2, "budget": 24},
        "acceptance": {"kind": "traces", "traces": [str(p)]}, "workload": {"requests": 4, "tokens": 64},
        "tree_pool": 64, "seed": 2})
    a, b = simulate(cfg(path)), simulate(cfg(path))
    assert a == b and "notes" not in a
    old = tmp_path / "old.jsonl"
    old.write_text("".join(json.dumps({k: v for k, v in json.loads(x).items() if k != "cuts"}) + "\n"
                           for x in path.read_text().splitlines()))
    assert "no rank-head cuts" in simulate(cfg(old))["notes"][0]


def test_forwards_inferred_from_a_trace_match_the_drafter(tmp_path):
    path = tmp_path / "t.jsonl"
    drafts = _write_trace(path, n=300)
    recs = read_traces([path])
    assert all(specblock_forwards(r, 4, 2, 2, 24) == d.forwards for r, d in zip(recs, drafts))
    assert {len(d.forwards) for d in drafts} == {1, 2}  # both one- and two-block iterations occur


def test_check_traces_puts_runtime_and_sim_side_by_side(tmp_path, capsys):
    from specblock.sim.__main__ import main

    path = tmp_path / "t.jsonl"
    _write_trace(path, n=800)
    assert main(["check-traces", str(path), "--trees", "3000", "--set", "method.widths=[2,4,10,0]"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["method"]["max_seeds"] == 2 and out["method"]["budget"] == 24  # the runtime's defaults
    assert abs(out["tau_err"]) < 0.05 and abs(out["tree_err"]) < 0.12 and out["runtime"]["iterations"] == 800
    assert main(["check-traces", str(path), "--set", "K=4"]) == 2  # only method.* settings


def test_depthwise_runtime_traces_key_each_depth_as_a_position():
    """The runtime logs an EAGLE-3 / SpS depth as its own one-position block; the sim's
    depth-by-depth model reads key (0, depth - 1). A chain whose depth-d acceptance falls
    0.9, 0.6, 0.3 must come back as that, not as depth 1's acceptance at every depth."""
    from specblock.sim.traces import TraceRecord, fit_rank_model, observations

    rng = np.random.default_rng(0)
    acc = [0.9, 0.6, 0.3]
    recs = []
    for i in range(3000):
        correct, ok = [1], True
        for a in acc:
            ok = ok and rng.random() < a
            correct.append(int(ok) if ok else int(rng.random() < 0.0))
        recs.append(TraceRecord.model_validate({
            "iter": i, "ctx": 10, "tree_size": 4, "depth": 3, "accepted": sum(correct[1:]), "draft_s": 0.0,
            "verify_s": 0.0, "commit_s": 0.0, "nodes": {"parent": [-1, 0, 1, 2], "depth": [0, 1, 2, 3],
                                                       "rank": [-1, 0, 0, 0], "bucket": [-1] * 4,
                                                       "block": [-1, 0, 1, 2], "correct": correct}}))
    rm = fit_rank_model(observations(recs, by_depth=True))
    assert rm.pmf.shape[:2] == (1, 3)
    np.testing.assert_allclose(rm.pmf[0, :, 0], acc, atol=0.04)
    # read as blocks (a SpecBlock drafter with K = 1 logs this very shape), keys stay (block, 0)
    assert fit_rank_model(observations(recs)).pmf.shape[:2] == (3, 1)


def _chain_record(i: int, target_rank: list[int], logp: list[list[float]]) -> dict:
    """A depth-3 chain trace whose every node is an expanded position; node d+1 is correct iff
    the target's rank at node d is 0."""
    ok = [1] + [int(r == 0) for r in target_rank]
    return {"iter": i, "ctx": 10, "tree_size": 4, "depth": 3, "accepted": 0, "draft_s": 0.0, "verify_s": 0.0,
            "commit_s": 0.0, "nodes": {"parent": [-1, 0, 1, 2], "depth": [0, 1, 2, 3], "rank": [-1, 0, 0, 0],
                                       "bucket": [-1] * 4, "block": [-1, 0, 1, 2], "correct": ok},
            "positions": {"node": [0, 1, 2], "logp": logp, "target_rank": target_rank}}


def test_position_pool_decides_depthwise_trees(tmp_path):
    """Logged positions drive EAGLE-3's simulated trees: a drafter whose top-1 is always the
    target's accepts every depth, one whose candidates never hold it accepts none, and rows are
    drawn by depth and reachability (with fallbacks for keys the log lacks)."""
    from specblock.sim.config import MethodCfg, build_method
    from specblock.sim.traces import TraceRecord, fit_acceptance

    lp = [[-0.1, -2.5]] * 3
    model = build_method(MethodCfg(name="eagle3", depth=3, top_k=2, budget=6))
    rng = np.random.default_rng(0)
    for ranks, want in (([0, 0, 0], 3), ([-1, -1, -1], 0)):
        recs = [TraceRecord.model_validate(_chain_record(i, ranks, lp)) for i in range(5)]
        rm = fit_acceptance(recs, "eagle3")
        assert rm.pool is not None and rm.pool.depths == 3
        assert {model.draft(rng, rm).acceptance.accepted for _ in range(20)} == {want}
    recs = [TraceRecord.model_validate(_chain_record(0, [0, 1, -1], [[-0.1, -2.5], [-0.7, -0.9], [-1.0, -1.2]]))]
    pool = fit_acceptance(recs, "eagle3").pool
    assert pool.reach.tolist() == [True, True, False]  # node 2 hangs under a rank-1 miss
    rank, logp = pool.sample(rng, 1, np.array([True, False]), 3, 16)  # no unreachable row at depth 1: the reachable one
    assert rank.tolist() == [1, 1] and logp.shape == (2, 3) and (logp[:, 2] < -20).all()
    assert pool.sample(rng, 9, np.array([True]), 2, 16)[0].tolist() == [16]  # deeper than logged: depth 2, its one row
    assert fit_acceptance(recs, "specblock").pool is None  # block drafters keep their tables
