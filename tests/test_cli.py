"""The runtime CLI: JSON contract, --compare, prompt files, and one-line errors with status 2."""

import json
import subprocess
import sys

import pytest

from tiny import save_tiny
from tiny import run_cli as run

REQUIRED = {"method", "token_ids", "text", "new_tokens", "iterations", "tau", "tokens_per_s", "draft_share", "wall_s"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny") / "m", "llama", vocab=96, ctx=64)



def test_json_single_prompt_with_compare(model_dir, capsys):
    code, out, err = run(capsys, "--target", model_dir, "--prompt", "abcabcabc", "--max-new-tokens", 12,
                         "--json", "--compare", "ar", "--dtype", "float32", "--method", "lookup")
    assert code == 0
    lines = out.strip().splitlines()
    assert len(lines) == 1
    rec = json.loads(lines[0])
    assert REQUIRED <= rec.keys() and rec["method"] == "lookup"
    assert rec["new_tokens"] == len(rec["token_ids"]) == 12
    assert rec["identical_to_ar"] is True and rec["speedup"] > 0


def test_compare_warms_every_compiled_shape_first_and_a_plain_run_stays_lazy(model_dir, capsys, monkeypatch):
    from specblock.runtime.engine import Engine

    calls = []  # both engines: a warmed target pads each step to a warmed size, plain decoding's 1 included
    monkeypatch.setattr(Engine, "warm_compiled", lambda self: calls.append(self.drafter.name) or [])
    base = ("--target", model_dir, "--prompt", "abcabc", "--max-new-tokens", 4, "--dtype", "float32", "--method", "lookup")
    assert run(capsys, *base)[0] == 0 and calls == []
    assert run(capsys, *base, "--compare", "ar")[0] == 0 and sorted(calls) == ["ar", "lookup"]
    assert run(capsys, *base, "--compare", "ar", "--no-warmup")[0] == 0 and len(calls) == 2


def test_prompt_file_gives_one_object_each_and_a_summary(model_dir, tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hello", "domain": "chat"}\n{"prompt": "def f(x):"}\n')
    code, out, _ = run(capsys, "--target", model_dir, "--prompt-file", f, "--max-new-tokens", 5,
                       "--json", "--compare", "ar", "--dtype", "float32", "--method", "random")
    assert code == 0
    recs = [json.loads(x) for x in out.strip().splitlines()]
    assert len(recs) == 3 and recs[0]["domain"] == "chat"
    assert recs[-1]["summary"] is True and recs[-1]["prompts"] == 2
    assert recs[-1]["new_tokens"] == recs[0]["new_tokens"] + recs[1]["new_tokens"]
    assert recs[-1]["identical_to_ar"] is True


def test_text_mode_streams_then_summarises(model_dir, capsys):
    code, out, _ = run(capsys, "--target", model_dir, "--prompt", "xyz", "--max-new-tokens", 6, "--dtype", "float32")
    assert code == 0 and out.strip().splitlines()[-1].startswith("[lookup] 6 tokens")


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--prompt", "   "], "prompt is empty"),
        (["--prompt", "x" * 200], "context is 64"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--temperature", "-1"], "--temperature"),
        (["--top-p", "0"], "--top-p"),
        (["--top-p", "1.5"], "--top-p"),
        (["--method", "nope"], "unknown method"),
    ],
)
def test_bad_input_is_one_line_and_status_2(model_dir, capsys, args, needle):
    code, out, err = run(capsys, "--target", model_dir, *args)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1


def test_bad_model_dirs(tmp_path, capsys):
    code, _, err = run(capsys, "--target", tmp_path / "missing")
    assert code == 2 and "neither a model directory nor a known name" in err
    (tmp_path / "empty").mkdir()
    code, _, err = run(capsys, "--target", tmp_path / "empty")
    assert code == 2 and "no config.json" in err
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"]}))
    (bert / "model.safetensors").write_bytes(b"")
    code, _, err = run(capsys, "--target", bert)
    assert code == 2 and "not a causal LM" in err


def test_real_process_exit_code_has_no_traceback(tmp_path):
    p = subprocess.run([sys.executable, "-m", "specblock.runtime", "--target", str(tmp_path / "nope")],
                       capture_output=True, text=True)
    assert p.returncode == 2 and "Traceback" not in p.stderr and p.stderr.startswith("error:")
