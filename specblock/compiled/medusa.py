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

from specblock.compiled import precompile
from specblock.compiled.notice import notice_if_slow
from specblock.compiled.target import CPU_OPTIONS, _allow_recompiles, own_code, use_disk_cache
from specblock.runtime.drafters.medusa import MedusaDrafter


class StaticMedusaDrafter(MedusaDrafter):
    """A ``MedusaDrafter`` whose heads run as one compiled graph (``compile=False``: the same
    function eagerly, the tests' check of the packing)."""

    def __init__(self, drafter: MedusaDrafter, compile: bool = True) -> None:
        super().__init__(drafter.net)
        self.compiled, self.saved, self._met = compile, False, False
        self._heads_fn = self._heads
        if compile:
            use_disk_cache()
            _allow_recompiles()
            cpu = self.net.lm_head.weight.device.type == "cpu"
            opts = dict(CPU_OPTIONS) if cpu else {}
            kw = {"options": opts} if opts else {"mode": "reduce-overhead"}
            self.saved = cpu
            build = precompile.compile_saved if cpu else torch.compile
            self._heads_fn = build(own_code(self._heads, precompile.tag(self.net, opts) if cpu else None), dynamic=False, **kw)

    def _heads(self, top: torch.Tensor) -> torch.Tensor:
        """``[heads, 2k]``: each head's top-k log-probs, then their target ids (as floats)."""
        net = self.net
        logits = net.logits(top.to(net.lm_head.weight.dtype))[0]
        best = torch.log_softmax(logits.float(), -1).topk(min(net.cfg.top_k, logits.shape[-1]), dim=-1)
        return torch.cat([best.values, net.token_ids(best.indices).to(best.values.dtype)], -1)

    @torch.no_grad()
    def warm(self) -> list[tuple]:
        """Compile (or load) the one graph before a server listens. Returns the shape warmed."""
        if not self.compiled:
            return []
        w = self.net.lm_head.weight
        self._candidates(torch.zeros(1, self.net.cfg.hidden_size, device=w.device, dtype=w.dtype))
        return [(1, self.net.cfg.hidden_size)]

    def _candidates(self, top: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        top = top.contiguous()
        if not self.compiled:
            packed = self._heads(top)
        elif not self._met:  # compiles (or loads) the one graph
            with notice_if_slow("compiling Medusa's heads"):
                packed = precompile.first_call(self._heads_fn, top) if self.saved else self._heads_fn(top)
            self._met = True
        else:
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):  # one shape, this drafter's own code
                packed = self._heads_fn(top)
        host = packed.cpu().numpy()  # a CUDA graph's output is copied out before the next replay
        k = host.shape[-1] // 2
        return host[:, k:].astype(np.int64), host[:, :k]
