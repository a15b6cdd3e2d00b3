"""A trained drafter's measured best serving settings (serving.json beside it) are what a user
gets without flags; a flag overrides them; a broken file is one line."""

import json
import shutil

from specblock.runtime import drafters
from specblock.runtime.config import DEFAULT_DRAFTERS, DEFAULT_TARGET
from specblock.runtime.target import TargetModel
from tiny import run_cli as run


def drafter_copy(tmp_path, serving: dict | str | None):
    d = tmp_path / "specblock"
    shutil.copytree(DEFAULT_DRAFTERS / "specblock", d)
    (d / "serving.json").unlink(missing_ok=True)
    if serving is not None:
        (d / "serving.json").write_text(serving if isinstance(serving, str) else json.dumps(serving))
    return d


def test_serving_json_under_explicit_options(tmp_path):
    target = TargetModel.load(DEFAULT_TARGET, "float32", "cpu")
    d = drafter_copy(tmp_path, {"budget": 5, "M": 1, "note": "ignored"})
    got = drafters.serving_settings("specblock", target, {"drafter": d, "M": None, "budget": None})
    assert got["budget"] == 5 and got["M"] == 1 and "note" not in got
    got = drafters.serving_settings("specblock", target, {"drafter": d, "budget": 7})
    assert got["budget"] == 7 and got["M"] == 1
    assert drafters.serving_settings("lookup", target, {"budget": None}) == {}  # untrained methods: no file



def test_cli_uses_the_drafters_budget_unless_told(tmp_path, capsys):
    d = drafter_copy(tmp_path, {"budget": 3})
    base = ["--target", "lab", "--method", "specblock", "--drafter", d, "--prompt", "def add(a, b):", "--json",
            "--max-new-tokens", "16", "--no-warmup", "--dtype", "float32"]
    code, out, _ = run(capsys, *base)
    assert code == 0 and json.loads(out.splitlines()[0])["mean_tree_size"] <= 4  # root + at most 3 nodes
    code, out, _ = run(capsys, *base, "--budget", "20")
    assert code == 0 and json.loads(out.splitlines()[0])["mean_tree_size"] > 4


def test_broken_serving_json_is_one_line(tmp_path, capsys):
    d = drafter_copy(tmp_path, "{not json")
    code, _, err = run(capsys, "--target", "lab", "--method", "specblock", "--drafter", d, "--prompt", "x",
                       "--max-new-tokens", "2", "--no-warmup")
    assert code == 2 and "serving.json is not valid JSON" in err and len(err.strip().splitlines()) == 1
