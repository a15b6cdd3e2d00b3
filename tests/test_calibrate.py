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
