"""experiments/heldout_compare.py: exported drafters of different methods on the same held-out
windows, as the fine-tune check of issue 14 uses it (a tiny target and its feature cache)."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest

from specblock.training.checkpoint import load_checkpoint
from specblock.training.drafter import main as train_main
from tests.test_featcache import tiny_feature_cache
from tests.tiny import experiment



def test_drafters_of_several_methods_on_the_same_windows(tmp_path, capsys):
    mod = experiment("heldout_compare")
    tdir, model, cache = tiny_feature_cache(tmp_path)
    flags = ["--target", str(tdir), "--features", str(cache), "--draft-vocab", "20", "--window", "17", "--batch", "2",
             "--eval-every", "2", "--intermediate", "32", "--threads", "1"]
    for method in ("specblock", "eagle3", "medusa"):
        train_main(flags + ["--method", method, "--run-dir", str(tmp_path / method), "--out", str(tmp_path / method / "d"),
                            "--max-steps", "2"] + (["--K", "3"] if method == "specblock" else []))
    sps_flags = [f for f in flags if f not in ("--draft-vocab", "20")]  # SpS drafts over the whole vocabulary
    train_main(sps_flags + ["--method", "sps", "--layers", "1", "--draft-hidden", "16", "--run-dir", str(tmp_path / "sps"),
                            "--out", str(tmp_path / "sps" / "d"), "--max-steps", "2"])
    # a fine-tune of the SpecBlock run: what the script is for
    train_main(flags + ["--method", "specblock", "--K", "3", "--run-dir", str(tmp_path / "ft"), "--init-from",
                        str(tmp_path / "specblock"), "--max-steps", "2", "--own-share", "0.5", "--out", str(tmp_path / "ft" / "d")])
    out = tmp_path / "cmp"
    specs = [f"sb=specblock:{tmp_path / 'specblock' / 'd'}", f"sb-again=specblock:{tmp_path / 'specblock' / 'd'}",
             f"sb-ft=specblock:{tmp_path / 'ft' / 'd'}", f"e3=eagle3:{tmp_path / 'eagle3' / 'd'}",
             f"md=medusa:{tmp_path / 'medusa' / 'd'}", f"sps=sps:{tmp_path / 'sps' / 'd'}"]
    argv = ["--target", str(tdir), "--features", str(cache), "--windows", "4", "--window", "17", "--out", str(out),
            "--threads", "1"]
    assert mod.main(argv + [x for s in specs for x in ("--drafter", s)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["name"] for r in rows] == ["sb", "sb-again", "sb-ft", "e3", "md", "sps"]
    assert rows[0]["block1_acc"] == rows[1]["block1_acc"]  # same drafter, same windows
    total, parts = mod.accepted(rows[3])
    assert total == sum(rows[3]["chain_acc"]) and 0 <= total <= len(parts)
    total, parts = mod.accepted(rows[4])
    assert math.isnan(total) and parts == rows[4]["head_top1"]
    total, parts = mod.accepted(rows[5])  # SpS: its top-1 agreement with the target
    assert math.isnan(total) and parts == [rows[5]["alpha"]] and 0 <= rows[5]["alpha"] <= 1
    md = out.with_suffix(".md").read_text()
    assert "| sb-ft | specblock |" in md and "| md | medusa | nan |" in md
    # bad input: one line, nothing written
    assert mod.main(argv[:-4] + ["--out", str(tmp_path / "bad"), "--drafter", "x=specblock"]) == 2
    assert mod.main(argv[:-4] + ["--out", str(tmp_path / "bad"), "--drafter", f"x=specblock:{tmp_path / 'nowhere'}"]) == 2
    err = capsys.readouterr().err
    assert "NAME=METHOD:DIR" in err and "config.json missing" in err
    assert not (tmp_path / "bad.json").exists()


def test_a_fine_tune_card_names_its_source_and_mix(tmp_path, monkeypatch):
    """export_drafter.py on an --init-from run: the card counts the fine-tune's own steps and says what it
    started from and how its windows were mixed."""
    tdir, model, cache = tiny_feature_cache(tmp_path)
    flags = ["--target", str(tdir), "--features", str(cache), "--draft-vocab", "20", "--window", "17", "--batch", "2",
             "--eval-every", "2", "--intermediate", "32", "--threads", "1", "--K", "3"]
    train_main(flags + ["--run-dir", str(tmp_path / "base"), "--max-steps", "3"])
    train_main(flags + ["--run-dir", str(tmp_path / "base-ft"), "--init-from", str(tmp_path / "base"), "--max-steps", "2",
                        "--own-share", "0.5"])
    mod = experiment("export_drafter")
    out = tmp_path / "exported"
    out.mkdir()
    (out / "serving.json").write_text('{"budget": 3}')  # a re-export keeps the measured serving settings
    # another cache than the one the run trained on would misstate the card: refused, nothing written
    other = tmp_path / "other_cache"
    other.mkdir()
    monkeypatch.setattr(sys, "argv", ["export_drafter.py", "--run-dir", str(tmp_path / "base-ft"), "--features", str(other),
                                      "--data", str(tmp_path / "gen"), "--out", str(out)])
    with pytest.raises(SystemExit) as stop:
        mod.main()
    assert stop.value.code == 2 and sorted(p.name for p in out.iterdir()) == ["serving.json"]
    monkeypatch.setattr(sys, "argv", ["export_drafter.py", "--run-dir", str(tmp_path / "base-ft"), "--features", str(cache),
                                      "--data", str(tmp_path / "gen"), "--out", str(out)])
    mod.main()
    card = (out / "README.md").read_text()
    assert "- 2 steps in" in card and "all windows from the target's own answers (no reference shards" in card
    assert "50% of windows" not in card  # --own-share 0.5, but the cache holds no reference shard to mix in
    assert "Fine-tuned from the run in `base` (3 steps" in card and "all rounds together: 5 steps" in card
    assert "Stopped by hand" not in card  # it ran to the end of its schedule
    assert "Instructions the target wrote itself" not in card
    monkeypatch.setattr(sys, "argv", sys.argv + ["--ask", str(tmp_path / "gen")])  # selfask's answers: their own line
    mod.main()
    assert "Instructions the target wrote itself (`training/selfask.py`" in (out / "README.md").read_text()
    assert (out / "model.safetensors").is_file()
    # a second round names the whole lineage; a run stopped early says where its schedule was
    train_main(flags + ["--run-dir", str(tmp_path / "base-ft2"), "--init-from", str(tmp_path / "base-ft"), "--max-steps", "1"])
    run = load_checkpoint(tmp_path / "base-ft2" / "ckpt.safetensors")
    assert run["init"]["init"]["step"] == 3  # recorded by the trainer, not read back from disk
    line = mod._init_line(run)
    assert "`base-ft` (2 steps" in line and "that one from `base` (3 steps" in line and "all rounds together: 6 steps" in line
    assert "without cross-block" not in line  # a round trained without it says so (the paper's recipe has it)
    no_cross = {**run, "init": {**run["init"], "args": {**run["init"]["args"], "cross_block": False}}}
    assert "`base-ft` (2 steps, " in mod._init_line(no_cross) and "without cross-block training)" in mod._init_line(no_cross)
    stopped = {**run, "step": 5, "train_s": 30.0, "args": {**run["args"], "max_steps": 10, "max_minutes": 100.0}}
    assert "Stopped by hand at 50% of its schedule" in mod._stopped_line(stopped, {"final": True})
    assert (out / "serving.json").read_text() == '{"budget": 3}'
    # answers generated after the cache was built were never trained on: the card counts cached shards only
    gen = json.loads((tmp_path / "gen" / "manifest.json").read_text())
    feat = json.loads((cache / "manifest.json").read_text())
    cached = {n: v for n, v in gen["shards"].items() if n in feat["shards"]}
    for i, v in enumerate(cached.values()):  # the fake chatgen records sequences only
        v.update(answer_tokens=100 + i, seconds=10.0)
    gen["shards"]["shard_00099"] = {"sequences": 7, "answer_tokens": 1000, "seconds": 60.0}
    assert mod.gen_totals(gen, feat)["answer_tokens"] == sum(v["answer_tokens"] for v in cached.values())
    assert mod.gen_totals(gen, feat)["sequences"] == sum(v["sequences"] for v in cached.values())
    assert mod.gen_totals(gen, feat)["minutes"] == round(10.0 * len(cached) / 60, 2)


def test_fine_tuning_a_shipped_drafter(tmp_path, monkeypatch):
    """--init-from an exported drafter directory (what git ships; its run directory is gone on a fresh
    machine): its weights and draft vocabulary, its lineage from training.json, refusals in one line."""
    import pytest
    import torch
    from safetensors.torch import load_file

    from specblock.errors import SpecBlockError

    tdir, model, cache = tiny_feature_cache(tmp_path)
    flags = ["--target", str(tdir), "--features", str(cache), "--draft-vocab", "20", "--window", "17", "--batch", "2",
             "--eval-every", "2", "--intermediate", "32", "--threads", "1", "--K", "3"]
    train_main(flags + ["--run-dir", str(tmp_path / "base"), "--max-steps", "3"])
    mod = experiment("export_drafter")
    shipped = tmp_path / "shipped"
    monkeypatch.setattr(sys, "argv", ["export_drafter.py", "--run-dir", str(tmp_path / "base"), "--features", str(cache),
                                      "--data", str(tmp_path / "gen"), "--out", str(shipped)])
    mod.main()
    assert json.loads((shipped / "training.json").read_text())["step"] == 3
    train_main(flags + ["--run-dir", str(tmp_path / "ft"), "--init-from", str(shipped), "--max-steps", "1"])
    ft = load_checkpoint(tmp_path / "ft" / "ckpt.safetensors")
    assert ft["step"] == 1 and ft["init"]["exported"] and ft["init"]["step"] == 3
    saved = load_file(str(shipped / "model.safetensors"))
    assert torch.equal(ft["net"]["d2t"], saved["d2t"])
    assert not torch.equal(ft["net"]["fuse_taps.weight"], saved["fuse_taps.weight"].float())  # it trained on
    line = mod._init_line(ft)
    assert f"the exported drafter in `{shipped}` (3 steps" in line and "all rounds together: 4 steps" in line
    # Started from the shipped weights, not a fresh init: a step at a tiny learning rate stays next to them.
    train_main(flags + ["--run-dir", str(tmp_path / "ft0"), "--init-from", str(shipped), "--max-steps", "1", "--lr", "1e-7"])
    ft0 = load_checkpoint(tmp_path / "ft0" / "ckpt.safetensors")
    assert all(torch.allclose(ft0["net"][k].float(), v.float(), atol=1e-4) for k, v in saved.items())
    # An export from before training.json: it fine-tunes, and the card says where its history is.
    (shipped / "training.json").unlink()
    train_main(flags + ["--run-dir", str(tmp_path / "ft2"), "--init-from", str(shipped), "--max-steps", "1"])
    assert "no training.json beside it" in mod._init_line(load_checkpoint(tmp_path / "ft2" / "ckpt.safetensors"))
    with pytest.raises(SpecBlockError, match="holds a specblock drafter; pass --method specblock"):
        train_main(flags[:-2] + ["--method", "eagle3", "--run-dir", str(tmp_path / "ft3"), "--init-from", str(shipped)])
    with pytest.raises(SpecBlockError, match="trained with other settings"):
        train_main(flags[:-2] + ["--K", "4", "--run-dir", str(tmp_path / "ft4"), "--init-from", str(shipped)])
    from safetensors.torch import save_file

    save_file({k: v for k, v in saved.items() if k != "fuse_taps.weight"}, str(shipped / "model.safetensors"))
    with pytest.raises(SpecBlockError, match="trained with other settings"):  # never a fresh init
        train_main(flags + ["--run-dir", str(tmp_path / "ft6"), "--init-from", str(shipped)])
    with pytest.raises(SpecBlockError, match="nor an exported drafter"):
        train_main(flags + ["--run-dir", str(tmp_path / "ft5"), "--init-from", str(tmp_path / "gen")])


def test_served_gap_lookup_chain_is_what_prompt_lookup_proposes_at_each_root():
    mod = experiment("served_gap")
    seq = np.array([1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 9])
    hits = mod.lookup_hits(seq)
    assert hits.shape == (len(seq) - 1, mod.DEPTH)
    # root 5 (context ...4 1 2): the bigram 1 2 was followed by 3 4 1 2, and the text goes on 3 4 1 2
    assert hits[4].tolist() == [True] * 4
    # root 7 (context ...1 2 3 4): the trigram 2 3 4 was followed by 1 2 3 4, the text has 1 2 9: right twice
    assert hits[6].tolist() == [True, True, False, False]
    assert not hits[0].any()  # root 1 (context 1 2): nothing earlier to match
    assert not hits[-1].any()  # the last root has nothing after it


def test_served_gap_chains_match_the_heldout_evaluations(tmp_path, capsys):
    """experiments/served_gap.py counts chains by their root: over the same windows its per-depth
    means equal the training recipes' held-out figures (SpecBlock's block 1, EAGLE-3's chains),
    so its bench-text figures read on the held-out scale; and it runs end to end on bench prompts."""
    import argparse

    import torch

    from specblock.training import recipes
    from specblock.training.cachewindows import CacheWindows
    from specblock.training.featcache import FeatureCache

    mod = experiment("served_gap")
    sweep = experiment("vocab_sweep")
    tdir, model, cache = tiny_feature_cache(tmp_path)
    flags = ["--target", str(tdir), "--features", str(cache), "--draft-vocab", "20", "--window", "17", "--batch", "2",
             "--eval-every", "20", "--intermediate", "32", "--threads", "1", "--max-steps", "40", "--lr", "1e-2"]
    specs = []
    for method in ("specblock", "eagle3"):
        d = tmp_path / method / "d"
        train_main(flags + ["--method", method, "--run-dir", str(tmp_path / method), "--out", str(d)])
        net = sweep.load(method, d, model).eval()
        held = CacheWindows(FeatureCache(cache, tdir), 17, feature="taps").heldout(4, net)
        ev = recipes.get(method).evaluate(net, None, held, argparse.Namespace(ttt_steps=4))
        want = ev["block1_acc"] if method == "specblock" else ev["chain_acc"]
        # SpecBlock's block 1 counts every root of the window (a depth past its end: a miss), EAGLE-3's
        # chains the roots with every depth inside (R = 1..W-depths)
        roots = 16 if method == "specblock" else 16 - 4 + 1
        with torch.no_grad():
            hits = torch.stack([mod.chain_hits(method, net, tp)[:roots] for tp in held.split(1)])
        got = hits.float().mean((0, 1)).tolist()
        assert got == [pytest.approx(w, abs=1e-3) for w in want[: mod.DEPTH]], method
        assert 0 < got[0] <= 1  # something to compare: a random tiny drafter still hits sometimes
        specs += ["--drafter", f"{method}={method}:{d}"]
    out = tmp_path / "gap"
    assert mod.main(["--target", str(tdir), "--domains", "code,chat", "--prompts", "1", "--max-new-tokens", "6",
                     "--threads", "1", "--out", str(out)] + specs) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    assert [r["name"] for r in res["rows"]] == ["specblock", "eagle3"] and res["roots"]["code"] > 0
    # with prompt lookup's chain: the two-branch rows accept at least what either branch does, at most both
    assert mod.main(["--target", str(tdir), "--domains", "code,chat", "--prompts", "1", "--max-new-tokens", "6",
                     "--threads", "1", "--lookup", "--out", str(out)] + specs) == 0
    rows = {r["name"]: r["by_depth"] for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert list(rows) == ["specblock", "eagle3", "lookup", "specblock+lookup", "eagle3+lookup"]
    for name in ("specblock", "eagle3"):
        assert rows[name] == [r["by_depth"] for r in res["rows"] if r["name"] == name][0]  # unchanged by --lookup
        both = rows[f"{name}+lookup"]
        assert all(max(x, y) - 1e-9 <= u <= x + y + 1e-9 for x, y, u in zip(rows[name], rows["lookup"], both))
    # a chatgen shard's stored answers instead: roots are its answer positions (a 1-token answer has none)
    shard = tmp_path / "gen" / "shard_00000.jsonl"
    assert mod.main(["--target", str(tdir), "--domains", "chat", "--prompts", "5", "--max-new-tokens", "6", "--chatgen",
                     str(shard), "--threads", "1", "--out", str(out)] + specs) == 0
    ans = [json.loads(x)["answer_ids"][:6] for x in shard.read_text().splitlines()]
    assert json.loads(out.with_suffix(".json").read_text())["roots"] == {"chat": sum(len(a) - 1 for a in ans)}
    assert mod.main(["--target", str(tdir), "--out", str(tmp_path / "bad"), "--drafter", f"x=medusa:{tmp_path / 'eagle3' / 'd'}"]) == 2
    assert "has no chain here" in capsys.readouterr().err and not (tmp_path / "bad.json").exists()
