"""Every baseline trains through the shared trainer (``python -m specblock.training drafter
--method NAME``), resumes, exports, and the exported drafter loads through the runtime registry
and decodes losslessly."""

import json

import numpy as np
import pytest
import torch

from specblock.runtime import drafters
from specblock.runtime.engine import Engine
from specblock.runtime.target import TargetModel
from specblock.training.drafter import main as train_main
from tiny import save_tiny

METHODS = ["specblock", "eagle3", "medusa", "sps"]


@pytest.mark.parametrize("method", METHODS)
def test_train_resume_export_and_serve(tmp_path, monkeypatch, method):
    monkeypatch.setenv("SPECBLOCK_CACHE", str(tmp_path / "cache"))
    import specblock.training.windows as windows

    monkeypatch.setattr(windows, "CACHE_ROOT", tmp_path / "cache")
    save_tiny(tmp_path / "t", "llama", vocab=96, ctx=128, layers=3)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"line {i} " + "abc def " * 12}) + "\n" for i in range(60)))
    common = ["--method", method, "--target", str(tmp_path / "t"), "--run-dir", str(tmp_path / "run"),
              "--data", str(data), "--window", "33", "--batch", "2", "--intermediate", "64", "--threads", "1",
              "--eval-every", "1000", "--ttt-steps", "3", "--heads", "2", "--layers", "1"]
    assert train_main([*common, "--max-steps", "2"]) == 0
    assert train_main([*common, "--max-steps", "3", "--out", str(tmp_path / "out")]) == 0
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert recs[-1]["step"] == 3 and recs[-1]["final"]
    torch.set_num_threads(1)

    target = TargetModel.load(tmp_path / "t", "float32", "cpu")
    drafter = drafters.build(method, target, {"drafter": tmp_path / "out"})
    prompt = np.arange(3, 20)
    res = Engine(target, drafter, budget=10).generate(prompt, 20)
    ref = target.model.generate(torch.tensor(prompt)[None], max_new_tokens=20, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert res.token_ids == ref
