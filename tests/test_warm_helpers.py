"""A first start's tree sizes compiled in helper processes (``compiled/warm_helpers.py``): the server
loads what they saved, compiles the rest itself, and decodes exactly as before; a helper that fails
leaves its sizes to the server."""

import dataclasses

import numpy as np
import pytest

from specblock.compiled import compile_target
from specblock.compiled.warm_helpers import helper_count, split
from specblock.runtime.drafters import RandomDrafter
from specblock.runtime.engine import Engine
from specblock.runtime.target import TargetModel
from tiny import hf_greedy, tiny_model

VOCAB = 12


def test_the_server_keeps_the_larger_share_and_helpers_need_free_cores(monkeypatch):
    assert split([6, 3, 4], 1) == ([4, 6], [[3]])
    assert split([2, 4], 1) == ([4], [[2]])
    assert split([1, 2, 3, 4, 6], 2) == ([3, 4, 6], [[1], [2]])
    assert split([3, 4], 0) == ([3, 4], [])
    monkeypatch.setenv("SPECBLOCK_WARM_HELPERS", "3")
    assert [helper_count(n) for n in (0, 1, 2, 3, 4, 9)] == [0, 0, 1, 1, 2, 3]
    monkeypatch.setenv("SPECBLOCK_WARM_HELPERS", "0")
    assert helper_count(6) == 0
    monkeypatch.setenv("SPECBLOCK_WARM_HELPERS", "many")
    with pytest.warns(UserWarning, match="not a number"):
        assert helper_count(6) == 0


@pytest.fixture
def saved_model(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # cold: nothing saved yet
    monkeypatch.setenv("SPECBLOCK_WARM_HELPERS", "1")  # one helper even on one core
    model = tiny_model("llama", vocab=VOCAB, seed=6, layers=2)
    model.save_pretrained(tmp_path / "model")
    return model, tmp_path / "model"


def _decode_without_compiling(target, model) -> None:
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    prompt = np.random.default_rng(2).integers(2, VOCAB, 10)
    res = Engine(target, RandomDrafter(VOCAB, seed=1), budget=3).generate(prompt, 16)
    assert res.token_ids == hf_greedy(model, prompt, 16)
    assert set(res.stats.tree_size) > {1} and counters["stats"]["unique_graphs"] == graphs


def test_a_helper_compiles_some_tree_sizes_and_the_server_loads_them(saved_model):
    from torch._dynamo.utils import counters

    from specblock.compiled.precompile import entry_path, own_code, shape_tag

    model, path = saved_model
    target = compile_target(TargetModel.load(path, "float32", "cpu"))
    graphs = counters["stats"]["unique_graphs"]
    assert target.warm(4, (2, 3, 4)) == [2, 3, 4]  # buckets 2 (the helper's), 3 and 4 (the server's)
    assert counters["stats"]["unique_graphs"] - graphs == 2  # bucket 2 was loaded, not compiled here
    assert all(entry_path(own_code(target._step, shape_tag(target.tag, shape))).exists() for shape in target.step_fns)
    assert {shape[0] for shape in target.step_fns} == {2, 3, 4}
    _decode_without_compiling(target, model)


def test_a_failed_helper_leaves_its_sizes_to_the_server(saved_model, tmp_path):
    from torch._dynamo.utils import counters

    model, path = saved_model
    target = compile_target(TargetModel.load(path, "float32", "cpu"))
    target.source = dataclasses.replace(target.source, path=str(tmp_path / "gone"))  # the helper cannot load it
    graphs = counters["stats"]["unique_graphs"]
    with pytest.warns(UserWarning, match="a helper compiling 1 tree size"):
        assert target.warm(4, (2, 4)) == [2, 4]
    assert counters["stats"]["unique_graphs"] - graphs == 2
    _decode_without_compiling(target, model)


def test_a_stuck_helper_is_stopped_and_its_sizes_left_to_the_server():
    import subprocess
    import sys
    import tempfile
    import time

    from specblock.compiled.warm_helpers import Helper

    helper = Helper.__new__(Helper)  # its process: one that never finishes
    helper.buckets, helper.log = [3], tempfile.TemporaryFile(mode="w+")
    helper.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    start = time.perf_counter()
    with pytest.warns(UserWarning, match="still running after 1 s"):
        assert helper.wait(timeout=1.0) is False
    assert time.perf_counter() - start < 30 and helper.proc.poll() is not None
