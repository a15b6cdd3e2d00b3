"""calibrate's SpecBlock timing: the fields the simulator reads, in the format it validates."""

import numpy as np
import torch

from specblock.runtime.calibrate import time_specblock
from specblock.runtime.drafters.specblock_net import SpecBlockConfig, SpecBlockNet
from specblock.runtime.target import TargetModel
from specblock.sim.latency import DrafterTiming
from tiny import tiny_model


def test_specblock_timing_has_k_and_propose_overhead(tmp_path):
    model = tiny_model("llama", vocab=32, seed=0, layers=3, ctx=512)
    target = TargetModel(model)
    cfg = SpecBlockConfig(vocab_size=32, hidden_size=32, num_heads=4, intermediate_size=64, tap_layers=target.tap_layers)
    torch.manual_seed(0)
    net = SpecBlockNet(cfg)
    net.tie_to_target(model)
    net.save(tmp_path / "d")
    out = time_specblock(target, tmp_path / "d", reps=2, rng=np.random.default_rng(0))
    timing = DrafterTiming.model_validate(out)  # extra fields would be refused
    assert timing.K == cfg.K and timing.n_query == [cfg.K * s for s in (1, 2, 3, 4)]
    assert timing.overhead_ms >= 0 and all(m > 0 for m in timing.ms)
    np.testing.assert_allclose(timing.positions(), [(cfg.K + 1) * s for s in (1, 2, 3, 4)])
    assert timing.first_ms > 0 and timing.compiled is False


def test_compiled_calibration_times_the_static_target_and_block(tmp_path, monkeypatch):
    """``calibrate --compile``: the static target rewinds by its position alone, and SpecBlock's
    block 1 is timed in its steady state on static buffers (one new position, padded to a row
    bucket, written to the same slot each time), not through the eager first-block path. The
    static pieces run uncompiled here (``compile=False``: the same padded steps, no inductor)."""
    import specblock.runtime.cli as cli
    from specblock.compiled.drafter import ROW_BUCKETS, StaticSpecBlockDrafter
    from specblock.compiled.target import StaticTarget
    from specblock.runtime.calibrate import time_target

    model = tiny_model("llama", vocab=32, seed=0, layers=3, ctx=512)
    target = StaticTarget(model, compile=False)
    f, glue = time_target(target, 64, 5, 3, np.random.default_rng(0))
    assert f > 0 and glue >= 0 and target.past_len == 64
    cfg = SpecBlockConfig(vocab_size=32, hidden_size=32, num_heads=4, intermediate_size=64, tap_layers=target.tap_layers)
    torch.manual_seed(0)
    net = SpecBlockNet(cfg)
    net.tie_to_target(model)
    net.save(tmp_path / "d")
    rows = []
    step = StaticSpecBlockDrafter._step

    def counted(self, taps, *args):
        rows.append(taps.shape[0])
        return step(self, taps, *args)

    monkeypatch.setattr(StaticSpecBlockDrafter, "_step", counted)
    monkeypatch.setattr(cli, "maybe_compile_drafter",
                        lambda d, t: StaticSpecBlockDrafter(d, capacity=t.max_context + 16, compile=False))
    out = time_specblock(target, tmp_path / "d", reps=2, rng=np.random.default_rng(0), compiled=True)
    timing = DrafterTiming.model_validate(out)
    assert timing.ms[0] > 0 and timing.first_ms > 0 and timing.compiled is True
    assert rows[0] == 254 and set(rows[1:]) == {ROW_BUCKETS[0]}  # the prompt once, then one new position padded



def test_calibrate_compiles_block_1_where_serving_json_names_drafter_compiled(tmp_path, monkeypatch):
    """Beside an eager target, as the CLI and the bench serve it: a serving.json that says
    ``drafter_compiled`` gets block 1 compiled and timed as ``first_ms``; ``--eager-drafter`` keeps
    it eager. (The static block runs uncompiled here: the same steps, no inductor.)"""
    import json

    import specblock.runtime.cli as cli
    from specblock.compiled.drafter import StaticSpecBlockDrafter
    from specblock.runtime.calibrate import main
    from tiny import save_tiny

    save_tiny(tmp_path / "t", "llama", vocab=32, ctx=512, layers=3)
    target = TargetModel.load(tmp_path / "t", "float32", "cpu")
    cfg = SpecBlockConfig(vocab_size=32, hidden_size=32, num_heads=4, intermediate_size=64, tap_layers=target.tap_layers)
    torch.manual_seed(0)
    net = SpecBlockNet(cfg)
    net.tie_to_target(target.model)
    net.save(tmp_path / "d" / "specblock")
    (tmp_path / "d" / "specblock" / "serving.json").write_text(json.dumps({"drafter_compiled": True}))
    built = []

    def static(d, t):
        built.append(t)
        return StaticSpecBlockDrafter(d, capacity=t.max_context + 16, compile=False)

    monkeypatch.setattr(cli, "maybe_compile_drafter", static)
    for extra, compiled in (([], True), (["--eager-drafter"], False)):
        out = tmp_path / f"lat{len(extra)}.json"
        args = ["--target", str(tmp_path / "t"), "--drafter-dir", str(tmp_path / "d"), "--dtype", "float32",
                "--ctx", "64", "--reps", "1", "--out", str(out), *extra]
        assert main(args) == 0
        timing = DrafterTiming.model_validate(json.loads(out.read_text())["drafters"]["specblock"])
        assert timing.compiled is compiled and timing.first_ms > 0
    assert len(built) == 1
