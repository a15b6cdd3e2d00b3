"""``--train-only rank-head``: SpecBlock's rank head trains alone over a trained, frozen backbone."""

from __future__ import annotations

import pytest
import torch

from specblock.errors import SpecBlockError
from specblock.training.checkpoint import load_checkpoint
from specblock.training.drafter import main as train_main
from tests.test_featcache import tiny_feature_cache


def test_rank_head_trains_alone_and_the_rest_stays(tmp_path):
    tdir, _, cache = tiny_feature_cache(tmp_path)
    flags = ["--target", str(tdir), "--features", str(cache), "--draft-vocab", "20", "--window", "17", "--batch", "2",
             "--eval-every", "2", "--layers", "1", "--intermediate", "32", "--threads", "1", "--lr", "1e-2"]
    train_main(flags + ["--run-dir", str(tmp_path / "run"), "--max-steps", "2"])
    src = load_checkpoint(tmp_path / "run" / "ckpt.safetensors")["net"]
    # --rank-freeze 1 would keep the rank head frozen for a whole ordinary run; --train-only overrides it.
    train_main(flags + ["--run-dir", str(tmp_path / "rank"), "--init-from", str(tmp_path / "run"), "--max-steps", "3",
                        "--train-only", "rank-head", "--rank-freeze", "1", "--out", str(tmp_path / "drafter")])
    ft = load_checkpoint(tmp_path / "rank" / "ckpt.safetensors")
    changed = {k for k, v in ft["net"].items() if not torch.equal(v, src[k])}
    assert changed and all(k.startswith("rank_head.") for k in changed), changed
    assert ft["args"]["train_only"] == "rank-head" and ft["init"]["step"] == 2
    assert (tmp_path / "drafter" / "model.safetensors").is_file()


def test_train_only_refusals_write_nothing(tmp_path):
    base = ["--target", str(tmp_path / "nowhere"), "--window", "17"]
    with pytest.raises(SpecBlockError, match="add --init-from"):
        train_main(base + ["--run-dir", str(tmp_path / "a"), "--train-only", "rank-head"])
    with pytest.raises(SpecBlockError, match="no part of --method eagle3 trains alone"):
        train_main(base + ["--method", "eagle3", "--run-dir", str(tmp_path / "b"), "--train-only", "rank-head"])
    with pytest.raises(SpecBlockError, match="can train alone rank-head"):
        train_main(base + ["--run-dir", str(tmp_path / "c"), "--train-only", "backbone"])
    assert not any((tmp_path / d).exists() for d in "abc")
