"""The shipped assets load through the plain HF path and cannot change silently."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specblock.models import MODELS
from specblock.runtime.config import DEFAULT_DRAFTERS, DEFAULT_TARGET
from specblock.runtime.drafters.specblock import SpecBlockDrafter
from specblock.runtime.engine import Engine
from specblock.runtime.target import TargetModel

PROMPT = "def add(a, b):\n"
EXPECTED = Path(__file__).parent / "data" / "assets_expected.json"


def test_target_loads_with_auto_classes_and_greedy_tokens_are_pinned():
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_TARGET, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(DEFAULT_TARGET)
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out[0, ids.shape[1]:].tolist() == json.loads(EXPECTED.read_text())["target_greedy"]


def test_shipped_drafter_is_lossless_on_the_shipped_target():
    target = TargetModel.load(DEFAULT_TARGET, "float32", "cpu")
    tok = AutoTokenizer.from_pretrained(DEFAULT_TARGET)
    ids = np.asarray(tok(PROMPT)["input_ids"])
    plain = Engine(target, SpecBlockDrafter.load(DEFAULT_DRAFTERS / "specblock", target), budget=0).generate(ids, 24)
    spec = Engine(target, SpecBlockDrafter.load(DEFAULT_DRAFTERS / "specblock", target), budget=24).generate(ids, 24)
    assert spec.token_ids == plain.token_ids
    assert spec.token_ids[:12] == json.loads(EXPECTED.read_text())["target_greedy"]


SHIPPED = sorted(p.name for p in DEFAULT_DRAFTERS.iterdir() if (p / "config.json").is_file())


@pytest.mark.parametrize("method", [m for m in SHIPPED if m != "specblock"])
def test_every_shipped_baseline_drafter_is_lossless_on_the_shipped_target(method):
    from specblock.runtime import drafters
    from specblock.runtime.drafters.base import ARDrafter

    target = TargetModel.load(DEFAULT_TARGET, "float32", "cpu")
    tok = AutoTokenizer.from_pretrained(DEFAULT_TARGET)
    ids = np.asarray(tok(PROMPT)["input_ids"])
    plain = Engine(target, ARDrafter()).generate(ids, 24)
    spec = Engine(target, drafters.build(method, target, {"drafter": DEFAULT_DRAFTERS / method}), budget=24).generate(ids, 24)
    assert spec.token_ids == plain.token_ids
    assert spec.token_ids[:12] == json.loads(EXPECTED.read_text())["target_greedy"]
    assert max(spec.stats.accepted) > 0  # a trained drafter gets drafts accepted on its own text


def test_shipped_weights_stay_within_budget_with_a_card_each():
    """Shipped weights live in git: at most 160 MB under specblock/assets, the real model's
    drafters at most 100 MB of it, and every drafter directory carries its model card."""
    assets = DEFAULT_TARGET.parent
    size = lambda root: sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    assert size(assets) <= 160e6
    real = MODELS["smollm2-135m-instruct"].drafters
    assert not real.exists() or size(real) <= 100e6
    assert {"specblock", "eagle3"} <= set(SHIPPED)
    for cfg in assets.rglob("config.json"):
        assert (cfg.parent / "README.md").is_file(), cfg.parent
