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
    assert bench["config"]["split"] == "tune"  # not the prompts the bench's tables report
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
                      (["--target", "lab", "--methods", "nosuch"], "nosuch"),
                      (["--target", "lab", "--prompts", "9"], "--prompts 8 or fewer")]:
        code, _, err = run_cli(capsys, "tune", *argv)
        assert code == 2 and why in err.strip().splitlines()[-1] and "Traceback" not in err, (argv, err)
    assert not (home / "tuned").exists() or not any((home / "tuned").rglob("best.json"))  # nothing half-written


def test_candidates_name_each_budget_of_a_tree_drafter():
    from types import SimpleNamespace

    from specblock.runtime.tune import candidates

    args = SimpleNamespace(methods="lookup,eagle3,specblock+lookup", budgets="2,1", compile=False)
    assert candidates(args) == {"ar": ("ar", None), "lookup": ("lookup", None), "eagle3@b1": ("eagle3", 1),
                                "eagle3@b2": ("eagle3", 2), "specblock+lookup@b1": ("specblock+lookup", 1),
                                "specblock+lookup@b2": ("specblock+lookup", 2)}
    args.compile = True
    assert set(candidates(args)) == {"ar@c", "lookup@c", "eagle3@c1", "eagle3@c2", "specblock+lookup@c1",
                                     "specblock+lookup@c2"}
    args.budgets = None
    assert candidates(args) == {"ar@c": ("ar", None), "lookup@c": ("lookup", None), "eagle3@c": ("eagle3", None),
                                "specblock+lookup@c": ("specblock+lookup", None)}
    for bad in ("0", "1,x", "300", ","):
        args.budgets = bad
        with pytest.raises(SpecBlockError, match="--budgets"):
            candidates(args)


def test_tune_budgets_records_the_winners_budget_for_its_drafter(home, monkeypatch, capsys):
    """The bench's rows are made up here (which budget wins a real run on the lab model is up to its
    timing): the winner's budget goes to its drafter's tuned serving.json, which the shipped drafter reads."""
    from specblock.runtime import bench, drafters
    from specblock.runtime.target import TargetModel

    def fake_run(b):
        b.dtype = "float32"
        spd = {"ar": 1.0, "specblock@b1": 1.1, "specblock@b2": 1.3, "specblock+lookup@b1": 1.2,
               "specblock+lookup@b2": 9.0}
        return {"config": {}, "rows": [{"method": m, "domain": "code", "speedup": v, "tau": 1.0, "draft_share": 0.1,
                                        "match_rate": 0.5 if m == "specblock+lookup@b2" else 1.0}  # inexact: dropped
                                       for m, v in spd.items()]}

    monkeypatch.setattr(bench, "run_bench", fake_run)
    monkeypatch.setattr(bench, "write_outputs", lambda result, out: [out.with_suffix(s) for s in bench.RESULT_SUFFIXES])
    code, out, err = run_cli(capsys, "tune", "--target", "lab", "--methods", "specblock,specblock+lookup",
                             "--budgets", "1,2", "--dtype", "float32")
    assert code == 0, err
    f = registry.tuned_record("lab")
    (o,) = json.loads((f.parent / "specblock" / "serving.json").read_text())["overrides"]
    assert (o["budget"], o["dtype"], o["compiled"], o["cpu_model"]) == (2, "float32", False, cpu.cpu_model())
    assert registry.best_method("lab", "float32") == "specblock" and "node budget 2" in out
    target = TargetModel.load(registry.resolve_target("lab"), "float32", "cpu")
    assert drafters.serving_settings("specblock", target, {})["budget"] == 2
    assert drafters.serving_settings("specblock", target, {"budget": 7})["budget"] == 7  # a flag still wins
    folder = registry.MODELS["lab"].drafters / "specblock"
    shipped = drafters.read_serving(folder / "serving.json", target)
    assert drafters.serving_settings("specblock", target, {"drafter": folder}) == {**shipped, "drafter": folder}
    assert drafters.serving_settings("specblock", TargetModel.load(registry.resolve_target("lab"), "bfloat16", "cpu"),
                                     {}).get("budget") == shipped.get("budget")  # tuned in float32 only


def test_a_tuned_budget_drops_the_shipped_warm_sizes(home, monkeypatch):
    from types import SimpleNamespace

    from specblock.runtime.drafters import over_tuned

    lab = registry.resolve_target("lab")
    target = SimpleNamespace(model=SimpleNamespace(name_or_path=str(lab)), dtype_name="float32", compiled=True)
    g = registry.tuned_record("lab").parent / "eagle3" / "serving.json"
    g.parent.mkdir(parents=True)
    here = {"cpu": cpu.cpu_kind(), "cpu_model": cpu.cpu_model(), "dtype": "float32", "compiled": True}
    g.write_text(json.dumps({"overrides": [{**here, "budget": 3}]}))
    saved = {"budget": 2, "warm_sizes": [1, 3]}
    assert over_tuned(saved, "eagle3", target) == {"budget": 3}
    assert over_tuned({"budget": 3, "warm_sizes": [1, 4]}, "eagle3", target) == {"budget": 3, "warm_sizes": [1, 4]}
    assert over_tuned(saved, "specblock", target) == saved  # nothing tuned for that drafter
    monkeypatch.setattr(cpu, "cpu_model", lambda: "another CPU")
    assert over_tuned(saved, "eagle3", target) == saved
