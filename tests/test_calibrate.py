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
    assert DrafterTiming.model_validate(out).ms[0] > 0
    assert rows[0] == 254 and set(rows[1:]) == {ROW_BUCKETS[0]}  # the prompt once, then one new position padded

