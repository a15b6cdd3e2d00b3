"""`python -m specblock.sim`: run --json, sweeps with cache, bad configs exit 2 with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from specblock.sim.__main__ import main

FAST = ["--set", "acceptance.kind=parametric", "--set", "acceptance.a1=0.8", "--set", "tree_pool=32",
        "--requests", "3", "--tokens", "64"]


def test_run_json_prints_one_object(capsys):
    assert main(["run", "--preset", "paper", "--method", "specblock", "--json", *FAST]) == 0
    res = json.loads(capsys.readouterr().out)
    for k in ("speedup", "tau", "draft_share", "tokens_per_s", "tpot_ms", "per_depth_acceptance", "config"):
        assert k in res
    assert res["config"]["method"]["name"] == "specblock"


def test_n_seeds_gives_confidence_intervals(capsys):
    assert main(["run", "--preset", "a100-llama3.1-8b", "--method", "eagle3", "--n-seeds", "3", "--json", *FAST]) == 0
    res = json.loads(capsys.readouterr().out)
    lo, hi = res["speedup_ci95"]
    assert lo <= res["speedup"] <= hi


@pytest.mark.parametrize("args,needle", [
    (["--preset", "nope"], "unknown preset"),
    (["--set", "workload.rate_per_s=-1"], "rate_per_s"),
    (["--set", "acceptance.a=-0.2", "--set", "acceptance.kind=iid"], "acceptance.a"),
    (["--preset", "cpu-calibrated", "--latency-file", "/nonexistent/lat.json"], "not found"),
    (["--config", "/nonexistent/cfg.yaml"], "not found"),
    (["--set", "acceptance.kind=traces", "--set", "acceptance.traces=[/nonexistent.jsonl]"], "not found"),
    (["--set", "method.widths=[2,4]"], "widths"),
    (["--benchmark", "poetry"], "unknown benchmark"),
])
def test_bad_configs_exit_2_with_one_line(capsys, args, needle):
    assert main(["run", *args, "--requests", "1", "--tokens", "8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1 and needle in err


def test_real_process_exit_status_and_no_traceback():
    p = subprocess.run([sys.executable, "-m", "specblock.sim", "run", "--preset", "nope"], capture_output=True, text=True)
    assert p.returncode == 2 and "Traceback" not in p.stderr and p.stderr.count("\n") == 1


def _grid(tmp_path, extra=""):
    g = tmp_path / "grid.yaml"
    g.write_text(f"""
base: {{preset: paper, tree_pool: 16, acceptance: {{kind: parametric, a1: 0.8}},
        workload: {{requests: 2, tokens: 32}}}}
grid: {{method.K: [2, 4], method.M: [1, 2]}}
out: {tmp_path / 'out'}
{extra}""")
    return g


def test_sweep_runs_caches_and_writes_outputs(tmp_path, capsys):
    g = _grid(tmp_path)
    assert main(["sweep", str(g), "--no-progress", "--workers", "2"]) == 0
    assert "4 configs (0 cached)" in capsys.readouterr().out
    out = tmp_path / "out"
    assert (out / "results.csv").read_text().count("\n") == 5
    assert (out / "speedup.png").stat().st_size > 1000
    full = json.loads((out / "results.json").read_text())
    assert {r["config"]["method"]["K"] for r in full} == {2, 4}
    assert main(["sweep", str(g), "--no-progress"]) == 0
    assert "4 configs (4 cached)" in capsys.readouterr().out


def test_sweep_bad_point_exits_2(tmp_path, capsys):
    g = tmp_path / "bad.yaml"
    g.write_text("grid: {method.K: [0, 4]}\n")
    assert main(["sweep", str(g)]) == 2
    assert "method.K" in capsys.readouterr().err
    assert main(["sweep", str(tmp_path / "missing.yaml")]) == 2


@pytest.mark.skipif(not os.environ.get("SPECBLOCK_TEST_RAY"),
                    reason="starting Ray takes 10-60 s on 2 cores; set SPECBLOCK_TEST_RAY=1 to run")
def test_sweep_on_local_ray(tmp_path, capsys):
    pytest.importorskip("ray")
    g = _grid(tmp_path)
    assert main(["sweep", str(g), "--no-progress", "--ray", "local"]) == 0
    assert "4 configs (0 cached)" in capsys.readouterr().out


def test_sim_never_imports_torch():
    code = ("import sys, specblock.sim.__main__, specblock.sim.sweep, specblock.sim.traces\n"
            "from specblock.sim.config import SimConfig\nfrom specblock.sim.engine import simulate\n"
            "simulate(SimConfig.model_validate({'adapt': {'enabled': True, 'window': 8}, 'tree_pool': 4,"
            " 'workload': {'requests': 2, 'tokens': 32}}))\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
