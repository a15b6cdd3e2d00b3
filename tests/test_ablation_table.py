"""experiments/ablation_table.py (issue 14's ablations on the real model): the table of trained
variants and the fixed top-k branching analysis, on a tiny target and its feature cache."""

from __future__ import annotations

import json

import pytest

from specblock.training.drafter import main as train_main
from tests.test_featcache import tiny_feature_cache
from tests.tiny import experiment



def test_ablation_table_evaluates_finished_variants_and_branching_rules(tmp_path, capsys):
    mod = experiment("ablation_table")
    tdir, model, cache = tiny_feature_cache(tmp_path)
    root = tmp_path / "ablations"
    for name, flags in (("full", []), ("no-shift", ["--no-shift"])):
        train_main(["--method", "specblock", "--target", str(tdir), "--features", str(cache), "--draft-vocab", "20",
                    "--run-dir", str(root / name), "--out", str(root / name / "drafter"), "--window", "17",
                    "--batch", "2", "--max-steps", "2", "--eval-every", "2", "--intermediate", "32", "--K", "3",
                    "--threads", "1", *flags])
    (root / "no-cross-block").mkdir()  # started, never finished: left out, not an error
    out = tmp_path / "table"
    assert mod.main(["--target", str(tdir), "--features", str(cache), "--root", str(root), "--windows", "4", "--window", "17",
                     "--out", str(out), "--threads", "1", "--also", f"again={root / 'full' / 'drafter'}"]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["variant"] for r in rows] == ["full", "no-shift", "again"]
    assert rows[2]["steps"] is None and rows[2]["block1_acc"] == rows[0]["block1_acc"]  # same drafter, same windows
    assert "no-cross-block: not finished" in capsys.readouterr().err
    for r in rows:
        br = r["branching"]
        acc = [br[f"top{w}"]["accepted"] for w in mod.FIXED]
        assert acc == sorted(acc)  # more candidates kept never accept less
        assert all(br[f"top{w}"]["mean_width"] == pytest.approx(w) for w in mod.FIXED)
        # top-1 is the chain acceptance training logs (up to argmax ties)
        assert br["top1"]["accepted"] == pytest.approx(r["accepted_block1"], abs=0.02)
        assert 0 <= br["rank"]["mean_width"] <= 10
    assert "| no-shift |" in out.with_suffix(".md").read_text()


def test_rank_rule_with_equal_widths_is_fixed_top_k(tmp_path):
    """The rank-head rule with width w in every bucket keeps exactly what fixed top-w keeps."""
    from specblock.runtime.drafters.specblock_net import SpecBlockNet
    from specblock.training.cachewindows import CacheWindows
    from specblock.training.featcache import FeatureCache

    mod = experiment("ablation_table")
    tdir, model, cache = tiny_feature_cache(tmp_path)
    train_main(["--method", "specblock", "--target", str(tdir), "--features", str(cache), "--run-dir",
                str(tmp_path / "run"), "--out", str(tmp_path / "d"), "--window", "17", "--batch", "2",
                "--max-steps", "1", "--eval-every", "1", "--intermediate", "32", "--K", "3", "--threads", "1"])
    net = SpecBlockNet.load(tmp_path / "d", model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    held = CacheWindows(FeatureCache(cache, tdir), 17).heldout(4, net)
    for w in (1, 2):
        br = mod.branching(net.eval(), held, rank_widths=(w, w, w, w))
        assert br["rank"] == br[f"top{w}"]
