"""``tune``: --method auto's candidates measured on this machine, the fastest recorded for this CPU,
dtype and mode under $SPECBLOCK_HOME, read before the shipped record."""

from __future__ import annotations

import json

import pytest

from specblock import cpu
from specblock.errors import SpecBlockError
from specblock.models import registry
from specblock.runtime.config import RunConfig
from specblock.runtime.tune import fastest
from tiny import run_cli


@pytest.fixture()
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECBLOCK_HOME", str(tmp_path))
    return tmp_path


def test_tune_records_the_fastest_exact_candidate_for_this_machine(home, capsys):
    argv = ["tune", "--target", "lab", "--methods", "lookup,random", "--domains", "code,chat", "--prompts", "1",
            "--runs", "1", "--max-new-tokens", "6", "--dtype", "float32"]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    f = registry.tuned_record("lab")
    assert f == home / "tuned" / "lab" / "best.json"
    bench = json.loads((f.parent / "bench_float32_eager.json").read_text())
    best, means = fastest(bench)
    assert set(means) == {"ar", "lookup", "random"}  # plain decoding is a candidate too
    (o,) = json.loads(f.read_text())["overrides"]
    assert (o["method"], o["dtype"], o["compiled"], o["cpu"], o["cpu_model"]) == (
        best, "float32", False, cpu.cpu_kind(), cpu.cpu_model())
    assert registry.best_method("lab", "float32") == best and f"now runs {best}" in out
    assert RunConfig(target="lab", method="auto", dtype="float32").method == best
    assert registry.best_method("lab", "float32", compiled=True) == registry.FALLBACK_METHOD  # not tuned compiled
    assert registry.best_method("lab", "bfloat16") == registry.FALLBACK_METHOD  # nor in another dtype
    assert run_cli(capsys, *argv)[0] == 0  # a rerun replaces its own record
    assert len(json.loads(f.read_text())["overrides"]) == 1


def test_a_tuned_record_holds_on_its_own_cpu_only(home, monkeypatch):
    f = registry.tuned_record("lab")
    f.parent.mkdir(parents=True)
    rec = {"cpu": cpu.cpu_kind(), "cpu_model": cpu.cpu_model(), "dtype": "float32", "compiled": False}
    f.write_text(json.dumps({"overrides": [{**rec, "method": "random"}, {**rec, "compiled": True, "method": "ar"}]}))
    assert registry.best_method("lab", "float32") == "random"
    assert registry.best_method("lab", "float32", compiled=True) == "ar"
    # at q4 auto runs plain decoding unless a record for this CPU says otherwise
    f.write_text(json.dumps({"overrides": [{**rec, "dtype": "q4", "method": "random"}]}))
    assert RunConfig(target="lab", method="auto", dtype="q4").method == "random"
    f.write_text(json.dumps({"overrides": [{**rec, "method": "random"}]}))
    monkeypatch.setattr(cpu, "cpu_model", lambda: "another CPU of the same kind")
    assert registry.best_method("lab", "float32") == registry.FALLBACK_METHOD
    assert RunConfig(target="lab", method="auto", dtype="q4").method == "ar"
    f.write_text("[1, 2]")
    with pytest.raises(SpecBlockError, match="not a valid best-method record"):
        registry.best_method("lab", "float32")


def test_fastest_skips_a_candidate_that_differed_from_plain_decoding():
    row = lambda m, s, match=1.0: {"method": m, "domain": "code", "speedup": s, "match_rate": match}
    bench = {"rows": [row("ar", 1.0), row("lookup", 1.3), row("eagle3", 1.5, 0.9), row("hf-lookup", 9.0),
                      row("ar@c", 1.6), row("eagle3@c", 1.8, 0.5), row("lookup@c", 1.7)]}
    assert fastest(bench) == ("lookup", {"ar": 1.0, "lookup": 1.3})
    assert fastest(bench, compiled=True)[0] == "lookup"
    with pytest.raises(SpecBlockError, match="identical to plain decoding"):
        fastest({"rows": [row("eagle3", 1.5, 0.9)]})


def test_tune_refuses_bad_input_in_one_line(home, tmp_path, capsys):
    for argv, why in [(["--target", str(tmp_path / "nowhere")], "--target"),
                      (["--target", "lab", "--runs", "0"], "at least 1"),
                      (["--target", "lab", "--methods", ","], "names no method"),
                      (["--target", "lab", "--methods", "nosuch"], "nosuch")]:
        code, _, err = run_cli(capsys, "tune", *argv)
        assert code == 2 and why in err.strip().splitlines()[-1] and "Traceback" not in err, (argv, err)
    assert not (home / "tuned").exists() or not any((home / "tuned").rglob("best.json"))  # nothing half-written
