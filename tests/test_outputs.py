"""Nothing a run wrote before is lost: output paths are checked before any work, files are
replaced atomically only by a run that completed, and bench result names keep their dots."""

import json
import os
import signal
import tempfile
from pathlib import Path

import pytest

from specblock.atomic import AtomicFiles, atomic_open, check_output, write_atomic
from specblock.errors import SpecBlockError
from specblock.runtime import bench
from tiny import save_tiny
from tiny import run_cli as cli


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("out") / "m", "llama", vocab=96, ctx=2048)



def leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith("."))


def test_atomic_open_keeps_the_old_file_when_the_writer_fails(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("old")
    for exc in (RuntimeError, KeyboardInterrupt):
        with pytest.raises(exc):
            with atomic_open(f) as h:
                h.write("half of the new")
                raise exc()
        assert f.read_text() == "old"
    write_atomic(f, "new")
    assert f.read_text() == "new" and leftovers(tmp_path) == []


def test_ctrl_c_the_instant_the_temporary_file_exists_leaves_nothing_behind(tmp_path, monkeypatch):
    """CI once found ``.x.json.XXXX.tmp`` after Ctrl-C during a sweep: the signal landed after
    mkstemp created the file and before its name reached the handler that removes it."""
    real = tempfile.mkstemp

    def mkstemp_then_ctrl_c(*a, **kw):
        made = real(*a, **kw)
        os.kill(os.getpid(), signal.SIGINT)  # os.kill runs Python's signal handlers before it returns
        return made

    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        monkeypatch.setattr(tempfile, "mkstemp", mkstemp_then_ctrl_c)
        with pytest.raises(KeyboardInterrupt):
            write_atomic(tmp_path / "x.json", "{}")
        with pytest.raises(KeyboardInterrupt):
            check_output(tmp_path / "y.json", "--out")
    finally:
        signal.signal(signal.SIGINT, old)
    assert leftovers(tmp_path) == [] and not (tmp_path / "x.json").exists()


def test_atomic_files_commit_together_or_not_at_all(tmp_path):
    (tmp_path / "a.jsonl").write_text("old a\n")
    with pytest.raises(ValueError):
        with AtomicFiles(tmp_path) as files:
            files.get("a.jsonl").write("new a\n")
            files.get("b.jsonl").write("new b\n")
            raise ValueError
    assert (tmp_path / "a.jsonl").read_text() == "old a\n" and not (tmp_path / "b.jsonl").exists()
    with AtomicFiles(tmp_path) as files:
        files.get("a.jsonl").write("new a\n")
        files.get("a.jsonl").write("more a\n")
    assert (tmp_path / "a.jsonl").read_text() == "new a\nmore a\n" and leftovers(tmp_path) == []
    assert AtomicFiles(None).get("x") is None


@pytest.mark.parametrize("case,needle", [("dir", "is a directory"), ("missing", "does not exist"),
                                         ("under_file", "is not a directory")])
def test_check_output_refuses_places_it_cannot_write(tmp_path, case, needle):
    (tmp_path / "file").write_text("x")
    path = {"dir": tmp_path, "missing": tmp_path / "no" / "t.jsonl", "under_file": tmp_path / "file" / "t.jsonl"}[case]
    with pytest.raises(SpecBlockError, match=needle):
        check_output(path, "--trace")


def test_trace_survives_a_run_that_fails_and_is_replaced_by_one_that_works(model_dir, tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"earlier": "run"}\n')
    for bad in (["--method", "foo"], ["--max-new-tokens", "0"], ["--drafter", tmp_path / "none", "--method", "specblock"]):
        code, _, err = cli(capsys, "--target", model_dir, "--prompt", "abc", "--trace", trace, *bad)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert trace.read_text() == '{"earlier": "run"}\n'
    code, _, err = cli(capsys, "--target", model_dir, "--prompt", "abcabc", "--trace", trace, "--method", "lookup",
                       "--max-new-tokens", 6, "--dtype", "float32", "--json")
    assert code == 0, err
    recs = [json.loads(x) for x in trace.read_text().splitlines()]
    assert recs and all("tree_size" in r for r in recs) and leftovers(tmp_path) == []


@pytest.mark.parametrize("where", ["dir", "missing_parent"])
def test_trace_to_a_directory_or_a_missing_parent_is_one_line(model_dir, tmp_path, capsys, where):
    trace = tmp_path if where == "dir" else tmp_path / "no" / "t.jsonl"
    code, _, err = cli(capsys, "--target", model_dir, "--prompt", "abc", "--trace", trace)
    assert code == 2 and "--trace" in err and len(err.strip().splitlines()) == 1


def test_bench_names_keep_their_dots():
    a, b = bench.output_files(Path("r/bench_v1.5")), bench.output_files(Path("r/bench_v1.6"))
    assert [p.name for p in a] == ["bench_v1.5.json", "bench_v1.5.csv", "bench_v1.5.md", "bench_v1.5.png"]
    assert not set(a) & set(b)
    assert bench.output_files(Path("r/bench.json")) == bench.output_files(Path("r/bench"))


def test_bench_unwritable_out_fails_before_any_work(model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "run_bench", lambda *a: pytest.fail("the bench ran"))
    (tmp_path / "file").write_text("x")
    for out in (tmp_path / "file" / "bench", Path("/proc/specblock-no/bench")):  # /proc: unwritable even for root
        code, _, err = cli(capsys, "bench", "--target", model_dir, "--out", out)
        assert code == 2 and "--out" in err and len(err.strip().splitlines()) == 1, err
    code, _, err = cli(capsys, "bench", "--target", model_dir, "--trace-dir", tmp_path / "file")
    assert code == 2 and "--trace-dir" in err


def test_bench_that_fails_at_the_end_leaves_earlier_results_and_traces(model_dir, tmp_path, capsys, monkeypatch):
    out, traces = tmp_path / "res" / "b", tmp_path / "traces"
    args = ["bench", "--target", model_dir, "--methods", "lookup", "--domains", "code", "--prompts", "1",
            "--max-new-tokens", "4", "--runs", "1", "--dtype", "float32", "--out", out, "--trace-dir", traces]
    code, _, err = cli(capsys, *args)
    assert code == 0, err
    before = {p: p.read_bytes() for d in (out.parent, traces) for p in d.iterdir()}
    assert any(p.suffix == ".jsonl" for p in before) and any(p.suffix == ".png" for p in before)

    def plot_fails(rows, path):
        raise KeyboardInterrupt  # e.g. Ctrl-C while the last file is written

    monkeypatch.setattr(bench, "plot", plot_fails)
    assert cli(capsys, *args)[0] == 130  # "interrupted", one line
    after = {p: p.read_bytes() for d in (out.parent, traces) for p in d.iterdir()}
    assert after == before  # results and traces of the first run, byte for byte; no temporary files left


def test_drafter_export_replaces_weights_and_config_together(tmp_path, monkeypatch):
    """An export interrupted between the two files leaves the old pair, never a mixed one."""
    import specblock.runtime.drafters.netio as netio
    from specblock.runtime.drafters.eagle3 import Eagle3Config, Eagle3Net

    d = tmp_path / "drafter"
    Eagle3Net(Eagle3Config(vocab_size=16, hidden_size=8, num_heads=2, intermediate_size=8)).save(d)
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    real = netio.json.dumps
    monkeypatch.setattr(netio.json, "dumps", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        Eagle3Net(Eagle3Config(vocab_size=16, hidden_size=8, num_heads=2, intermediate_size=16)).save(d)
    monkeypatch.setattr(netio.json, "dumps", real)
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before
