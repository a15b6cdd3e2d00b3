"""experiments/sim_fidelity.py on synthetic inputs (no torch models).

The sim itself plays the runtime: it writes traces of a fixed parametric acceptance with the
runtime's SpecBlock settings and a small calibrated latency JSON; a bench JSON reports its tau and
Spd. Fed those, the script must fit the traces back and land within the goal's tolerances, replay
``lookup`` traces, estimate the drafting cost the latency JSON misses, and write consistent JSON /
CSV / Markdown / PNG.
"""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import pytest

from specblock.buckets import BUCKETS
from specblock.sim.config import SimConfig
from specblock.sim.engine import simulate
from test_sim_lookup import write_lookup_trace

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("sim_fidelity", ROOT / "experiments" / "sim_fidelity.py")
sf = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sf)

LATENCY = {"version": 1, "device": "cpu: 2 threads, x86_64", "dtype": "bfloat16",
           "target": {"ctx": [0, 512], "n": [1, 64], "ms": [[10.0, 30.0], [12.0, 34.0]]},
           "drafters": {"specblock": {"ms_per_forward": 2.0, "n_query": [4, 8], "ms": [2.0, 3.0], "K": 4}},
           "overhead_ms": 0.5}
# The runtime's SpecBlock settings as the bench would have used them: K from the drafter's
# config.json, M and max_seeds from RunConfig's defaults, widths from --set, the engine budget.
METHOD = {"name": "specblock", "K": 4, "M": 2, "max_seeds": 2, "widths": [2, 4, 6, 4], "budget": 24}
PROMPTS, TOKENS = 30, 64


def _make_inputs(tmp: Path, draft_overhead_ms: float = 0.0, calibrated_ms: float = 0.0) -> tuple[Path, Path, Path]:
    """Traces and a bench JSON from the sim; ``draft_overhead_ms`` per drafter forward is charged
    when writing them, and the latency JSON handed to the script says ``calibrated_ms`` (the
    runtime's host work around a block forward, which calibrate estimates apart from the traces)."""
    lat, lat_true = tmp / "lat.json", tmp / "lat_true.json"
    given = json.loads(json.dumps(LATENCY))
    given["drafters"]["specblock"]["overhead_ms"] = calibrated_ms
    lat.write_text(json.dumps(given))
    true = json.loads(json.dumps(LATENCY))
    true["drafters"]["specblock"]["overhead_ms"] = draft_overhead_ms
    lat_true.write_text(json.dumps(true))
    (tmp / "dd" / "specblock").mkdir(parents=True)
    (tmp / "dd" / "specblock" / "config.json").write_text(json.dumps({"K": 4}))
    traces = tmp / "traces"
    traces.mkdir()
    res = {}
    for name, acc in (("specblock", {"kind": "parametric", "a1": 0.8}), ("ar", {"kind": "iid", "a": 0.0})):
        cfg = SimConfig.model_validate({
            "preset": "cpu-calibrated", "latency_file": str(lat_true), "method": METHOD if name != "ar" else {"name": "ar"},
            "acceptance": acc, "workload": {"requests": PROMPTS, "tokens": TOKENS, "prompt_len": 100},
            "tree_pool": 0, "seed": 11})
        res[name] = simulate(cfg, trace_out=str(traces / f"{name}.code.jsonl"))
    lookup_tau, _ = write_lookup_trace(traces / "lookup.code.jsonl", n=200)
    sb = res["specblock"]
    # The sim's Spd is the decode loop's; "speedup" (wall, prefill included) is set lower, as
    # prefill would make it, so the script must judge speedup_decode.
    row = lambda m, spd, tau, tree: {"method": m, "domain": "code", "speedup": round(0.8 * spd, 4) if m != "ar" else spd,
                                     "speedup_decode": spd, "tau": tau, "draft_share": 0.1,
                                     "mean_tree_size": tree, "new_tokens": PROMPTS * TOKENS}
    bench = {"config": {"prompts": PROMPTS, "budget": 24, "set": ["specblock:widths=2,4,6,4"],
                        "drafter_dir": str(tmp / "dd"), "dtype": "bfloat16"},
             "device": "cpu", "threads": 2,
             "rows": [row("ar", 1.0, 1.0, 1.0), row("lookup", 1.2, round(lookup_tau, 4), 3.0),
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
    m, _ = sf.sim_method("specblock@b8", dict(cfg, set=["specblock@b8:budget=8"]))
    assert m["budget"] == 8  # a per-method engine budget from the bench's --set


def test_a_real_model_bench_reads_the_drafters_shipped_for_its_target(tmp_path):
    """A bench names its target; its engine took that target's drafters and serving settings (the
    lab's, read for a real-model bench, made the sim grow 41-node EAGLE-3 trees where 3 were served).
    A Medusa config without a calibrated table gets the runtime's prior one: the tree it verified."""
    from specblock.models.registry import MODELS
    from specblock.runtime.config import DEFAULT_DRAFTERS
    from specblock.runtime.drafters.medusa import MedusaConfig

    real = MODELS["smollm2-135m-instruct"].drafters
    assert sf.drafter_root({"target": "smollm2-135m-instruct"}) == real != DEFAULT_DRAFTERS
    assert sf.drafter_root({}) == DEFAULT_DRAFTERS  # written before the real model was the default
    assert sf.drafter_root({"target": "smollm2-135m-instruct", "drafter_dir": str(tmp_path)}) == tmp_path
    m, _ = sf.sim_method("eagle3", {"target": "smollm2-135m-instruct"})
    assert m["budget"] == json.loads((real / "eagle3" / "serving.json").read_text())["budget"]
    (tmp_path / "medusa").mkdir()
    raw = {"vocab_size": 32, "hidden_size": 8, "heads": 3, "top_k": 4}
    (tmp_path / "medusa" / "config.json").write_text(json.dumps({"kind": "medusa", **raw}))
    m, notes = sf.sim_method("medusa", {"drafter_dir": str(tmp_path), "budget": 3})
    assert m["rank_acc"] == MedusaConfig(**raw).accuracy_table().tolist() and "prior table" in notes[0]


def test_fixed_acceptance_round_trip(tmp_path):
    bench, traces, lat = _make_inputs(tmp_path)
    out = tmp_path / "res" / "sim_fidelity"
    rc = sf.main(["--bench", str(bench), "--traces", str(traces), "--latency", str(lat), "--out", str(out),
                  "--requests", "30", "--n-seeds", "2", "--tree-pool", "512"])
    assert rc == 0
    res = json.loads(out.with_suffix(".json").read_text())
    row, lk = sorted(res["rows"], key=lambda r: r["method"] != "specblock")
    assert (row["method"], row["domain"]) == ("specblock", "code")
    assert abs(row["tau_err"]) < sf.TAU_TOL and abs(row["spd_err"]) < sf.SPD_TOL and row["goal_met"]
    assert row["tau_err"] == pytest.approx(row["tau_sim"] / row["tau_meas"] - 1, abs=1e-3)
    # The sim's own traces price iterations with the same latency JSON: measured == simulated.
    assert row["draft_ms_sim"] == pytest.approx(row["draft_ms_meas"], rel=0.05)
    assert row["verify_ms_sim"] == pytest.approx(row["verify_ms_meas"], rel=0.05)
    assert row["glue_ms_meas"] == pytest.approx(0.5) and row["ar_ms_sim"] == pytest.approx(row["ar_ms_meas"], rel=0.02)
    assert row["spd_dec_meas"] == pytest.approx(row["spd_meas"], rel=0.02)
    assert row["spd_basis"] == "decode" and row["spd_wall_meas"] == pytest.approx(0.8 * row["spd_meas"], rel=1e-3)
    assert row["prompt_len"] == pytest.approx(100, abs=5) and row["tokens"] == TOKENS
    assert row["sim_method"]["widths"] == [2, 4, 6, 4] and row["sim_method"]["budget"] == 24
    # lookup: a replay of its traces (tau is theirs); its Spd here is made up, so only tau is judged
    assert lk["method"] == "lookup" and abs(lk["tau_err"]) < 0.02 and lk["sim_method"] == {"name": "lookup"}
    assert not res["skipped"] and res["draft_overhead_ms_traces"] == pytest.approx(0.0, abs=0.05)
    assert res["goal"]["rows"] == 2 and res["goal"]["met"] >= 1
    assert not res["warnings"]
    with out.with_suffix(".csv").open() as f:
        c = next(x for x in csv.DictReader(f) if x["method"] == "specblock")
    assert float(c["spd_sim"]) == row["spd_sim"] and float(c["tau_err"]) == row["tau_err"]
    md = out.with_suffix(".md").read_text()
    assert "| lookup | code |" in md and "| specblock | code |" in md
    assert out.with_suffix(".png").stat().st_size > 1000
    assert row["spd_runs"] is None and "Spd runs min-max" in md  # this bench JSON has no per-run Spd


def test_measured_spread_and_depthwise_forwards(tmp_path):
    """Each run's decode Spd from the bench JSON is shown beside the judged median; EAGLE-3 is
    charged its configured depth in forwards whatever depth its reranked tree kept."""
    bench, traces, lat = _make_inputs(tmp_path)
    b = json.loads(bench.read_text())
    for r in b["rows"]:
        r["speedup_decode_runs"] = [0.9 * r["speedup_decode"], r["speedup_decode"], 1.2 * r["speedup_decode"]]
    bench.write_text(json.dumps(b))
    out = tmp_path / "o"
    assert sf.main(["--bench", str(bench), "--traces", str(traces), "--latency", str(lat), "--out", str(out),
                    "--requests", "10", "--n-seeds", "1", "--tree-pool", "128"]) == 0
    row = next(r for r in json.loads(out.with_suffix(".json").read_text())["rows"] if r["method"] == "specblock")
    assert row["spd_runs"] == pytest.approx([0.9 * row["spd_meas"], 1.2 * row["spd_meas"]])
    assert f"{0.9 * row['spd_meas']:.2f}-{1.2 * row['spd_meas']:.2f}x" in out.with_suffix(".md").read_text()
    rec = _rec(100, 41, 10.0).model_copy(update={"depth": 3})
    assert sf.depthwise_forwards(rec, {"name": "eagle3", "depth": 6}) == 6
    # ... unless the final rerank to the node budget could keep nothing deeper: the runtime stops there
    assert sf.depthwise_forwards(rec, {"name": "eagle3", "depth": 6, "top_k": 8, "budget": 2}) == 2
    assert sf.depthwise_forwards(rec, {"name": "sps", "gamma": 4}) == 3
    assert sf.depthwise_forwards(rec, {"name": "medusa"}) == 1


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


@pytest.mark.parametrize("calibrated_ms", [0.0, 0.5])
def test_drafting_cost_missing_from_the_latency_json_is_estimated_from_traces(tmp_path, calibrated_ms):
    """The traces' host work per forward is the whole of it, whatever calibrate's share was: the
    sim charged with it drafts what the "runtime" paid (not calibrate's 0.5 replaced by 1.0)."""
    bench, traces, lat = _make_inputs(tmp_path, draft_overhead_ms=1.5, calibrated_ms=calibrated_ms)
    out = tmp_path / "o"
    base = ["--bench", str(bench), "--traces", str(traces), "--latency", str(lat), "--requests", "30",
            "--n-seeds", "1", "--tree-pool", "512"]
    assert sf.main(base + ["--out", str(out)]) == 0
    plain = json.loads(out.with_suffix(".json").read_text())
    sb = next(r for r in plain["rows"] if r["method"] == "specblock")
    assert plain["draft_overhead_ms_traces"] == pytest.approx(1.5, abs=0.05)
    assert sb["spd_err"] > 0.02  # the sim drafts for free what the "runtime" paid
    assert sf.main(base + ["--out", str(out), "--draft-overhead", "traces"]) == 0
    fitted = json.loads(out.with_suffix(".json").read_text())
    sb2 = next(r for r in fitted["rows"] if r["method"] == "specblock")
    assert abs(sb2["spd_err"]) < 0.02 and sb2["draft_ms_sim"] == pytest.approx(sb2["draft_ms_meas"], rel=0.05)
    assert fitted["inputs"]["draft_overhead"] == "traces"


def _rec(ctx, n, verify_ms, commit_ms=0.3, draft_ms=0.0):
    from specblock.sim.traces import TraceRecord
    return TraceRecord.model_validate({
        "iter": 0, "ctx": ctx, "tree_size": n, "depth": 0, "accepted": 0, "draft_s": draft_ms / 1e3,
        "verify_s": verify_ms / 1e3, "commit_s": commit_ms / 1e3,
        "nodes": {"parent": [-1], "depth": [0], "rank": [-1], "bucket": [-1], "block": [-1], "correct": [1]}})


def test_trace_latency_fit_recovers_a_known_linear_latency():
    import numpy as np

    from specblock.sim.latency import CalibratedLatency, LatencyMeasurements
    from specblock.sim.tracelat import fit_trace_latency, latency_json

    rng = np.random.default_rng(0)
    tree_ms = lambda n, c: 6.0 + 0.08 * n + 0.004 * c
    ar_ms = lambda c: 6.5 + 0.003 * c
    trees = [_rec(int(c), int(n), tree_ms(n, c) * rng.normal(1, 0.02), commit_ms=0.5)
             for n, c in zip(rng.integers(2, 40, 400), rng.integers(100, 700, 400))]
    trees += [_rec(300, 10, 80.0, commit_ms=0.5)] * 3  # stalls: the robust refit drops them
    ars = [_rec(int(c), 1, ar_ms(c) - 0.1 - 0.02, commit_ms=0.1, draft_ms=0.02) for c in rng.integers(100, 700, 200)]
    fit = fit_trace_latency(trees, ars)
    assert fit.tree == pytest.approx((6.0, 0.08, 0.004), rel=0.05, abs=2e-4)
    assert fit.ar == pytest.approx((6.5, 0.003), rel=0.02, abs=1e-4)
    assert fit.glue_ms == pytest.approx(0.5, rel=1e-6)
    lat = CalibratedLatency(latency_json(LatencyMeasurements.model_validate(LATENCY), fit, {"specblock": 1.25}))
    for n, c in ((2, 150), (17, 400), (40, 650)):
        assert lat.target_ms(n, c) == pytest.approx(tree_ms(n, c), rel=0.03)
    # the sim prices an AR token as target_ms(1) + glue: that is the AR traces' per-token time
    assert lat.target_ms(1, 500) + lat.overhead_ms == pytest.approx(ar_ms(500), rel=0.01)
    assert lat.draft_ms("specblock", 5, 300) == pytest.approx(2.0 + 1.25)
    # a negative context slope is timing drift, not physics: refit without the context term
    drift = [_rec(c, 1, 7.0 - 0.002 * c + 0.1 * (i % 2), commit_ms=0.0) for i, c in enumerate(range(100, 700, 3))]
    assert fit_trace_latency(trees, drift).ar[1] == 0.0


def test_trace_latency_fit_of_a_compiled_run_prices_each_tree_by_its_bucket():
    """A compiled target pads a tree to its bucket, so its cost is a step in the tree size: the
    fit is made over buckets and the latency grid prices 5 and 6 nodes alike and 7 as 8. Fitted
    over sizes instead, the same traces overprice a 7-node tree (the trees served are 3-5 nodes)."""
    from specblock.buckets import bucket_of
    from specblock.sim.latency import CalibratedLatency, LatencyMeasurements
    from specblock.sim.tracelat import fit_trace_latency, latency_json

    step = lambda n: 8.0 + 0.7 * bucket_of(n)  # noqa: E731
    sizes = [2, 3, 4, 4, 5, 5, 9] * 30  # served trees of 3-5 nodes, a few long lookup chains
    trees = [_rec(200 + i % 50, n, step(n), commit_ms=0.1) for i, n in enumerate(sizes)]
    ars = [_rec(200 + i, 1, 8.5, commit_ms=0.1) for i in range(20)]
    fit = fit_trace_latency(trees, ars, buckets=BUCKETS)
    assert fit.tree[:2] == pytest.approx((8.0, 0.7), abs=1e-6)
    lat = CalibratedLatency(latency_json(LatencyMeasurements.model_validate(LATENCY), fit))
    for n in (5, 6, 7, 8, 11):
        assert lat.target_ms(n, 220) == pytest.approx(step(n), abs=0.05)
    linear = fit_trace_latency(trees, ars)
    assert abs(linear.tree_ms(7, 220) - step(7)) > 0.5


def test_latency_from_traces_is_leave_one_domain_out(tmp_path):
    bench, traces, lat = _make_inputs(tmp_path)
    b = json.loads(bench.read_text())
    # a second domain whose runtime ran 3x slower: its timings must price only the other domain
    for name in ("specblock", "ar", "lookup"):
        recs = [json.loads(x) for x in (traces / f"{name}.code.jsonl").read_text().splitlines() if x.strip()]
        for r in recs:
            r.update(domain="math", verify_s=3 * r["verify_s"], commit_s=3 * r["commit_s"])
        (traces / f"{name}.math.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    b["rows"] += [dict(r, domain="math") for r in b["rows"]]
    bench.write_text(json.dumps(b))
    out = tmp_path / "o"
    assert sf.main(["--bench", str(bench), "--traces", str(traces), "--latency", str(lat), "--requests", "10",
                    "--n-seeds", "1", "--tree-pool", "256", "--out", str(out), "--latency-from", "traces"]) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    assert res["trace_latency_split"] == "leave-one-domain-out" and res["inputs"]["latency_from"] == "traces"
    rows = {(r["method"], r["domain"]): r for r in res["rows"]}
    for (m, d), r in rows.items():
        assert r["latency_fit"]["fit_domains"] == [{"code": "math", "math": "code"}[d]]
    code, math = rows[("specblock", "code")], rows[("specblock", "math")]
    # code is priced by math's 3x slower verify, math by code's: the fitted glue says so
    assert code["glue_ms_sim"] == pytest.approx(3 * code["glue_ms_meas"], rel=0.05)
    assert math["glue_ms_sim"] == pytest.approx(math["glue_ms_meas"] / 3, rel=0.05)
    assert code["verify_ms_sim"] > 2 * code["verify_ms_meas"] and math["verify_ms_sim"] < 0.5 * math["verify_ms_meas"]
    assert "leave-one-domain-out" in out.with_suffix(".md").read_text()


def test_latency_from_traces_single_domain_is_in_sample_and_matches(tmp_path):
    bench, traces, lat = _make_inputs(tmp_path)
    out = tmp_path / "o"
    assert sf.main(["--bench", str(bench), "--traces", str(traces), "--latency", str(lat), "--requests", "30",
                    "--n-seeds", "1", "--tree-pool", "512", "--out", str(out), "--latency-from", "traces"]) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    assert res["trace_latency_split"].startswith("in-sample") and any("in-sample" in w for w in res["warnings"])
    sb = next(r for r in res["rows"] if r["method"] == "specblock")
    # the sim's own traces from a bilinear latency: the linear fit lands close to them
    assert sb["verify_ms_sim"] == pytest.approx(sb["verify_ms_meas"], rel=0.05)
    assert sb["ar_ms_sim"] == pytest.approx(sb["ar_ms_meas"], rel=0.03)
    assert abs(sb["spd_err"]) < sf.SPD_TOL


def test_a_bench_without_decode_speedup_is_judged_on_wall_time_with_a_warning(tmp_path):
    bench, traces, lat = _make_inputs(tmp_path)
    b = json.loads(bench.read_text())
    for r in b["rows"]:
        del r["speedup_decode"]
    bench.write_text(json.dumps(b))
    out = tmp_path / "o"
    assert sf.main(["--bench", str(bench), "--traces", str(traces), "--latency", str(lat), "--out", str(out),
                    "--requests", "30", "--n-seeds", "1", "--tree-pool", "512"]) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    sb = next(r for r in res["rows"] if r["method"] == "specblock")
    assert sb["spd_basis"] == "wall" and sb["spd_err"] > 0.15  # the sim has no prefill to pay
    assert any("speedup_decode" in w for w in res["warnings"])


def test_depthwise_drafter_without_calibrate_timing_is_priced_from_its_traces(tmp_path):
    """EAGLE-3 rows: calibrate does not time that drafter, so the calibrate mode skips them and
    the trace mode fits its all-in ms per forward (one forward per drafted depth)."""
    bench, traces, lat = _make_inputs(tmp_path)
    true = json.loads(json.dumps(LATENCY))
    true["drafters"]["eagle3"] = {"ms_per_forward": 1.5}
    (tmp_path / "lat_e3.json").write_text(json.dumps(true))
    (tmp_path / "dd" / "eagle3").mkdir()
    (tmp_path / "dd" / "eagle3" / "config.json").write_text(json.dumps({"depth": 4, "top_k": 3}))
    cfg = SimConfig.model_validate({
        "preset": "cpu-calibrated", "latency_file": str(tmp_path / "lat_e3.json"),
        "method": {"name": "eagle3", "depth": 4, "top_k": 3, "budget": 24},
        "acceptance": {"kind": "parametric", "a1": 0.8}, "workload": {"requests": PROMPTS, "tokens": TOKENS, "prompt_len": 100},
        "tree_pool": 0, "seed": 5})
    e3 = simulate(cfg, trace_out=str(traces / "eagle3.code.jsonl"))
    b = json.loads(bench.read_text())
    b["rows"].append({"method": "eagle3", "domain": "code", "speedup": e3["speedup"], "speedup_decode": e3["speedup"],
                      "tau": e3["tau"], "draft_share": 0.3, "mean_tree_size": e3["tree_size"], "new_tokens": PROMPTS * TOKENS})
    bench.write_text(json.dumps(b))
    out = tmp_path / "o"
    base = ["--bench", str(bench), "--traces", str(traces), "--latency", str(lat), "--requests", "30",
            "--n-seeds", "1", "--tree-pool", "512", "--out", str(out)]
    assert sf.main(base) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    assert any(s["method"] == "eagle3" and "no drafter 'eagle3'" in s["reason"] for s in res["skipped"])
    assert sf.main(base + ["--latency-from", "traces"]) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    row = next(r for r in res["rows"] if r["method"] == "eagle3")
    assert row["sim_method"]["depth"] == 4 and row["sim_method"]["top_k"] == 3  # from the drafter's config
    assert row["latency_fit"]["draft_ms_per_forward"] == pytest.approx(1.5, rel=0.02)
    assert row["draft_ms_sim"] == pytest.approx(row["draft_ms_meas"], rel=0.05)
    assert abs(row["tau_err"]) < sf.TAU_TOL and abs(row["spd_err"]) < sf.SPD_TOL


def test_robust_fit_drops_a_stall_that_moved_the_first_fit():
    """Eight stalled iterations (30x) among ninety: the first least-squares line lies above the
    bulk, and the refit must measure residuals from the bulk's centre to drop only the stall."""
    import numpy as np

    from specblock.sim.tracelat import robust_lstsq

    rng = np.random.default_rng(1)
    f = np.full(95, 4.0)
    y = 4.0 * 2.2 * rng.normal(1, 0.03, 95)
    y[30:38] = 290.0
    assert robust_lstsq(f[:, None], y)[0] == pytest.approx(2.2, rel=0.02)


def test_compiled_methods_are_judged_against_compiled_plain_decoding(tmp_path):
    """A bench with eager ``ar`` beside compiled rows (``ar@c``, ``specblock@c``): the compiled
    method's Spd, measured and simulated, is over ``ar@c``, and the sim's plain decoding is priced
    from ``ar@c``'s traces, not from eager ``ar`` (twice as slow here): the sim prices plain
    decoding and 1-node trees by one target, so eager AR made every compiled 1-node tree eager."""
    bench, traces, lat = _make_inputs(tmp_path)
    for name in ("specblock", "ar"):
        (traces / f"{name}@c.code.jsonl").write_text((traces / f"{name}.code.jsonl").read_text())
    recs = [json.loads(x) for x in (traces / "ar.code.jsonl").read_text().splitlines() if x.strip()]
    (traces / "ar.code.jsonl").write_text("".join(json.dumps(dict(r, verify_s=2 * r["verify_s"])) + "\n" for r in recs))
    b = json.loads(bench.read_text())
    rows = {r["method"]: r for r in b["rows"]}
    sb = rows["specblock"]
    b["rows"] = [rows["ar"], dict(rows["ar"], method="ar@c", speedup=2.0, speedup_decode=2.0),
                 dict(sb, method="specblock@c", speedup=2 * sb["speedup"], speedup_decode=2 * sb["speedup_decode"])]
    b["config"].update(set=["specblock@c:widths=2,4,6,4"],
                       method_options={"ar@c": {"compiled": True}, "specblock@c": {"compiled": True}})
    bench.write_text(json.dumps(b))
    assert sf.baseline(b["config"], ["ar", "ar@c", "specblock@c"], "specblock@c") == "ar@c"
    assert sf.baseline(dict(b["config"], compile=True), ["ar", "specblock"], "specblock") == "ar"  # all compiled
    out = tmp_path / "o"
    assert sf.main(["--bench", str(bench), "--traces", str(traces), "--latency", str(lat), "--requests", "30",
                    "--n-seeds", "1", "--tree-pool", "512", "--out", str(out), "--latency-from", "traces"]) == 0
    row = json.loads(out.with_suffix(".json").read_text())["rows"][0]
    assert (row["method"], row["baseline"]) == ("specblock@c", "ar@c")
    assert row["spd_meas"] == pytest.approx(sb["speedup_decode"], rel=1e-3) and row["goal_met"]
    assert row["ar_ms_sim"] == pytest.approx(row["ar_ms_meas"], rel=0.05)  # ar@c's, not eager ar's 2x
    assert row["latency_fit"]["buckets"] == list(BUCKETS)  # compiled trees priced by their padded size
    assert "judged against compiled plain decoding (ar@c" in out.with_suffix(".md").read_text()


def test_budget_sweep_moves_only_the_budget_from_the_fitted_sim(tmp_path):
    """experiments/budget_sweep_sim.py: the same fit as sim_fidelity, each method re-simulated at
    other node budgets; its served budget reproduces sim_fidelity's row, and smaller budgets grow
    smaller trees."""
    bspec = importlib.util.spec_from_file_location("budget_sweep_sim", ROOT / "experiments" / "budget_sweep_sim.py")
    bs = importlib.util.module_from_spec(bspec)
    bspec.loader.exec_module(bs)
    bench, traces, lat = _make_inputs(tmp_path)
    out = tmp_path / "sweep"
    assert bs.main(["--bench", str(bench), "--traces", str(traces), "--latency", str(lat), "--budgets", "2,24",
                    "--requests", "20", "--n-seeds", "1", "--tree-pool", "256", "--out", str(out)]) == 0
    rows = {r["budget"]: r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert set(rows) == {2, 24} and rows[24]["served"] and not rows[2]["served"]  # METHOD's engine budget is 24
    assert rows[2]["tree_sim"] <= 3 < rows[24]["tree_sim"] and rows[2]["tau_sim"] < rows[24]["tau_sim"]
    fid = tmp_path / "fid"
    assert sf.main(["--bench", str(bench), "--traces", str(traces), "--latency", str(lat), "--requests", "20",
                    "--n-seeds", "1", "--tree-pool", "256", "--out", str(fid), "--latency-from", "traces"]) == 0
    served = next(r for r in json.loads(fid.with_suffix(".json").read_text())["rows"] if r["method"] == "specblock")
    assert rows[24]["tau_sim"] == pytest.approx(served["tau_sim"], rel=1e-6)
    assert "| specblock |" in out.with_suffix(".md").read_text()
