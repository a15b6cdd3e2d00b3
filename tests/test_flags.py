"""Bad values at every boundary are one line with status 2 naming the flag (or file and line),
checked before anything loads: the decoding CLI, the bench (its flags and --set, by the CLI's own
rules), calibrate, and text that cannot be tokenized."""

import pytest

from specblock.runtime import bench, calibrate
from specblock.runtime.cli import main
from tiny import save_tiny


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("flags") / "m", "llama", vocab=96, ctx=2048)


def one_line(capsys, argv) -> str:
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("args,needle", [
    (["--prompt", "abc\udcff"], "--prompt: character 4"),  # a non-UTF-8 byte on the command line
    (["--prompt", "ab\ud800"], "--prompt: character 3"),
    (["--prompt", "abc", "--system", "x\udc80"], "--system"),
    (["--prompt", "abc", "--seed", "-1", "--temperature", "0.7"], "--seed"),
    (["--prompt", "abc", "--seed", str(2**70), "--temperature", "0.7"], "--seed"),
    (["--prompt", "abc", "--seed", "-5", "--method", "random"], "--seed"),
    (["--prompt", "abc", "--temperature", "inf"], "--temperature: Input should be a finite number"),
    (["--prompt", "abc", "--temperature", "nan"], "--temperature"),
    (["--prompt", "abc", "--top-p", "nan"], "--top-p"),
    (["--prompt", "abc", "--method", "specblock", "--adapt", "--adapt-lambda", "inf"], "--adapt-lambda"),
])
def test_decoding_flags(model_dir, capsys, args, needle):
    assert needle in one_line(capsys, ["--target", model_dir, *args])


@pytest.mark.parametrize("content,needle", [
    (b'{"prompt": "ab\xff\xfe"}\n', ":1: byte 15 is not UTF-8"),
    (b'{"prompt": "fine"}\n{"prompt": "ab\\ud800cd"}\n', ":2: character 3 is not valid Unicode"),
    (b'{"messages": [{"role": "user", "content": "x\\udfff"}]}\n', ":1: character 2"),
])
def test_prompt_file_text_names_the_line(model_dir, tmp_path, capsys, content, needle):
    f = tmp_path / "p.jsonl"
    f.write_bytes(content)
    err = one_line(capsys, ["--target", model_dir, "--prompt-file", f])
    assert str(f) in err and needle in err


BENCH = ["--prompts", "1", "--max-new-tokens", "2", "--runs", "1"]


@pytest.mark.parametrize("args,needle", [
    (["--domains", "code,poetry"], "--domains: unknown domain 'poetry'"),
    (["--budget", "-5"], "--budget"),
    (["--budget", "1000"], "--budget"),
    (["--threads", "-2"], "--threads"),
    (["--runs", "0"], "--runs"),
    (["--runs", "abc"], "--runs"),
    (["--prompts", "0"], "--prompts"),
    (["--split", "tune", "--prompts", "9"], "--split tune holds 8 prompts per domain"),
    (["--split", "train"], "--split"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--methods", "lookup", "--set", "lookup:ngram=0"], "--set lookup:ngram"),
    (["--methods", "lookup", "--set", "lookup:budget=-1"], "--set lookup:budget"),
    (["--methods", "lookup", "--set", "lookup:bogus=3"], "--set lookup:bogus: unknown option"),
    (["--methods", "specblock", "--set", "specblock:widths=a,b"], "--set specblock:widths"),
    (["--methods", "specblock", "--set", "specblock:M=100"], "--set specblock:M: Input should be less than or equal to 8"),
    (["--methods", "specblock", "--set", "specblock:policy_kwargs={oops"], "JSON object"),
    (["--methods", "lookup", "--set", "lookupngram=3"], "METHOD:KEY=VALUE"),
    (["--methods", "lookup", "--set", "eagle3:depth=3"], "eagle3 is not among --methods"),
])
def test_bench_flags_fail_before_anything_loads(model_dir, tmp_path, capsys, monkeypatch, args, needle):
    monkeypatch.setattr(bench, "run_bench", lambda *a: pytest.fail("the bench ran"))
    assert needle in one_line(capsys, ["bench", "--target", model_dir, *BENCH, "--out", tmp_path / "b", *args])


def test_bench_set_takes_the_cli_rules_and_keeps_good_values():
    from specblock.runtime.bench_config import method_options

    got = method_options(["specblock:M=1", "specblock:widths=2,2,2,0", "eagle3:depth=4", "lookup:ngram=2",
                          "specblock@b8:budget=8"], ["specblock", "eagle3", "lookup", "specblock@b8"])
    assert got == {"specblock": {"M": 1, "widths": [2, 2, 2, 0]}, "eagle3": {"depth": 4}, "lookup": {"ngram": 2},
                   "specblock@b8": {"budget": 8}}


@pytest.mark.parametrize("args,needle", [
    (["--ctx", "abc"], "--ctx"),
    (["--ctx", "64,-3"], "--ctx"),
    (["--ctx", "99999", "--reps", "1"], "--ctx: every length"),
    (["--reps", "0"], "--reps"),
    (["--out", "/proc/specblock-no/lat.json"], "--out"),
])
def test_calibrate_flags(model_dir, tmp_path, capsys, monkeypatch, args, needle):
    monkeypatch.setattr(calibrate, "time_target", lambda *a: pytest.fail("calibrate timed something"))
    argv = ["calibrate", "--target", model_dir, "--out", tmp_path / "lat.json", *args]
    assert needle in one_line(capsys, argv)
