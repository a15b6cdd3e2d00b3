"""A user's policy class end to end (issue 18): one loader for the runtime and the simulator, the
same tree from the same candidates in both, refusals as one line with status 2, lossless live."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from specblock.errors import SpecBlockError
from specblock.policies import loading
from specblock.policies.bandit import CostAwareBandit, FixedArm
from specblock.policies.branching import TreePolicy
from specblock.policies.rollback import ThreeWindowRollback
from specblock.runtime import drafters
from specblock.runtime.cli import main
from specblock.runtime.drafters.specblock_net import SpecBlockConfig, SpecBlockNet
from specblock.runtime.engine import Engine
from specblock.runtime.target import TargetModel
from specblock.sim.config import MethodCfg, SimConfig, build_method
from specblock.sim.engine import simulate
from tiny import save_tiny

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_branching.py"
POLICY = f"{EXAMPLE}:PathConfidenceBranching"
EXPECTED = "specblock.policies.expected:ExpectedAcceptanceBranching"
V = 96


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A tiny target and an untrained SpecBlock drafter for it, both on disk."""
    root = tmp_path_factory.mktemp("custom")
    save_tiny(root / "t", "llama", vocab=V, ctx=1024, layers=3)  # bench prompts are char-level here
    target = TargetModel.load(root / "t", "float32", "cpu")
    cfg = SpecBlockConfig(vocab_size=V, hidden_size=32, num_heads=4, intermediate_size=64, tap_layers=target.tap_layers)
    torch.manual_seed(0)
    net = SpecBlockNet(cfg)
    net.tie_to_target(target.model)
    with torch.no_grad():  # a rank head that predicts every bucket somewhere, b3 included
        for p in net.rank_head.parameters():
            p.add_(torch.randn_like(p) * 2.0)
    net.save(root / "d")
    return root / "t", root / "d", target


def run(capsys, *argv):
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:  # argparse's own refusals (status 2, one line: cli._Parser)
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


# ----------------------------------------------------------------------------- the loader
def test_loader_builds_by_module_or_file_and_refuses_in_one_line():
    p = loading.build("specblock.policies.branching:TopKBranching", '{"k": 3}', TreePolicy)
    assert type(p).__name__ == "TopKBranching" and p.k == 3
    a, b = loading.load_class(POLICY, TreePolicy), loading.load_class(POLICY, TreePolicy)
    assert a is b  # one module object per file: the sim and the runtime see one class
    for spec, kw, needle in [
        ("nosuchmodule_x:Cls", None, "no module 'nosuchmodule_x'"),
        ("specblock.policies.branching:Nope", None, "has no Nope"),
        ("specblock.policies.seeds:TopScoreSeeds", None, "not a subclass of specblock.policies.branching.TreePolicy"),
        ("no_colon", None, "is not package.module:Class"),
        (POLICY, '{"bogus": 1}', "do not fit PathConfidenceBranching"),
        (POLICY, '{"threshold": 2}', "rejected by PathConfidenceBranching: threshold is a probability"),
        (POLICY, "[1, 2]", "JSON object"),
        (POLICY, "{oops", "not valid JSON"),
        ("/nonexistent/dir/mod.py:Cls", None, "no file"),
    ]:
        with pytest.raises(SpecBlockError, match=None) as e:
            loading.build(spec, kw, TreePolicy, "--policy")
        assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_defaults_fill_only_what_the_class_takes():
    b = loading.build("specblock.policies.bandit:FixedArm", {"arm": "heads"}, CostAwareBandit,
                      defaults={"arms": ("skip", "heads"), "seed": 3, "not_a_field": 1})
    assert isinstance(b, FixedArm) and b.arms == ("skip", "heads") and b.select() == "heads"
    r = loading.build("specblock.policies.rollback:ThreeWindowRollback", {"n_windows": 2}, ThreeWindowRollback,
                      defaults={"tolerance": 0.2})
    assert r.n_windows == 2 and r.tolerance == 0.2


# ----------------------------------------------------------------------------- sim == runtime
class _Replay:
    """A rank model that hands the sim the candidates the runtime drafter saw, block by block."""

    pool = None

    def __init__(self, blocks: list[tuple[np.ndarray, np.ndarray, np.ndarray]], k: int) -> None:
        self.blocks, self.k = blocks, k

    def sample(self, rng, blk, pos, n_cand, size):
        m_count = int(np.max(blk)) + 1
        kd = int(np.max(pos)) + 1
        ms = size // (m_count * kd)
        logp = np.full((m_count, ms, kd, n_cand), -50.0, dtype=np.float32)
        pred = np.zeros((m_count, ms, kd), dtype=np.int64)
        for m, (lps, buckets, _) in enumerate(self.blocks):
            s = lps.shape[0]
            logp[m, :s] = lps[..., :n_cand]
            pred[m, :s] = buckets
        return np.zeros(size, dtype=np.int64), logp.reshape(size, n_cand), pred.reshape(size)

    def sample_pred_off(self, rng, blk, pos, size):
        return None

    def bucket_posterior(self, block, pred):  # the rank head's own probabilities, as the runtime saw them
        return self.blocks[block][2]


@pytest.mark.parametrize("policy,kwargs", [(POLICY, {"threshold": 0.05, "max_width": 3}),
                                           (POLICY, {"threshold": 0.001, "max_width": 4, "min_width": 0}),
                                           (POLICY, {"threshold": 0.01, "max_width": 2, "bucket_cut": False}),
                                           (EXPECTED, {"min_value": 0.002})])
def test_same_candidates_same_tree_in_sim_and_runtime(lab, policy, kwargs):
    """The class named once, built by the runtime's drafter registry and by the sim's config, grows
    the same tree from the same candidates: the runtime's SpecBlock drafter and the sim's model of
    it share seeds, leaves-only seeding, the budget and the block loop, not just grow_block."""
    _, ddir, target = lab
    budget, M, seeds = 20, 2, 2
    opts = {"drafter": ddir, "M": M, "max_seeds": seeds, "policy": policy, "policy_kwargs": json.dumps(kwargs)}
    rt = drafters.build("specblock", target, opts)
    sim = build_method(MethodCfg(name="specblock", K=rt.net.cfg.K, M=M, max_seeds=seeds, budget=budget,
                                 policy_class=policy, policy_kwargs=kwargs))
    assert type(rt.policy) is type(sim.policy)  # one class object, loaded once
    seen: list = []
    real_candidates, real_propose = rt._candidates, rt.propose

    def candidates(hq):
        ids, lps, buckets, bucket_prob = real_candidates(hq)
        seen[-1][0].append((lps.copy(), buckets.copy(), bucket_prob.copy()))
        return ids, lps, buckets, bucket_prob

    def propose(req):
        seen.append(([], None))
        tree = real_propose(req)
        seen[-1] = (seen[-1][0], tree)
        return tree

    rt._candidates, rt.propose = candidates, propose
    rng = np.random.default_rng(1)
    for length in (3, 9):
        Engine(target, rt, budget=budget).generate(rng.integers(3, V, length), 16)
    assert len(seen) > 5 and any(t.size > 2 for _, t in seen)
    k = sim.policy.max_width
    for blocks, tree in seen:
        d = sim.draft(np.random.default_rng(0), _Replay(blocks, k))
        for f in ("parent", "depth", "rank", "bucket", "block"):
            np.testing.assert_array_equal(getattr(d.tree, f), getattr(tree, f), err_msg=f)
        np.testing.assert_allclose(d.tree.cum_logprob, tree.cum_logprob, rtol=1e-6)


def test_sim_runs_the_example_from_config_and_refuses_bad_classes(capsys):
    from specblock.sim.__main__ import main as sim_main

    cfg = {"method": {"name": "specblock", "policy_class": POLICY, "policy_kwargs": {"threshold": 0.05}},
           "acceptance": {"kind": "parametric", "a1": 0.8}, "workload": {"requests": 4, "tokens": 64}, "tree_pool": 32}
    res = simulate(SimConfig.model_validate(cfg))
    assert res["tau"] > 1.2
    code = sim_main(["run", "--requests", "2", "--tokens", "16", "--set", "method.policy_class=specblock.policies.seeds:TopScoreSeeds"])
    err = capsys.readouterr().err
    assert code == 2 and "method.policy_class" in err and "not a subclass" in err and len(err.strip().splitlines()) == 1


def test_user_bandit_and_rollback_drive_the_sims_adaptation():
    base = {"method": {"name": "specblock"}, "acceptance": {"kind": "parametric", "a1": 0.6},
            "workload": {"requests": 6, "tokens": 256}, "tree_pool": 32, "adapt": {"enabled": True, "window": 8}}
    res = simulate(SimConfig.model_validate({**base, "adapt": {**base["adapt"], "policy_class": "specblock.policies.bandit:FixedArm",
                                                                "policy_kwargs": {"arm": "heads"},
                                                                "rollback_class": "specblock.policies.rollback:ThreeWindowRollback",
                                                                "rollback_kwargs": {"n_windows": 2}}}))
    assert res["adapt_arms"]["heads"] > 0 and res["adapt_arms"]["full"] == 0 and res["adapt_arms"]["skip"] == 0


def test_runtime_adaptation_takes_the_same_classes():
    from specblock.runtime.adapt import AdaptSettings, adaptation_policies

    bandit, rollback = adaptation_policies(AdaptSettings(
        arms=("skip", "heads", "full"), seed=5, bandit_class="specblock.policies.bandit:FixedArm",
        bandit_kwargs={"arm": "full"}, rollback_class="specblock.policies.rollback:ThreeWindowRollback",
        rollback_kwargs='{"n_windows": 2}'))
    assert isinstance(bandit, FixedArm) and bandit.select() == "full" and bandit.arms == ("skip", "heads", "full")
    assert bandit.explore == AdaptSettings.explore and rollback.n_windows == 2 and rollback.tolerance == AdaptSettings.tolerance


# ----------------------------------------------------------------------------- the CLI
def test_live_decode_with_the_custom_policy_is_identical_to_ar(lab, capsys):
    tdir, ddir, _ = lab
    code, out, err = run(capsys, "--target", tdir, "--method", "specblock", "--drafter", ddir, "--policy", POLICY,
                         "--policy-kwargs", '{"threshold": 0.02, "max_width": 3, "bucket_cut": false}',
                         "--seed-policy", "specblock.policies.seeds:TopScoreSeeds",
                         "--prompt", "abc abc abc", "--max-new-tokens", 24, "--dtype", "float32", "--compare", "ar", "--json")
    assert code == 0, err
    rec = json.loads(out)
    assert rec["identical_to_ar"] is True and rec["mean_tree_size"] > 1


@pytest.mark.parametrize("args,needle", [
    (["--policy", "nosuchmodule_x:Cls"], "--policy: nosuchmodule_x:Cls: no module"),
    (["--policy", "specblock.policies.branching:Nope"], "has no Nope"),
    (["--policy", "specblock.policies.seeds:TopScoreSeeds"], "not a subclass"),
    (["--seed-policy", "specblock.policies.branching:TopKBranching"], "not a subclass of specblock.policies.seeds.SeedPolicy"),
    (["--policy", POLICY, "--policy-kwargs", '{"bogus": 1}'], "do not fit PathConfidenceBranching"),
    (["--policy", POLICY, "--policy-kwargs", '{"max_width": 0}'], "rejected by PathConfidenceBranching"),
    (["--policy", POLICY, "--policy-kwargs", "{oops"], "--policy-kwargs"),
    (["--policy-kwargs", '{"k": 2}'], "--policy-kwargs without --policy"),
    (["--method", "lookup", "--policy", POLICY], "method lookup takes no TreePolicy"),
    (["--adapt-policy", "specblock.policies.bandit:FixedArm"], "add --adapt"),
    (["--adapt", "--adapt-policy", "specblock.policies.rollback:ThreeWindowRollback"],
     "--adapt-policy: specblock.policies.rollback:ThreeWindowRollback is not a subclass"),
    (["--adapt", "--rollback-policy", "specblock.policies.rollback:ThreeWindowRollback",
      "--rollback-policy-kwargs", '{"windows": 3}'], "do not fit ThreeWindowRollback"),
])
def test_cli_refuses_bad_policies_in_one_line(lab, capsys, args, needle):
    tdir, ddir, _ = lab
    method = [] if "--method" in args else ["--method", "specblock", "--drafter", ddir]
    code, out, err = run(capsys, "--target", tdir, *method, "--prompt", "abc", "--max-new-tokens", 2, *args)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err and out == ""


def test_specblock_traces_log_positions_and_the_sim_draws_them(lab, tmp_path):
    """Every block position with a parent on the tree is logged (top-k log-probs, target rank,
    block, in-block position, bucket); the trace fit pools them, and the sim's SpecBlock model
    then takes its candidates' log-probs from those rows, not from the Beta confidence."""
    import io

    from specblock.sim.traces import KEYS_PER_BLOCK, fit_acceptance, read_traces

    _, ddir, target = lab
    rt = drafters.build("specblock", target, {"drafter": ddir, "M": 2, "max_seeds": 2, "policy": POLICY,
                                              "policy_kwargs": {"threshold": 0.001, "max_width": 3, "min_width": 0}})
    buf = io.StringIO()
    Engine(target, rt, budget=16, trace=buf).generate(np.arange(3, 12), 20)
    path = tmp_path / "t.jsonl"
    path.write_text(buf.getvalue())
    recs = read_traces([path])
    K = rt.net.cfg.K
    for r in recs:
        p = r.positions
        assert p is not None and len(p.node) == len(p.block) == len(p.pos) == len(p.bucket) == len(p.logp) > 0
        assert all(0 <= n < r.tree_size for n in p.node) and set(p.block) <= {0, 1} and max(p.pos) < K
        assert all(len(row) == rt.net.cfg.top_k for row in p.logp)
        # a node's in-block children hang on its position: their ranks are positions' candidates
        assert np.all(np.diff(np.asarray(p.logp), axis=1) <= 1e-4)
    rm = fit_acceptance(recs, "specblock")
    assert rm.pool is not None and rm.pool.block_size == KEYS_PER_BLOCK and rm.pool.pred is not None
    sim = build_method(MethodCfg(name="specblock", K=K, M=2, max_seeds=2, budget=16, policy_class=POLICY,
                                 policy_kwargs={"threshold": 0.001, "max_width": 3, "min_width": 0}))
    logged = np.unique(rm.pool.logp[:, :3])
    rng = np.random.default_rng(0)
    for _ in range(30):
        lp = sim.draft(rng, rm).tree.logprob[1:].astype(np.float64)
        assert lp.size and np.abs(lp[:, None] - logged[None, :]).min(axis=1).max() < 1e-4
    off = MethodCfg(name="specblock", K=K, M=2, max_seeds=2, budget=16)
    rm.pool = None  # without the pool: the Beta confidence, whose draws are not the logged values
    lp = np.concatenate([build_method(off).draft(rng, rm).tree.logprob[1:] for _ in range(30)]).astype(np.float64)
    assert np.abs(lp[:, None] - logged[None, :]).min(axis=1).max() > 1e-3


def test_sweep_cache_follows_the_policy_file_not_just_its_name(tmp_path, capsys):
    """Tuning a class means editing it and sweeping again: the cache must not answer for old code."""
    from specblock.sim.__main__ import main as sim_main

    mod = tmp_path / "my_policy.py"
    src = ("from dataclasses import dataclass\nimport numpy as np\nfrom specblock.policies.branching import TreePolicy\n"
           "@dataclass\nclass Wide(TreePolicy):\n    k: int = {k}\n"
           "    def raw_widths(self, parent_score, cand_logprob, bucket):\n"
           "        return np.full(cand_logprob.shape[0], self.k)\n")
    mod.write_text(src.format(k=2))
    g = tmp_path / "g.yaml"
    g.write_text(f"base: {{preset: paper, tree_pool: 16, acceptance: {{kind: parametric, a1: 0.8}}, "
                 f"workload: {{requests: 2, tokens: 32}}, method: {{name: specblock, policy_class: '{mod}:Wide'}}}}\n"
                 f"grid: {{method.M: [1, 2]}}\nout: {tmp_path / 'out'}\n")
    outs = []
    for k in (2, 2, 3):
        mod.write_text(src.format(k=k))
        assert sim_main(["sweep", str(g), "--no-progress", "--workers", "1"]) == 0
        outs.append(capsys.readouterr().out)
    assert "(0 cached)" in outs[0] and "(2 cached)" in outs[1] and "(0 cached)" in outs[2]


def test_server_takes_the_same_flags(lab):
    """The server parses the runtime's flags and builds its drafter from the same options."""
    from specblock.serve.cli import parse

    tdir, ddir, _ = lab
    common = ["--target", str(tdir), "--method", "specblock", "--drafter", str(ddir)]
    cfg, _ = parse(common + ["--policy", POLICY, "--policy-kwargs", '{"threshold": 0.1}'])
    opts = cfg.drafter_options()
    assert opts["policy"] == POLICY and opts["policy_kwargs"] == {"threshold": 0.1}
    with pytest.raises(SpecBlockError, match="not a subclass"):
        parse(common + ["--policy", "specblock.policies.seeds:TopScoreSeeds"])


def test_user_bandit_serves_in_the_cli_and_the_bench(lab, tmp_path, capsys):
    """--adapt-policy (CLI) and --set specblock+adapt:adapt_policy=... (bench) put the user's class
    in charge: FixedArm told to play "heads" never plays "full"."""
    tdir, ddir, _ = lab
    code, out, err = run(capsys, "--target", tdir, "--method", "specblock", "--drafter", ddir, "--adapt",
                         "--adapt-window", 2, "--adapt-policy", "specblock.policies.bandit:FixedArm",
                         "--adapt-policy-kwargs", '{"arm": "heads"}', "--rollback-policy",
                         "specblock.policies.rollback:ThreeWindowRollback", "--rollback-policy-kwargs", '{"n_windows": 2}',
                         "--prompt", "abc abc abc abc", "--max-new-tokens", 24, "--dtype", "float32", "--json")
    assert code == 0, err
    rec = json.loads(out)
    played = [w["arm"] for w in rec["adapt_windows"] if w["arm"]]
    assert played and set(played) == {"heads"}
    res = tmp_path / "b"
    assert main(["bench", "--target", str(tdir), "--methods", "specblock+adapt", "--domains", "code", "--prompts", "1",
                 "--max-new-tokens", "16", "--runs", "1", "--dtype", "float32", "--out", str(res),
                 "--set", f"specblock+adapt:drafter={ddir}", "--set", "specblock+adapt:adapt_window=2",
                 "--set", "specblock+adapt:adapt_policy=specblock.policies.bandit:FixedArm",
                 "--set", 'specblock+adapt:adapt_policy_kwargs={"arm":"heads"}']) == 0
    arms = json.loads(res.with_suffix(".json").read_text())["adapt"]["specblock+adapt"]["adapt_arms"]
    assert arms["heads"] > 0 and arms["full"] == 0 and arms["skip"] == 0
