"""--method auto: the target's fastest method by measurement (models.registry.best_method)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from specblock.errors import SpecBlockError
from specblock.models import registry
from tiny import experiment


@pytest.fixture()
def fake_target(tmp_path, monkeypatch):
    spec = dataclasses.replace(registry.MODELS["lab"], name="fake", drafters=tmp_path)
    monkeypatch.setitem(registry.MODELS, "fake", spec)
    return tmp_path


def test_auto_falls_back_to_lookup_then_follows_the_record(fake_target):
    assert registry.best_method("fake") == registry.FALLBACK_METHOD == "lookup"
    (fake_target / "best.json").write_text(json.dumps({"method": "eagle3"}))
    assert registry.best_method("fake") == "eagle3"
    from specblock.runtime.config import RunConfig

    assert RunConfig(target="fake", method="auto").method == "eagle3"
    assert RunConfig(target="fake", method="lookup").method == "lookup"  # an explicit choice stays
    (fake_target / "best.json").write_text(json.dumps({"method": "eagle3", "dtype": "packed-fp16"}))
    assert registry.best_method("fake", "packed-fp16") == registry.best_method("fake") == "eagle3"
    assert registry.best_method("fake", "bfloat16") == "lookup"  # measured in another dtype: not this one's record
    assert RunConfig(target="fake", method="auto", dtype="bfloat16").method == "lookup"
    assert RunConfig(target="fake", method="auto", dtype="packed-fp16").method == "eagle3"
    compiled = {"method": "eagle3", "dtype": "packed-fp16", "compiled": {"method": "ar"}}
    (fake_target / "best.json").write_text(json.dumps(compiled))
    assert registry.best_method("fake", "packed-fp16", compiled=True) == "ar"  # measured on the compiled target
    assert registry.best_method("fake", "packed-fp16") == "eagle3"
    assert RunConfig(target="fake", method="auto", dtype="packed-fp16", compile=True).method == "ar"
    assert RunConfig(target="fake", method="auto", dtype="bfloat16", compile=True).method == "lookup"
    # another dtype's own record (best_method.py writes it under other_dtypes): compiled only here
    (fake_target / "best.json").write_text(json.dumps({**compiled, "other_dtypes": {"packed-q4": {"compiled": {"method": "medusa"}}}}))
    assert registry.best_method("fake", "packed-q4", compiled=True) == "medusa"
    assert registry.best_method("fake", "packed-q4") == "lookup"  # no eager record in that dtype
    assert registry.best_method("fake", "packed-fp16", compiled=True) == "ar"
    assert registry.best_method("fake", "bfloat16", compiled=True) == "lookup"
    # q4: plain decoding measured fastest there (and on torch's kernel it is the one exact method)
    assert RunConfig(target="fake", method="auto", dtype="q4").method == "ar"
    assert RunConfig(target="fake", method="lookup", dtype="q4").method == "lookup"  # an explicit choice stays
    # the table's winner with prompt lookup's branch: its method, with --lookup-branch at the default unless given
    (fake_target / "best.json").write_text(json.dumps({"method": "eagle3+lookup", "dtype": "packed-fp16"}))
    auto = RunConfig(target="fake", method="auto", dtype="packed-fp16")
    assert (auto.method, auto.lookup_branch) == ("eagle3", 3)
    assert RunConfig(target="fake", method="auto", dtype="packed-fp16", lookup_branch=5).lookup_branch == 5
    assert RunConfig(target="fake", method="eagle3", dtype="packed-fp16").lookup_branch is None
    (fake_target / "best.json").write_text(json.dumps({"method": "specblock+lookup", "dtype": "packed-fp16"}))
    adapting = RunConfig(target="fake", method="auto", dtype="packed-fp16", adapt=True)  # the branch combines with it
    assert (adapting.method, adapting.lookup_branch, adapting.adapt) == ("specblock", 3, True)
    (fake_target / "best.json").write_text("{not json")
    with pytest.raises(SpecBlockError, match="best_method.py"):
        registry.best_method("fake")


def test_best_method_script_picks_the_highest_mean_among_runnable_methods(tmp_path):
    bm = experiment("best_method")
    row = lambda m, d, s: {"method": m, "domain": d, "speedup": s}
    bench = {"config": {"dtype": "float32"},
             "rows": [row("ar", "code", 1.0), row("ar", "chat", 1.0), row("lookup", "code", 1.3), row("lookup", "chat", 1.1),
                      row("eagle3", "code", 1.5), row("eagle3", "chat", 0.8), row("hf-lookup", "code", 9.0),
                      row("specblock@m1", "code", 9.0)]}
    assert bm.fastest(bench)[0] == "lookup"  # mean 1.2 beats eagle3's 1.15; peers and variants do not count
    branch = {**bench, "rows": bench["rows"] + [row("eagle3+lookup", "code", 1.4), row("eagle3+lookup", "chat", 1.2),
                                                row("ar+adapt", "code", 9.0)]}
    assert bm.fastest(branch)[0] == "eagle3+lookup"  # a drafter with the lookup branch is runnable by name
    f = tmp_path / "b.json"
    f.write_text(json.dumps(bench))
    assert bm.main([str(f), "--write", str(tmp_path)]) == 0
    rec = json.loads((tmp_path / "best.json").read_text())
    assert rec["method"] == "lookup" and rec["dtype"] == "float32"


def test_best_method_script_records_the_compiled_winner_beside_the_eager_one(tmp_path):
    bm = experiment("best_method")
    row = lambda m, s: {"method": m, "domain": "code", "speedup": s}
    bench = {"config": {"dtype": "packed-fp16"},
             "rows": [row("ar", 1.0), row("ar@c", 1.9), row("medusa", 1.2), row("medusa@c", 1.8), row("hf-lookup@c", 9.0)]}
    assert bm.fastest(bench) == ("medusa", {"ar": 1.0, "medusa": 1.2})
    assert bm.fastest(bench, compiled=True)[0] == "ar"
    f = tmp_path / "b.json"
    f.write_text(json.dumps(bench))
    with pytest.raises(SystemExit, match="eager table first"):
        bm.main([str(f), "--write", str(tmp_path), "--compiled"])
    (tmp_path / "best.json").write_text(json.dumps({"method": "parallelspec", "dtype": "packed-fp16"}))
    assert bm.main([str(f), "--write", str(tmp_path), "--compiled"]) == 0
    rec = json.loads((tmp_path / "best.json").read_text())
    assert rec["method"] == "parallelspec" and rec["compiled"]["method"] == "ar"
    assert "ar@c 1.90x" in rec["compiled"]["measured"]
    assert bm.main([str(f), "--write", str(tmp_path)]) == 0  # a new eager table keeps the compiled record
    rec = json.loads((tmp_path / "best.json").read_text())
    assert rec["method"] == "medusa" and rec["compiled"]["method"] == "ar"
    # a bench in another dtype: its own entry under other_dtypes, the packed-fp16 records kept
    f.write_text(json.dumps({**bench, "config": {"dtype": "packed-q4"},
                             "rows": [row("ar", 1.0), row("ar@c", 1.7), row("eagle3@c", 1.9)]}))
    assert bm.main([str(f), "--write", str(tmp_path), "--compiled"]) == 0
    rec = json.loads((tmp_path / "best.json").read_text())
    assert (rec["method"], rec["dtype"], rec["compiled"]["method"]) == ("medusa", "packed-fp16", "ar")
    assert rec["other_dtypes"]["packed-q4"]["compiled"]["method"] == "eagle3"
    assert bm.main([str(f), "--write", str(tmp_path)]) == 0
    rec = json.loads((tmp_path / "best.json").read_text())
    assert rec["other_dtypes"]["packed-q4"]["method"] == "ar" and rec["other_dtypes"]["packed-q4"]["compiled"]
    assert rec["method"] == "medusa"


def test_auto_follows_a_record_for_this_kind_of_cpu(fake_target, monkeypatch):
    """On a CPU whose tree rows cost more (a Zen 5 without AMX) compiled plain decoding can beat
    the method measured best elsewhere: best.json's overrides name the CPU kind they were measured on."""
    from specblock import cpu

    rec = {"method": "eagle3", "dtype": "packed-fp16", "compiled": {"method": "eagle3+lookup"},
           "other_dtypes": {"packed-q4-amx": {"method": "eagle3+lookup", "compiled": {"method": "eagle3+lookup"}}},
           "overrides": [{"cpu": "avx512-bf16", "dtype": "packed-q4-amx", "compiled": True, "method": "ar"},
                         {"cpu": "avx512-bf16", "dtype": "packed-q4-amx", "compiled": False, "method": "specblock"}]}
    (fake_target / "best.json").write_text(json.dumps(rec))
    monkeypatch.setattr(cpu, "cpu_kind", lambda: "avx512-bf16")
    assert registry.best_method("fake", "packed-q4-amx", compiled=True) == "ar"
    assert registry.best_method("fake", "packed-q4-amx") == "specblock"
    assert registry.best_method("fake", "packed-fp16", compiled=True) == "eagle3+lookup"  # another dtype: the record's
    monkeypatch.setattr(cpu, "cpu_kind", lambda: "amx")
    assert registry.best_method("fake", "packed-q4-amx", compiled=True) == "eagle3+lookup"
    assert registry.best_method("fake", "packed-q4-amx") == "eagle3+lookup"
    for bad in ({"method": "ar", "cpu": "zen5"}, {"cpu": "amx"}):
        (fake_target / "best.json").write_text(json.dumps({**rec, "overrides": [bad]}))
        with pytest.raises(SpecBlockError, match="zen5|each with a \"method\""):
            registry.best_method("fake", "packed-q4-amx")


def test_best_method_script_records_one_cpu_kinds_winner(tmp_path):
    bm = experiment("best_method")
    row = lambda m, s: {"method": m, "domain": "code", "speedup": s}
    bench = {"config": {"dtype": "packed-q4-amx"}, "cpu": "avx512-bf16",
             "rows": [row("ar", 1.0), row("ar@c", 1.9), row("eagle3+lookup@c", 1.8), row("eagle3+lookup", 1.2)]}
    f = tmp_path / "b.json"
    f.write_text(json.dumps(bench))
    with pytest.raises(SystemExit, match="for every CPU first"):
        bm.main([str(f), "--write", str(tmp_path), "--compiled", "--cpu", "avx512-bf16"])
    with pytest.raises(SystemExit, match="of kind avx512-bf16, not amx"):
        bm.main([str(f), "--write", str(tmp_path), "--compiled", "--cpu", "amx"])
    base = {"method": "eagle3", "dtype": "packed-fp16", "other_dtypes": {"packed-q4-amx": {"method": "eagle3+lookup"}}}
    (tmp_path / "best.json").write_text(json.dumps(base))
    for _ in range(2):  # a rerun replaces its own override
        assert bm.main([str(f), "--write", str(tmp_path), "--compiled", "--cpu", "avx512-bf16"]) == 0
    assert bm.main([str(f), "--write", str(tmp_path), "--cpu", "avx512-bf16"]) == 0
    rec = json.loads((tmp_path / "best.json").read_text())
    assert {k: rec[k] for k in base} == base  # the records for every CPU untouched
    assert [(o["cpu"], o["dtype"], o["compiled"], o["method"]) for o in rec["overrides"]] == [
        ("avx512-bf16", "packed-q4-amx", True, "ar"), ("avx512-bf16", "packed-q4-amx", False, "eagle3+lookup")]
    assert "ar@c 1.90x" in rec["overrides"][0]["measured"]
    f.write_text(json.dumps({**bench, "config": {"dtype": "packed-fp16"}}))
    assert bm.main([str(f), "--write", str(tmp_path)]) == 0  # a new table for every CPU keeps them
    assert len(json.loads((tmp_path / "best.json").read_text())["overrides"]) == 2
