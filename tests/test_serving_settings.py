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


def test_serving_json_overrides_per_dtype_and_compiled(tmp_path, capsys):
    """A tree's cost depends on the target's dtype and on compiling, so serving.json's
    ``overrides`` hold settings measured there; they apply where both keys match, in order."""
    from types import SimpleNamespace

    from specblock.runtime.target import dtype_name_of

    d = drafter_copy(tmp_path, {"budget": 2, "M": 2, "overrides": [
        {"dtype": "q4", "compiled": True, "budget": 1, "measured": "ignored"},
        {"dtype": "q4", "M": 1}]})
    opts = {"drafter": d, "budget": None}

    def at(dtype, compiled):
        return drafters.serving_settings("specblock", SimpleNamespace(dtype_name=dtype, compiled=compiled), dict(opts))

    assert at("q4", True) == {"budget": 1, "M": 1, "drafter": d}
    assert at("q4", False) == {"budget": 2, "M": 1, "drafter": d}  # only the dtype-wide override
    assert at("packed-fp16", True) == {"budget": 2, "M": 2, "drafter": d}
    got = drafters.serving_settings("specblock", SimpleNamespace(dtype_name="q4", compiled=True), {"drafter": d, "budget": 5})
    assert got["budget"] == 5  # a flag still wins
    # the names the targets answer to
    target = TargetModel.load(DEFAULT_TARGET, "float32", "cpu")
    assert (target.dtype_name, target.compiled) == ("float32", False)
    assert dtype_name_of(target.model, target.dtype) == "float32"
    code, _, err = run(capsys, "--target", "lab", "--method", "specblock", "--dtype", "float32", "--prompt", "x",
                       "--max-new-tokens", "2", "--no-warmup",
                       "--drafter", drafter_copy(tmp_path / "bad", {"budget": 2, "overrides": {"dtype": "q4"}}))
    assert code == 2 and "must be a list of objects" in err.strip().splitlines()[-1] and "Traceback" not in err



def test_serving_json_overrides_per_cpu_kind(tmp_path, monkeypatch, capsys):
    """Which budget wins depends on the CPU too (EAGLE-3's budget 1 measured best on a Zen 5 without
    AMX and worst on an AMX Xeon), so an override may name a ``cpu`` kind; a kind that does not
    exist is a typo, refused in one line."""
    from types import SimpleNamespace

    from specblock import cpu

    d = drafter_copy(tmp_path, {"budget": 2, "overrides": [
        {"dtype": "packed-q4-amx", "cpu": "avx512-bf16", "compiled": False, "budget": 1},
        {"cpu": "amx", "M": 1}]})
    target = SimpleNamespace(dtype_name="packed-q4-amx", compiled=False)
    at = lambda kind, t=target: (monkeypatch.setattr(cpu, "cpu_kind", lambda: kind),
                                 drafters.serving_settings("specblock", t, {"drafter": d}))[1]
    assert at("avx512-bf16") == {"budget": 1, "drafter": d}
    assert at("amx") == {"budget": 2, "M": 1, "drafter": d}
    assert at("other") == {"budget": 2, "drafter": d}
    assert at("avx512-bf16", SimpleNamespace(dtype_name="packed-q4-amx", compiled=True)) == {"budget": 2, "drafter": d}
    assert at("avx512-bf16", SimpleNamespace(dtype_name="packed-q4", compiled=False)) == {"budget": 2, "drafter": d}
    code, _, err = run(capsys, "--target", "lab", "--method", "specblock", "--dtype", "float32", "--prompt", "x",
                       "--max-new-tokens", "2", "--no-warmup",
                       "--drafter", drafter_copy(tmp_path / "bad", {"budget": 2, "overrides": [{"cpu": "zen5", "M": 1}]}))
    assert code == 2 and "not one of amx, avx512-bf16" in err.strip().splitlines()[-1] and "Traceback" not in err


def test_cpu_kind_follows_the_flags(monkeypatch):
    from specblock import cpu

    for flags, kind in [({"avx512f", "avx512bw", "avx512_bf16", "amx_bf16", "amx_tile"}, "amx"),
                        ({"avx512f", "avx512bw", "avx512_bf16"}, "avx512-bf16"),  # AMD Zen 4-5
                        ({"avx512f", "avx512bw", "avx512_vnni"}, "avx512"), ({"avx2", "fma"}, "other"), (set(), "other")]:
        monkeypatch.setattr(cpu, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert cpu.cpu_kind() == kind
    assert cpu.cpu_kind() in cpu.CPU_KINDS


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


def test_serving_json_names_a_tree_policy_a_flag_replaces(tmp_path, capsys):
    """A drafter may ship its tree policy (the real model's SpecBlock drafter: expected-acceptance
    widths); --widths or --policy replace it whole; a class outside specblock.policies is refused
    (a drafter folder is data: naming a class would run its module)."""
    from types import SimpleNamespace

    from specblock.policies.expected import ExpectedAcceptanceBranching
    from specblock.policies.branching import RankBucketBranching

    ea = "specblock.policies.expected:ExpectedAcceptanceBranching"
    d = drafter_copy(tmp_path, {"budget": 4, "policy": ea, "policy_kwargs": {"max_width": 6}})
    t = SimpleNamespace(dtype_name="float32", compiled=False)
    got = drafters.serving_settings("specblock", t, {"drafter": d, "policy_kwargs": {}})
    assert got["policy"] == ea and got["policy_kwargs"] == {"max_width": 6}
    assert "policy" not in drafters.serving_settings("specblock", t, {"drafter": d, "widths": (2, 2, 2, 2)})
    mine = drafters.serving_settings("specblock", t, {"drafter": d, "policy": "specblock.policies.branching:TopKBranching"})
    assert mine["policy"].endswith(":TopKBranching") and "policy_kwargs" not in mine
    target = TargetModel.load(DEFAULT_TARGET, "float32", "cpu")
    built = drafters.build("specblock", target, drafters.serving_settings("specblock", target, {"drafter": d}))
    assert type(built.policy) is ExpectedAcceptanceBranching and built.policy.max_width == 6
    built = drafters.build("specblock", target, drafters.serving_settings("specblock", target, {"drafter": d, "widths": (1, 1, 1, 0)}))
    assert type(built.policy) is RankBucketBranching and built.policy.widths_by_bucket == (1, 1, 1, 0)
    bad = drafter_copy(tmp_path / "bad", {"budget": 4, "policy": "os:system"})
    code, _, err = run(capsys, "--target", "lab", "--method", "specblock", "--drafter", bad, "--prompt", "x",
                       "--max-new-tokens", "2", "--no-warmup", "--dtype", "float32")
    assert code == 2 and "not one of specblock.policies." in err and len(err.strip().splitlines()) == 1
    sneaky = drafter_copy(tmp_path / "sneaky", {"policy": "specblock.policies.../../evil.py:Cls"})  # a file, by its prefix
    code, _, err = run(capsys, "--target", "lab", "--method", "specblock", "--drafter", sneaky, "--prompt", "x",
                       "--max-new-tokens", "2", "--no-warmup", "--dtype", "float32")
    assert code == 2 and "not one of specblock.policies." in err


def test_serving_json_names_the_tree_sizes_a_compiled_server_warms(tmp_path, monkeypatch, capsys):
    """``warm_sizes`` (measured from traces: each graph is half a minute of a first start) replaces
    the drafter's every possible size when a compiled server warms; the largest tree the budget
    allows is warmed too, and a tree of another size pads up to a warmed bucket with the tokens of
    plain greedy decoding. A bad list is refused in one line; a drafter never sees the key."""
    import numpy as np

    from specblock.compiled.target import StaticTarget
    from specblock.runtime import cli
    from specblock.runtime.engine import Engine
    from specblock.serve.cli import open_service, parse

    d = drafter_copy(tmp_path, {"budget": 3, "M": 1, "widths": [2, 4, 10, 0], "warm_sizes": [1, 4]})
    warmed = []

    def fake_warm(self, n, sizes=None, then=None):
        warmed.append((n, tuple(sizes)))
        return []

    monkeypatch.setattr(cli, "maybe_compile", lambda t, c, m="whole": StaticTarget.wrap(t, compile=False) if c else t)
    monkeypatch.setattr(StaticTarget, "warm", fake_warm)
    base = ["--target", "lab", "--dtype", "float32", "--method", "specblock", "--drafter", str(d), "--compile",
            "--port", "0"]
    open_service(*parse(base))
    assert warmed.pop() == (4, (1, 4, 4))  # the measured sizes, and root + the budget's 3 nodes
    open_service(*parse([*base, "--lookup-branch", "3"]))
    assert warmed.pop() == (7, (1, 4, 7))  # the branch's 3 on top: 7 nodes at most, warmed as well
    open_service(*parse([*base, "--budget", "2"]))
    assert warmed.pop() == (3, (1, 3))  # a tree setting of the user's: the sizes its trees can take, not the file's
    (d / "serving.json").write_text(json.dumps({"budget": 3, "M": 1}))
    open_service(*parse(base))
    assert warmed.pop() == (4, (1, 3, 4))  # without the key: every size the rank widths allow
    (d / "serving.json").write_text(json.dumps({"budget": 3, "warm_sizes": [0, "4"]}))
    code, _, err = run(capsys, "--target", "lab", "--method", "specblock", "--drafter", str(d), "--prompt", "x",
                       "--max-new-tokens", "2", "--no-warmup")
    assert code == 2 and "warm_sizes" in err.strip().splitlines()[-1] and "Traceback" not in err
    # padded up to a warmed bucket, results unchanged: trees of 3 nodes run as 4 rows
    opts = {"drafter": str(d), "budget": None}
    (d / "serving.json").write_text(json.dumps({"budget": 2, "M": 1, "warm_sizes": [1, 4]}))  # trees of 3 nodes
    plain_target = TargetModel.load(DEFAULT_TARGET, "float32", "cpu")
    static = StaticTarget.wrap(TargetModel.load(DEFAULT_TARGET, "float32", "cpu"), compile=False)
    got = drafters.serving_settings("specblock", static, dict(opts))
    assert drafters.warm_sizes(got) == (1, 4) and "warm_sizes" not in got
    budget = int(got.pop("budget"))
    static.warmed = (1, 4)  # what warm leaves on a compiled target
    rows = []  # (nodes, rows run) of each tree
    real_bucket = StaticTarget.bucket
    monkeypatch.setattr(StaticTarget, "bucket", lambda self, n: rows.append((n, real_bucket(self, n))) or rows[-1][1])
    prompt = np.arange(5, 40)
    out = Engine(static, drafters.build("specblock", static, got), budget=budget, warm_sizes=(1, 4)).generate(prompt, 24)
    ref = Engine(plain_target, drafters.ARDrafter(), budget=0).generate(prompt, 24)
    assert out.token_ids == ref.token_ids
    assert {b for _, b in rows} <= {1, 4} and any(n in (2, 3) and b == 4 for n, b in rows), rows
