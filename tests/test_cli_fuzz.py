"""The decoding CLI under random flag values and random bytes in prompts (hypothesis): every run
ends with status 0 or with status 2 and one line, never a traceback. Examples are the same on
every CI run (the "ci" profile in conftest.py derandomizes)."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specblock.runtime.cli import main
from tiny import save_tiny


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    return save_tiny(root / "m", "llama", vocab=96, ctx=256), root


JUNK_NUMBERS = st.sampled_from(["", "x", "1.5", "1e9", "-0", "nan", "inf", "-1", "99999999999999999999999"])
argv_bytes = st.binary(max_size=40).map(lambda b: b.decode("utf-8", "surrogateescape"))  # what a shell passes
#: flag -> (values the CLI should take or refuse on their merits, junk it must refuse with one line)
FLAGS = {
    "--method": (st.sampled_from(["ar", "lookup", "random", "auto"]), st.sampled_from(["foo", "specblock", ""])),
    "--max-new-tokens": (st.integers(1, 12).map(str), st.one_of(JUNK_NUMBERS, st.integers(-3, 0).map(str))),
    "--temperature": (st.floats(0, 3).map(repr), st.one_of(JUNK_NUMBERS, st.floats().map(repr))),
    "--top-p": (st.floats(0.01, 1).map(repr), st.one_of(JUNK_NUMBERS, st.floats(-1, 2).map(repr))),
    "--seed": (st.integers(0, 2**63 - 1).map(str), st.one_of(JUNK_NUMBERS, st.integers(-2**70, 2**70).map(str))),
    "--budget": (st.integers(0, 40).map(str), st.one_of(JUNK_NUMBERS, st.integers(-5, 300).map(str))),
    "--ngram": (st.integers(1, 4).map(str), JUNK_NUMBERS),
    "--min-ngram": (st.integers(1, 4).map(str), JUNK_NUMBERS),
    "--lookup-depth": (st.integers(1, 9).map(str), JUNK_NUMBERS),
    "--branches": (st.integers(1, 4).map(str), JUNK_NUMBERS),
    "--compare": (st.just("ar"), st.sampled_from(["none", ""])),
    "--widths": (st.just("2,4,10,0"), st.sampled_from(["1,1", "a,b,c,d", "-1,2,3,4", ""])),
}


@st.composite
def invocations(draw):
    argv = ["--dtype", "float32", "--no-warmup"]
    for flag in draw(st.lists(st.sampled_from(sorted(FLAGS)), max_size=5, unique=True)):
        valid, junk = FLAGS[flag]
        argv += [flag, draw(junk if draw(st.integers(0, 5)) == 0 else valid)]
    if draw(st.booleans()):
        argv += ["--json"]
    kind = draw(st.sampled_from(["text", "text", "bytes", "file"]))
    prompt = draw(st.text(min_size=1, max_size=30) if kind == "text" else argv_bytes)
    tail = draw(st.binary(max_size=60)) if draw(st.integers(0, 3)) == 0 else b""
    return argv, kind, prompt, tail


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=invocations())
def test_cli_never_tracebacks(env, capsys, case):
    model_dir, root = env
    argv, kind, prompt, file_bytes = case
    if kind == "file":
        f = root / "p.jsonl"
        f.write_bytes(json.dumps({"prompt": prompt}).encode("utf-8", "surrogatepass") + b"\n" + file_bytes)
        argv += ["--prompt-file", str(f)]
    else:
        argv += ["--prompt", prompt]
    try:
        code = main(["--target", str(model_dir), *argv])
    except SystemExit as e:  # argparse's one-line errors
        code = e.code
    err = capsys.readouterr().err
    assert code in (0, 2), (argv, err)
    if code == 2:
        assert len(err.strip().splitlines()) == 1 and err.startswith("error:"), (argv, err)
