"""experiments/sim_fidelity.py on synthetic inputs (no torch models).

The sim itself plays the runtime: it writes traces of a fixed parametric acceptance with the
runtime's SpecBlock settings and a small calibrated latency JSON; a bench JSON reports its tau and
Spd. Fed those, the script must fit the traces back and land within the goal's tolerances, skip
``lookup`` with a reason, and write consistent JSON / CSV / Markdown / PNG.
"""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import pytest

from specblock.sim.config import SimConfig
from specblock.sim.engine import simulate

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("sim_fidelity", ROOT / "experiments" / "sim_fidelity.py")
sf = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sf)

LATENCY = {"version": 1, "device": "cpu: 2 threads, x86_64", "dtype": "bfloat16",
           "target": {"ctx": [0, 512], "n": [1, 64], "ms": [[10.0, 30.0], [12.0, 34.0]]},
           "drafters": {"specblock": {"ms_per_forward": 2.0, "n_query": [4, 8], "ms": [2.0, 3.0]}},
           "overhead_ms": 0.5}
# The runtime's SpecBlock settings as the bench would have used them: K from the drafter's
# config.json, M and max_seeds from RunConfig's defaults, widths from --set, the engine budget.
METHOD = {"name": "specblock", "K": 4, "M": 2, "max_seeds": 2, "widths": [2, 4, 6, 4], "budget": 24}
PROMPTS, TOKENS = 30, 64


def _make_inputs(tmp: Path) -> tuple[Path, Path, Path]:
    lat = tmp / "lat.json"
    lat.write_text(json.dumps(LATENCY))
    (tmp / "dd" / "specblock").mkdir(parents=True)
    (tmp / "dd" / "specblock" / "config.json").write_text(json.dumps({"K": 4}))
    traces = tmp / "traces"
    traces.mkdir()
    res = {}
    for name, acc in (("specblock", {"kind": "parametric", "a1": 0.8}), ("ar", {"kind": "iid", "a": 0.0})):
        cfg = SimConfig.model_validate({
            "preset": "cpu-calibrated", "latency_file": str(lat), "method": METHOD if name != "ar" else {"name": "ar"},
            "acceptance": acc, "workload": {"requests": PROMPTS, "tokens": TOKENS, "prompt_len": 100},
            "tree_pool": 0, "seed": 11})
        res[name] = simulate(cfg, trace_out=str(traces / f"{name}.code.jsonl"))
    sb = res["specblock"]
    row = lambda m, spd, tau, tree: {"method": m, "domain": "code", "speedup": spd, "tau": tau, "draft_share": 0.1,
                                     "mean_tree_size": tree, "new_tokens": PROMPTS * TOKENS}
    bench = {"config": {"prompts": PROMPTS, "budget": 24, "set": ["specblock:widths=2,4,6,4"],
                        "drafter_dir": str(tmp / "dd"), "dtype": "bfloat16"},
             "device": "cpu", "threads": 2,
             "rows": [row("ar", 1.0, 1.0, 1.0), row("lookup", 1.2, 1.5, 3.0),
                      row("specblock", round(sb["speedup"], 4), round(sb["tau"], 4), round(sb["tree_size"], 2))]}
    bj = tmp / "bench.json"
    bj.write_text(json.dumps(bench))
    return bj, traces, lat


def test_runtime_settings_are_read_from_the_bench_config(tmp_path):
    cfg = {"budget": 16, "set": ["specblock:M=3", "specblock:widths=1,2,3,0", "lookup:ngram=2"],
           "drafter_dir": str(tmp_path)}
    m, notes = sf.sim_method("specblock", cfg)
    assert (m["M"], m["max_seeds"], m["widths"], m["budget"], m["K"]) == (3, 2, [1, 2, 3, 0], 16, 4)
    assert notes and "K=4 assumed" in notes[0]  # no config.json there


def test_fixed_acceptance_round_trip(tmp_path):
    bench, traces, lat = _make_inputs(tmp_path)
    out = tmp_path / "res" / "sim_fidelity"
    rc = sf.main(["--bench", str(bench), "--traces", str(traces), "--latency", str(lat), "--out", str(out),
                  "--requests", "30", "--n-seeds", "2", "--tree-pool", "512"])
    assert rc == 0
    res = json.loads(out.with_suffix(".json").read_text())
    (row,) = res["rows"]
    assert (row["method"], row["domain"]) == ("specblock", "code")
    assert abs(row["tau_err"]) < sf.TAU_TOL and abs(row["spd_err"]) < sf.SPD_TOL and row["goal_met"]
    assert row["tau_err"] == pytest.approx(row["tau_sim"] / row["tau_meas"] - 1, abs=1e-3)
    # The sim's own traces price iterations with the same latency JSON: measured == simulated.
    assert row["draft_ms_sim"] == pytest.approx(row["draft_ms_meas"], rel=0.05)
    assert row["verify_ms_sim"] == pytest.approx(row["verify_ms_meas"], rel=0.05)
    assert row["glue_ms_meas"] == pytest.approx(0.5) and row["ar_ms_sim"] == pytest.approx(row["ar_ms_meas"], rel=0.02)
    assert row["spd_dec_meas"] == pytest.approx(row["spd_meas"], rel=0.02)
    assert row["prompt_len"] == pytest.approx(100, abs=5) and row["tokens"] == TOKENS
    assert row["sim_method"]["widths"] == [2, 4, 6, 4] and row["sim_method"]["budget"] == 24
    assert [s["method"] for s in res["skipped"]] == ["lookup"] and "no method model" in res["skipped"][0]["reason"]
    assert res["goal"] == {"spd_tol": 0.1, "tau_tol": 0.05, "rows": 1, "met": 1, "all_met": True}
    assert not res["warnings"]
    with out.with_suffix(".csv").open() as f:
        (c,) = list(csv.DictReader(f))
    assert float(c["spd_sim"]) == row["spd_sim"] and float(c["tau_err"]) == row["tau_err"]
    md = out.with_suffix(".md").read_text()
    assert "met in 1 of 1" in md and "Skipped lookup/code" in md
    assert out.with_suffix(".png").stat().st_size > 1000


def test_stale_appends_and_bad_inputs(tmp_path, capsys):
    bench, traces, lat = _make_inputs(tmp_path)
    p = traces / "specblock.code.jsonl"
    lines = p.read_text().splitlines()
    p.write_text("\n".join(lines[:5] + lines) + "\n")  # an older generation (iter 0 again) before it
    kept, n = sf.read_generations(p, 1)
    assert n == 2 and kept == lines  # the sim writes one generation (global iter): the last one is kept
    assert sf.main(["--bench", str(tmp_path / "none.json"), "--traces", str(traces), "--latency", str(lat)]) == 2
    assert "bench JSON" in capsys.readouterr().err
    assert sf.main(["--bench", str(bench), "--traces", str(traces), "--latency", str(tmp_path / "x.json"),
                    "--out", str(tmp_path / "o")]) == 2
