"""Training checkpoints hold no pickle: they round-trip weights, optimiser state and RNG states
exactly through safetensors + a JSON header, and a crafted pickle (old name or new) is refused
with one line before anything in it can run."""

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from specblock.errors import SpecBlockError
from specblock.training.checkpoint import load_checkpoint, save_checkpoint
from specblock.training.drafter import main as train_main
from tiny import save_tiny

ROOT = Path(__file__).resolve().parents[1]


class Payload:
    """Unpickling this runs a shell command that leaves a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _net_and_opt(seed: int):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, betas=(0.9, 0.95))
    return net, opt


def _step(net, opt, x):
    opt.zero_grad()
    net(x).square().mean().backward()
    opt.step()


def test_round_trip_resumes_exactly(tmp_path):
    x = torch.randn(3, 4)
    net, opt = _net_and_opt(0)
    _step(net, opt, x)
    rng = np.random.default_rng(5)
    rng.random(3)
    state = {"net": net.state_dict(), "opt": opt.state_dict(), "step": 7, "np_rng": rng.bit_generator.state,
             "torch_rng": torch.get_rng_state(), "args": {"run_dir": tmp_path, "betas": (0.9, 0.95)}}
    save_checkpoint(tmp_path / "c.safetensors", state)
    st = load_checkpoint(tmp_path / "c.safetensors")
    assert st["step"] == 7 and st["args"] == {"run_dir": str(tmp_path), "betas": (0.9, 0.95)}
    assert sorted(st["opt"]["state"]) == [0, 1, 2, 3]  # int keys stay ints
    assert torch.equal(st["torch_rng"], torch.get_rng_state())
    rng2 = np.random.default_rng()
    rng2.bit_generator.state = st["np_rng"]
    assert rng2.random() == rng.random()

    net2, opt2 = _net_and_opt(1)
    net2.load_state_dict(st["net"])
    opt2.load_state_dict(st["opt"])
    _step(net, opt, x)
    _step(net2, opt2, x)
    for a, b in zip(net.parameters(), net2.parameters()):
        assert torch.equal(a, b)
    assert not list(tmp_path.glob("*.tmp"))


def test_tied_tensors_are_saved(tmp_path):
    w = torch.randn(4, 4)
    save_checkpoint(tmp_path / "c.safetensors", {"a": w, "b": w})
    st = load_checkpoint(tmp_path / "c.safetensors")
    assert torch.equal(st["a"], w) and torch.equal(st["b"], w)


@pytest.mark.parametrize("cut", [0, 10, 0.5])
def test_truncated_or_empty_checkpoint_is_one_line(tmp_path, cut):
    p = tmp_path / "c.safetensors"
    save_checkpoint(p, {"w": torch.randn(64, 64), "step": 3})
    data = p.read_bytes()
    p.write_bytes(data[: int(len(data) * cut) if isinstance(cut, float) else cut])
    with pytest.raises(SpecBlockError) as e:
        load_checkpoint(p)
    assert str(p) in str(e.value) and "\n" not in str(e.value)


def _train_args(tmp_path, *extra):
    save_tiny(tmp_path / "t", "llama", vocab=96, ctx=128, layers=3)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"line {i} " + "abc def " * 12}) + "\n" for i in range(40)))
    return ["--target", str(tmp_path / "t"), "--run-dir", str(tmp_path / "run"), "--data", str(data),
            "--window", "33", "--batch", "2", "--intermediate", "64", "--threads", "1", "--eval-every", "1000",
            *extra]


def test_malicious_pickle_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    run = tmp_path / "run"
    run.mkdir()
    (run / "ckpt.pt").write_bytes(pickle.dumps(Payload(marker)))
    args = _train_args(tmp_path, "--max-steps", "1")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "specblock.training", "drafter", *args],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "ckpt.pt" in r.stderr and "pickle" in r.stderr
    assert not marker.exists()

    # The same bytes under the new name: not a safetensors file, so refused as well.
    (run / "ckpt.pt").unlink()
    (run / "ckpt.safetensors").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(SpecBlockError, match="not a readable checkpoint"):
        train_main(args)
    assert not marker.exists()


def test_resume_with_other_layers_is_one_line(tmp_path, monkeypatch):
    import specblock.training.windows as windows

    monkeypatch.setattr(windows, "CACHE_ROOT", tmp_path / "cache")
    args = _train_args(tmp_path, "--max-steps", "1", "--layers", "1")
    assert train_main(args) == 0
    assert (tmp_path / "run" / "ckpt.safetensors").is_file() and not (tmp_path / "run" / "ckpt.pt").exists()
    with pytest.raises(SpecBlockError, match="other settings") as e:
        train_main([*args[:-2], "--layers", "2", "--max-steps", "2"])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("args,needle", [
    (["--ckpt-every", "0"], "--ckpt-every"), (["--eval-every", "0"], "--eval-every"), (["--batch", "0"], "--batch"),
    (["--max-minutes", "0"], "--max-minutes"), (["--max-steps", "0"], "--max-steps"), (["--lr", "-1"], "--lr"),
    (["--lr", "nan"], "--lr"), (["--K", "0"], "--K"), (["--layers", "0"], "--layers"), (["--threads", "0"], "--threads"),
    (["--max-steps", "x"], "--max-steps"),
])
def test_bad_training_flags_are_one_line_before_the_target_loads(tmp_path, monkeypatch, capsys, args, needle):
    import specblock.training.drafter as drafter

    monkeypatch.setattr(drafter, "load_causal_lm", lambda *a: pytest.fail("the target loaded"))
    base = ["--target", str(tmp_path / "t"), "--run-dir", str(tmp_path / "run")]
    try:
        with pytest.raises(SpecBlockError, match=needle):
            train_main([*base, *args])
    except SystemExit as e:  # argparse: a value that is not a number
        assert e.code == 2 and needle in capsys.readouterr().err


@pytest.mark.parametrize("lines,needle", [
    (['{"text": "fine"}', '{"text": '], ":2: not valid JSON"),
    (['{"text": "fine"}', '{"body": "x"}'], ":2: each line needs a string field 'text'"),
    (['{"text": "x\\ud800"}'], ":1: character 2"),
])
def test_bad_data_lines_are_named(tmp_path, lines, needle):
    from specblock.training.windows import read_texts

    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(SpecBlockError, match=needle):
        read_texts(f)


def test_run_dir_that_is_a_file_is_refused(tmp_path, monkeypatch):
    import specblock.training.drafter as drafter

    monkeypatch.setattr(drafter, "load_causal_lm", lambda *a: pytest.fail("the target loaded"))
    (tmp_path / "run").write_text("x")
    with pytest.raises(SpecBlockError, match="--run-dir"):
        train_main(["--target", str(tmp_path / "t"), "--run-dir", str(tmp_path / "run")])


@pytest.mark.parametrize("args,needle", [
    (["train", "--batch", "0"], "--batch"), (["train", "--lr", "nan"], "--lr"), (["train", "--max-steps", "0"], "--max-steps"),
    (["sample", "--max-new-tokens", "0"], "--max-new-tokens"),
])
def test_lab_target_trainer_flags_are_one_line(tmp_path, args, needle):
    from specblock.training.target import main as target_main

    with pytest.raises(SpecBlockError, match=needle):
        target_main(["--run-dir", str(tmp_path / "run"), *args])
    assert not (tmp_path / "run").exists()  # refused before anything was built
