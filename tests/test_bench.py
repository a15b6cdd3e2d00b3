"""The benchmark harness: every method and domain gets a row, AR is the baseline, files are written."""

import json

from specblock.runtime.cli import main
from tiny import save_tiny


def test_bench_writes_table_and_files(tmp_path, capsys):
    save_tiny(tmp_path / "t", "llama", vocab=96, ctx=2048)
    out = tmp_path / "res" / "bench"
    code = main(["bench", "--target", str(tmp_path / "t"), "--methods", "lookup,random", "--domains", "code,chat",
                 "--prompts", "1", "--max-new-tokens", "8", "--runs", "2", "--dtype", "float32", "--out", str(out)])
    assert code == 0
    res = json.loads(out.with_suffix(".json").read_text())
    rows = {(r["method"], r["domain"]): r for r in res["rows"]}
    assert set(rows) == {(m, d) for m in ("ar", "lookup", "random") for d in ("code", "chat")}
    assert all(r["match_rate"] == 1.0 for r in rows.values())  # fp32: every method equals AR
    assert all(r["speedup"] == 1.0 and r["speedup_decode"] == 1.0 for (m, _), r in rows.items() if m == "ar")
    # decode-loop Spd (what the simulator models) and prefill: measured for every method, positive
    assert all(r["speedup_decode"] > 0 and r["prefill_ms"] > 0 for r in rows.values())
    for suffix in (".csv", ".md", ".png"):
        assert out.with_suffix(suffix).stat().st_size > 0
    assert "| lookup |" in capsys.readouterr().out


def test_per_method_engine_budget(tmp_path):
    save_tiny(tmp_path / "t", "llama", vocab=96, ctx=2048)
    out = tmp_path / "b"
    assert main(["bench", "--target", str(tmp_path / "t"), "--methods", "random,random@b2", "--domains", "code",
                 "--prompts", "1", "--max-new-tokens", "6", "--runs", "1", "--dtype", "float32", "--budget", "12",
                 "--set", "random@b2:budget=2", "--out", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert rows["random@b2"]["mean_tree_size"] <= 3 < rows["random"]["mean_tree_size"]  # root + at most 2 nodes
    # --budget holds for every method without its own (it was dropped: the options carried budget=None)
    assert main(["bench", "--target", str(tmp_path / "t"), "--methods", "random", "--domains", "code", "--prompts", "1",
                 "--max-new-tokens", "6", "--runs", "1", "--dtype", "float32", "--budget", "4", "--out", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert 1 < rows["random"]["mean_tree_size"] <= 5


def test_best_budgets_picks_the_fastest_budget_per_method(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "experiments" / "best_budgets.py"
    spec = importlib.util.spec_from_file_location("best_budgets", path)
    bb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bb)
    row = lambda m, d, s, dec: {"method": m, "domain": d, "speedup": s, "speedup_decode": dec}
    bench = {"rows": [row("ar", "code", 1, 1), row("eagle3@b8", "code", 0.9, 0.8), row("eagle3@b8", "chat", 0.9, 0.8),
                      row("eagle3@b16", "code", 0.8, 0.9), row("eagle3@b16", "chat", 0.8, 0.95),
                      row("specblock@b24", "code", 1.1, 1.2)]}
    best, means = bb.best_budgets(bench)
    assert best == {"eagle3": 16, "specblock": 24}  # decode-loop Spd decides, not the wall-clock one
    f = tmp_path / "b.json"
    f.write_text(json.dumps(bench))
    assert bb.main([str(f)]) == 0
    assert capsys.readouterr().out.split() == ["--set", "eagle3:budget=16", "--set", "specblock:budget=24"]
    assert bb.main([str(f), "--alias", "specblock+adapt=specblock"]) == 0  # an unswept variant: its family's
    assert capsys.readouterr().out.split()[-2:] == ["--set", "specblock+adapt:budget=24"]
    assert bb.main([str(f), "--alias", "x=medusa"]) == 2
    assert bb.main([str(tmp_path / "none.json")]) == 2
    # serving.json for each swept drafter present in the directory; M = 1 where its sweep won
    bench["rows"] += [row("specblock@m1@b8", "code", 1.3, 1.3)]
    f.write_text(json.dumps(bench))
    drafters = tmp_path / "drafters"
    (drafters / "eagle3").mkdir(parents=True)
    (drafters / "specblock").mkdir()
    assert bb.main([str(f), "--write-serving", str(drafters)]) == 0
    assert json.loads((drafters / "eagle3" / "serving.json").read_text())["budget"] == 16
    sb = json.loads((drafters / "specblock" / "serving.json").read_text())
    assert (sb["budget"], sb["M"]) == (8, 1)
    assert not (drafters / "medusa").exists()
    # a fixed top-4 sweep that beats both writes its widths instead
    bench["rows"] += [row("specblock@topk4@b4", "code", 1.4, 1.4)]
    f.write_text(json.dumps(bench))
    assert bb.main([str(f), "--write-serving", str(drafters)]) == 0
    sb = json.loads((drafters / "specblock" / "serving.json").read_text())
    assert (sb["budget"], sb["widths"], "M" in sb) == (4, [4, 4, 4, 4], False)
    # the settings a variant ran with (the bench's method options) are what serving.json records
    bench["config"] = {"method_options": {"specblock@topk4@b4": {"budget": 4, "widths": [4, 4, 4, 4], "M": 1}}}
    f.write_text(json.dumps(bench))
    assert bb.main([str(f), "--write-serving", str(drafters)]) == 0
    sb = json.loads((drafters / "specblock" / "serving.json").read_text())
    assert (sb["budget"], sb["widths"], sb["M"]) == (4, [4, 4, 4, 4], 1)
    assert bb.main([str(f), "--alias", "specblock@m1=specblock"]) == 0  # a variant gets a --set line only as an alias
    assert "specblock@topk4" not in capsys.readouterr().out


def test_bench_adapt_row_is_lossless_and_restarts_from_theta0_each_run(tmp_path):
    from specblock.runtime.drafters.specblock_net import SpecBlockConfig, SpecBlockNet
    from specblock.runtime.target import default_taps
    from tiny import tiny_model

    save_tiny(tmp_path / "t", "llama", vocab=96, ctx=2048)
    net = SpecBlockNet(SpecBlockConfig(vocab_size=96, hidden_size=32, num_heads=4, intermediate_size=64,
                                       tap_layers=default_taps(2)))
    net.tie_to_target(tiny_model("llama", vocab=96, ctx=2048))
    net.save(tmp_path / "d")
    out = tmp_path / "b"
    assert main(["bench", "--target", str(tmp_path / "t"), "--methods", "specblock,specblock+adapt", "--domains", "code",
                 "--prompts", "2", "--max-new-tokens", "12", "--runs", "2", "--dtype", "float32",
                 "--set", f"specblock:drafter={tmp_path / 'd'}", "--set", f"specblock+adapt:drafter={tmp_path / 'd'}",
                 "--set", "specblock+adapt:adapt_window=3", "--out", str(out)]) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    rows = {r["method"]: r for r in res["rows"]}
    assert rows["specblock+adapt"]["match_rate"] == 1.0 and rows["specblock+adapt"]["tau"] >= 1.0
    summary = res["adapt"]["specblock+adapt"]
    # the last run's adapter only: windows of one run's 2 prompts, not of both runs
    iters_per_run = rows["specblock+adapt"]["new_tokens"] / rows["specblock+adapt"]["tau"]
    assert 1 <= summary["adapt_windows"] <= iters_per_run / 3 + 1


def test_compiled_and_eager_methods_in_one_run(tmp_path, capsys, monkeypatch):
    """``--set METHOD:compiled=true`` puts one method on the compiled target (the same model's
    weights), so compiled and eager decoding are timed interleaved in one run; every other method
    stays eager, and HF generate peers refuse the option. The static target here runs its padded
    step eagerly (``compile=False``): the routing is under test, not inductor."""
    from specblock.compiled.target import StaticTarget
    from specblock.runtime import cli
    from tiny import run_cli

    built = []

    class Counting(StaticTarget):
        def tree_forward(self, tree):
            self.forwards += 1
            return super().tree_forward(tree)

    def fake_compile(target, compile, mode="whole"):
        assert compile and mode == "whole"
        built.append(Counting.wrap(target, compile=False))
        built[-1].forwards = 0
        return built[-1]

    monkeypatch.setattr(cli, "maybe_compile", fake_compile)
    save_tiny(tmp_path / "t", "llama", vocab=96, ctx=2048)
    out = tmp_path / "c"
    assert main(["bench", "--target", str(tmp_path / "t"), "--methods", "ar,lookup,ar@c,lookup@c", "--domains", "code",
                 "--prompts", "1", "--max-new-tokens", "8", "--runs", "1", "--dtype", "float32",
                 "--set", "ar@c:compiled=true", "--set", "lookup@c:compiled=true", "--out", str(out)]) == 0
    assert len(built) == 1 and built[0].forwards > 0  # one compiled target, shared by both @c methods
    rows = {r["method"]: r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert set(rows) == {"ar", "lookup", "ar@c", "lookup@c"} and all(r["match_rate"] == 1.0 for r in rows.values())
    n = built[0].forwards
    assert main(["bench", "--target", str(tmp_path / "t"), "--methods", "lookup", "--domains", "code", "--prompts", "1",
                 "--max-new-tokens", "8", "--runs", "1", "--dtype", "float32", "--out", str(out)]) == 0
    assert len(built) == 1 and built[0].forwards == n  # no compiled=true: nothing compiled, nothing routed there
    code, _, err = run_cli(capsys, "bench", "--target", tmp_path / "t", "--methods", "hf-lookup", "--domains", "code",
                           "--prompts", "1", "--set", "hf-lookup:compiled=true", "--out", out)
    assert code != 0 and "compiled=true is for this project's methods" in err


def test_missing_shared_data_is_one_line(tmp_path, monkeypatch, capsys):
    """The bench's prompts come from the shared data; where it is not found, one line names the setting."""
    from tiny import run_cli

    monkeypatch.setenv("SPECBLOCK_DATA", str(tmp_path / "nowhere"))
    code, _, err = run_cli(capsys, "bench", "--target", "lab", "--methods", "ar", "--prompts", "1", "--runs", "1",
                           "--max-new-tokens", "2", "--dtype", "float32", "--out", tmp_path / "b")
    assert code == 2 and "SPECBLOCK_DATA" in err.strip().splitlines()[-1] and "Traceback" not in err
    assert not list(tmp_path.glob("b.*"))  # nothing half-written
