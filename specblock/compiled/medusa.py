"""Medusa's heads on a static shape, compiled (issue 16, item 2): the residual heads, the LM head
over the draft vocabulary, the log-softmax, the top-k and the vocabulary map in one graph of one
input shape (the target's top state, ``[1, h]``), one host copy per step.

Why static: ``torch.compile(dynamic=True)`` of the same heads was slower than eager
(``compiled_drafters.md``: 1.09 -> 1.32 ms), its guards costing more than the few ops it fused.
With one fixed shape, a first-use compile per process (saved for later starts, as the target's)
and the guards skipped for the shape once met (as ``compiled/target.py`` does), the graph call is
all that is left. The tree shape is Medusa's static tree either way; candidates equal the eager
heads' up to float rounding (tests hold the trees equal at fp32).
"""

from __future__ import annotations

import numpy as np
import torch

from specblock.compiled.step import CompiledStep
from specblock.runtime.drafters.medusa import MedusaDrafter


class StaticMedusaDrafter(MedusaDrafter):
    """A ``MedusaDrafter`` whose heads run as one compiled graph (``compile=False``: the same
    function eagerly, the tests' check of the packing)."""

    def __init__(self, drafter: MedusaDrafter, compile: bool = True) -> None:
        super().__init__(drafter.net)
        self.compiled = compile
        w = self.net.lm_head.weight
        self.heads = CompiledStep(self._heads, self.net, w.device, {}) if compile else None  # one key: (1, h)

    def _heads(self, top: torch.Tensor) -> torch.Tensor:
        """``[heads, 2k]``: each head's top-k log-probs, then their target ids (as floats)."""
        net = self.net
        logits = net.logits(top)[0]
        best = torch.log_softmax(logits.float(), -1).topk(min(net.cfg.top_k, logits.shape[-1]), dim=-1)
        return torch.cat([best.values, net.token_ids(best.indices).to(best.values.dtype)], -1)

    @torch.no_grad()
    def warm(self) -> list[tuple]:
        """Compile (or load) the one graph before a server listens. Returns the shape warmed."""
        if not self.compiled:
            return []
        w = self.net.lm_head.weight
        self._candidates(torch.zeros(1, self.net.cfg.hidden_size, device=w.device, dtype=w.dtype))
        return sorted(self.heads.shapes)

    def _candidates(self, top: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        top = top.to(self.net.lm_head.weight.dtype).contiguous()  # one graph input dtype, whatever the target's
        packed = self.heads(tuple(top.shape), "Medusa's heads", top) if self.compiled else self._heads(top)
        host = packed.cpu().numpy()
        k = host.shape[-1] // 2
        return host[:, k:].astype(np.int64), host[:, :k]
