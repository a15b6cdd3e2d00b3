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
