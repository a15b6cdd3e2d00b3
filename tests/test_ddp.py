"""Drafter training runs data-parallel under torchrun (two CPU processes, gloo) and resumes."""

import json
import os
import subprocess
import sys

import pytest

from tiny import save_tiny


def run(cmd: list[str], env: dict) -> subprocess.CompletedProcess:
    """The command, or a failure that shows its stderr: a hung teardown dumps its stacks there."""
    try:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"timed out after 300 s; stderr ends:\n{err[-6000:]}")


def test_torchrun_two_processes_then_resume(tmp_path):
    save_tiny(tmp_path / "t", "llama", vocab=96, ctx=128, layers=3)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"line {i} " + "abc def " * 20}) + "\n" for i in range(60)))
    env = {**os.environ, "SPECBLOCK_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    common = ["--target", str(tmp_path / "t"), "--run-dir", str(tmp_path / "run"), "--data", str(data),
              "--window", "33", "--batch", "2", "--intermediate", "64", "--threads", "1", "--eval-every", "1000"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "specblock.training", "drafter", *common, "--max-steps", "3"]
    p = run(cmd, env)
    assert p.returncode == 0, p.stderr[-2000:]
    final = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert final[-1]["step"] == 3 and final[-1]["final"]
    # Resume in one process with a larger budget: it continues from step 3, exports the drafter.
    cmd = [sys.executable, "-m", "specblock.training", "drafter", *common, "--max-steps", "5", "--out", str(tmp_path / "out")]
    p = run(cmd, env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "resumed from step 3" in p.stdout
    assert (tmp_path / "out" / "model.safetensors").is_file()
    # The rank head alone under torchrun, from that run: every other weight frozen before DDP wraps the step.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "specblock.training", "drafter", *common[:2], "--run-dir", str(tmp_path / "rank"), *common[4:],
           "--init-from", str(tmp_path / "run"), "--train-only", "rank-head", "--max-steps", "2"]
    p = run(cmd, env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads((tmp_path / "rank" / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 2
