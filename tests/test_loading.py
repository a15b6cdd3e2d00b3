"""Targets and drafters whose files do not fit are refused with one line naming what is wrong:
missing, unexpected or misshapen weights (transformers would initialise them randomly and decode
garbage with status 0), truncated or empty safetensors, corrupt config.json or
generation_config.json, sizes that do not fit."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specblock.errors import SpecBlockError
from specblock.runtime.drafters.eagle3 import Eagle3Config, Eagle3Net
from specblock.runtime.drafters.specblock_net import SpecBlockConfig, SpecBlockNet
from specblock.runtime.target import TargetModel, default_taps
from tiny import save_tiny, tiny_model


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("load") / "base", "llama", vocab=64, layers=3)


def _edit_config(**kw):
    def edit(d):
        cfg = json.loads((d / "config.json").read_text())
        for k, v in kw.items():
            if v is None:
                cfg.pop(k, None)
            else:
                cfg[k] = v
        (d / "config.json").write_text(json.dumps(cfg))
    return edit


def _truncate(name, keep):
    def edit(d):
        data = (d / name).read_bytes()
        (d / name).write_bytes(data[: int(len(data) * keep)])
    return edit


TARGET_CASES = {
    "config with more layers than the weights": (_edit_config(num_hidden_layers=4), "missing model.layers.3."),
    "config with fewer layers than the weights": (_edit_config(num_hidden_layers=2), "unexpected model.layers.2."),
    "config sizes differ from the weights": (_edit_config(intermediate_size=80), "has shape (32, 64) but config.json says (32, 80)"),
    "a BERT config without architectures": (_edit_config(model_type="bert", architectures=None), "missing bert."),
    "sizes that do not fit": (_edit_config(num_attention_heads=5), "not a multiple"),
    "corrupt config.json": (lambda d: (d / "config.json").write_text('{"model_type": "llama", '), "config.json"),
    "corrupt generation_config.json": (lambda d: (d / "generation_config.json").write_text("{oops"), "generation_config.json"),
    "non-UTF-8 generation_config.json": (lambda d: (d / "generation_config.json").write_bytes(b"\xff\xfe{"), "generation_config.json"),
    "empty safetensors": (_truncate("model.safetensors", 0.0), "SafetensorError"),
    "truncated safetensors": (_truncate("model.safetensors", 0.5), "SafetensorError"),
}


@pytest.mark.parametrize("case", TARGET_CASES)
def test_bad_target_is_one_line(base, tmp_path, case):
    edit, needle = TARGET_CASES[case]
    d = tmp_path / "m"
    shutil.copytree(base, d)
    edit(d)
    with pytest.raises(SpecBlockError) as e:
        TargetModel.load(d, "float32", "cpu")
    msg = str(e.value)
    assert needle in msg and "\n" not in msg, msg


def test_matching_target_loads_and_equals_the_saved_model(base):
    loaded = TargetModel.load(base, "float32", "cpu").model
    ref = tiny_model("llama", vocab=64, layers=3)
    for (k, a), b in zip(ref.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), k


# ---------------------------------------------------------------------------------- drafters
def _specblock(d, target):
    cfg = SpecBlockConfig(vocab_size=64, hidden_size=32, num_heads=4, intermediate_size=64, tap_layers=default_taps(3))
    net = SpecBlockNet(cfg)
    net.tie_to_target(target.model)
    net.save(d)
    return lambda: SpecBlockNet.load(d, target.model.get_input_embeddings().weight, target.model.lm_head.weight)


def _eagle3(d, target):
    net = Eagle3Net(Eagle3Config(vocab_size=64, hidden_size=32, num_heads=4, intermediate_size=64, tap_layers=default_taps(3)))
    net.tie_to_target(target.model)
    net.save(d)
    return lambda: Eagle3Net.load(d, target.model)


def _drop_one(d):
    state = load_file(str(d / "model.safetensors"))
    state.pop(sorted(state)[0])
    save_file(state, str(d / "model.safetensors"))


def _add_one(d):
    state = load_file(str(d / "model.safetensors"))
    state["extra.weight"] = torch.zeros(2)
    save_file(state, str(d / "model.safetensors"))


DRAFTER_CASES = {
    "missing weight": (_drop_one, "missing"),
    "unexpected weight": (_add_one, "unexpected extra.weight"),
    "config sizes differ": (_edit_config(intermediate_size=80), "has shape"),
    "config with an unknown field": (_edit_config(bogus=1), "bogus"),
    "config with a bad value": (_edit_config(num_heads="x"), "num_heads"),
    "corrupt config.json": (lambda d: (d / "config.json").write_text("{"), "not valid JSON"),
    "empty safetensors": (_truncate("model.safetensors", 0.0), "cannot read"),
    "truncated safetensors": (_truncate("model.safetensors", 0.5), "cannot read"),
}


@pytest.mark.parametrize("kind", [_specblock, _eagle3], ids=["specblock", "eagle3"])
@pytest.mark.parametrize("case", DRAFTER_CASES)
def test_bad_drafter_is_one_line(base, tmp_path, kind, case):
    target = TargetModel.load(base, "float32", "cpu")
    load = kind(tmp_path / "drafter", target)
    load()  # the untouched drafter loads
    edit, needle = DRAFTER_CASES[case]
    edit(tmp_path / "drafter")
    with pytest.raises(SpecBlockError) as e:
        load()
    msg = str(e.value)
    assert needle in msg and "\n" not in msg, msg
