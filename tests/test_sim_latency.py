"""Latency models: roofline presets, the paper preset, the calibrated JSON format and its fit."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pydantic import ValidationError

from specblock.sim.latency import CalibratedLatency, LatencyMeasurements, load_measurements
from specblock.sim.presets import MODELS, latency_preset, preset_names


def test_kv_bytes_from_public_configs():
    assert MODELS["llama3.1-8b"].kv_bytes_per_token == 128 * 1024
    assert MODELS["qwen3-8b"].kv_bytes_per_token == 144 * 1024
    assert MODELS["qwen3-32b"].kv_bytes_per_token == 256 * 1024


@pytest.mark.parametrize("name", [n for n in preset_names() if n not in ("paper", "cpu-calibrated", "table")])
def test_roofline_presets_are_memory_bound_and_grow(name):
    lat, _ = latency_preset(name)
    t1 = lat.target_ms(1, 512)
    assert 3 < t1 < 60
    assert lat.target_ms(64, 512) >= t1 and lat.target_ms(1, 8192) > t1
    assert lat.target_ms(2048, 512) > 2 * t1  # compute-bound eventually
    for d in ("eagle3", "specblock", "medusa", "sps"):
        assert 0 < lat.draft_ms(d, 1, 512) < t1


def test_a100_llama_roofline_number():
    lat, target = latency_preset("a100-llama3.1-8b")
    # 16.06 GB weights + 512 * 128 KiB KV over 2039 GB/s * 0.8, plus 32 layers * 15 us launch.
    want = 1e3 * (8.03e9 * 2 + 512 * 131072) / (2039e9 * 0.8) + 0.48
    assert target == "llama3.1-8b" and lat.target_ms(1, 512) == pytest.approx(want, rel=1e-6)


def test_paper_preset_reproduces_digest_breakdown():
    lat, _ = latency_preset("paper")
    assert lat.target_ms(60, 0) == pytest.approx(37.0)
    assert 7 * lat.draft_ms("eagle3", 10, 0) == pytest.approx(17.0)
    assert 2 * lat.draft_ms("specblock", 4, 0) == pytest.approx(7.0)


def _meas(**kw) -> dict:
    d = {"device": "cpu", "dtype": "float32", "overhead_ms": 0.5,
         "target": {"ctx": [64, 512], "n": [1, 8, 32], "ms": [[10, 12, 20], [14, 16, 26]]},
         "drafters": {"specblock": {"ms_per_forward": 2.0, "n_query": [1, 8], "ms": [2.0, 3.0]},
                      "eagle3": {"ms_per_forward": 1.5}}}
    d.update(kw)
    return d


def test_calibrated_fit_interpolates_grid_and_extrapolates(tmp_path):
    p = tmp_path / "lat.json"
    p.write_text(json.dumps(_meas()))
    lat = CalibratedLatency(load_measurements(p))
    assert lat.target_ms(8, 512) == pytest.approx(16)
    assert lat.target_ms(20, 288) == pytest.approx((16 + 21) / 2)  # halfway in n, then in ctx
    assert lat.target_ms(64, 2048) > lat.target_ms(32, 512)  # bilinear fit beyond the grid
    assert lat.draft_ms("specblock", 4, 100) == pytest.approx(2 + 3 / 7)
    assert lat.draft_ms("eagle3", 10, 100) == 1.5
    assert lat.overhead_ms == 0.5 and lat.fit.max_rel_residual < 0.1
    with pytest.raises(KeyError):
        lat.draft_ms("medusa", 1, 0)


def test_bad_latency_json(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_measurements(tmp_path / "missing.json")
    with pytest.raises(ValidationError):
        LatencyMeasurements.model_validate(_meas(target={"ctx": [64], "n": [1, 2], "ms": [[1.0]]}))
    with pytest.raises(ValidationError):
        LatencyMeasurements.model_validate(_meas(overhead_ms=-1))


def test_cpu_calibrated_preset_runs_from_a_latency_file(tmp_path):
    from specblock.sim.config import SimConfig
    from specblock.sim.engine import simulate

    p = tmp_path / "lat.json"
    p.write_text(json.dumps(_meas()))
    cfg = SimConfig.model_validate({"preset": "cpu-calibrated", "latency_file": str(p), "tree_pool": 16,
                                    "acceptance": {"kind": "parametric", "a1": 0.8},
                                    "workload": {"requests": 2, "tokens": 32, "prompt_len": 64}})
    res = simulate(cfg)
    assert res["ar_tpot_ms"] > 10.5 and res["tau"] > 1


def test_cpu_calibrated_without_file_says_how_to_make_one(monkeypatch, tmp_path):
    from specblock.sim import presets

    monkeypatch.setattr(presets, "DEFAULT_CPU_JSON", tmp_path / "latency_cpu.json")
    with pytest.raises(FileNotFoundError, match="specblock.runtime calibrate"):
        latency_preset("cpu-calibrated")


def test_specblock_curve_is_read_in_query_positions(tmp_path):
    """calibrate labels a later block with S seeds n_query = S*K; the forward runs S*(K+1)
    positions, which is what the sim's SpecBlock model reports (issue 7)."""
    sb = {"ms_per_forward": 5.0, "n_query": [4, 8, 12, 16], "ms": [5.0, 5.2, 5.6, 6.2], "K": 4}
    p = tmp_path / "lat.json"
    p.write_text(json.dumps(_meas(drafters={"specblock": sb})))
    lat = CalibratedLatency(load_measurements(p))
    for seeds, ms in zip((1, 2, 3, 4), sb["ms"]):
        assert lat.draft_ms("specblock", seeds * 5, 256) == pytest.approx(ms)
    # Beyond the curve the last segment's slope continues (not a scaling proportional to queries).
    assert lat.draft_ms("specblock", 30, 256) == pytest.approx(6.2 + 0.6 / 5 * 10)
    p.write_text(json.dumps(_meas(drafters={"specblock": dict(sb, overhead_ms=0.7)})))
    assert CalibratedLatency(load_measurements(p)).draft_ms("specblock", 10, 256) == pytest.approx(5.9)


def test_a_compiled_first_block_is_priced_apart_from_later_blocks(tmp_path):
    """calibrate times SpecBlock's block 1 (``first_ms``: compiled beside eager later blocks where
    serving.json names drafter_compiled): a step's first forward costs that, later ones the curve;
    a wider first forward (a batch) keeps the curve's slope from there."""
    sb = {"ms_per_forward": 5.0, "n_query": [4, 8, 12, 16], "ms": [5.0, 5.2, 5.6, 6.2], "K": 4,
          "overhead_ms": 0.5, "first_ms": 3.0, "compiled": True}
    p = tmp_path / "lat.json"
    p.write_text(json.dumps(_meas(drafters={"specblock": sb})))
    lat = CalibratedLatency(load_measurements(p))
    assert lat.draft_ms("specblock", 5, 256, first=True) == pytest.approx(3.5)
    assert lat.draft_ms("specblock", 5, 256) == pytest.approx(5.5)
    assert lat.draft_ms("specblock", 10, 256, first=True) == pytest.approx(5.2 - 2.0 + 0.5)
    flat = {"ms_per_forward": 2.0, "first_ms": 1.5}
    p.write_text(json.dumps(_meas(drafters={"specblock": flat})))
    lat = CalibratedLatency(load_measurements(p))
    assert lat.draft_ms("specblock", 5, 256, first=True) == pytest.approx(1.5)
    assert lat.draft_ms("specblock", 5, 256) == pytest.approx(2.0)


def test_sim_specblock_forwards_count_seed_positions():
    from specblock.policies.branching import TopKBranching
    from specblock.sim.acceptance import ParametricShape
    from specblock.sim.methods import SpecBlockDrafter

    d = SpecBlockDrafter(policy=TopKBranching(k=2), K=4, M=3, max_seeds=2, budget=200)
    out = d.draft(np.random.default_rng(0), ParametricShape().rank_model(0.5))
    assert out.forwards == [5, 10, 10]  # [root, 4 queries], then 2 seeds x [seed, 4 queries]
