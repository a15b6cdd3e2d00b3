"""EAGLE-3-style training step: training-time test (TTT) over several draft depths, soft CE.

Step 1 runs the layer over the whole window, causal, from the target's taps:
``s1_p = layer(g(F_p, x_{p+1}))``, supervised by the target's distribution at p+1 (it predicts
x_{p+2}). Step d >= 2 replays what serving does at depth d: its query at position p reads the
layer's *own* state from step d-1 one position back, ``g(s^{d-1}_{p-1}, x_{p+1})``, and attends
to exactly what the runtime drafter's depth-d node attends to: the committed cache (step-1 keys
at positions <= p-d+1), its drafted ancestors (step-i keys at position p-d+i, i = 2..d-1) and
itself. Rows whose chain would start before the window (p < d-1) are masked out of the loss.

Choices: tokens along a chain are teacher-forced from the window (EAGLE-3 does the same); the
step losses are weighted 0.8^(d-1) (EAGLE-3's public training code); every position is
supervised (no valid-prefix mask: EAGLE-3 has none) except, under a draft vocabulary, one whose
target argmax has no head row (it can never be drafted right; ``TargetPass.y_ok``); soft targets
come from the target as for SpecBlock, through the ``lse - <h, E_p*[W]>`` identity with the
frozen, shared LM head (its draft-vocabulary rows).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from specblock.runtime.drafters.eagle3 import Eagle3Net
from specblock.runtime.drafters.layers import flat_kv
from specblock.training.specblock_step import TargetPass

STEP_DECAY = 0.8


def ttt_states(net: Eagle3Net, taps: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The layer's output states ``[B, W-1, h]`` for depths 1..steps; row p of depth d is the
    state that predicts x_{p+2} on the chain rooted at R = p-d+2."""
    b, w = tokens.shape
    r, dev = w - 1, tokens.device
    p = torch.arange(r, device=dev)
    nxt = tokens[:, 1:]
    x = net.g_from_taps(taps[:, :r], nxt)  # [B, R, h]
    out, kv = net.layer(x[:, None], p[None, None].expand(b, 1, r))
    states, kvs = [out[:, 0]], [flat_kv(kv)]
    q = p[:, None]
    for d in range(2, steps + 1):
        prev = F.pad(states[-1][:, :-1], (0, 0, 1, 0))  # s^{d-1}_{p-1}, zeros at p = 0
        x = net.g(prev, nxt)[:, :, None]  # [B, R, 1, h]: R one-query blocks
        parts = [p[None, :] <= q - d + 1] + [p[None, :] == q - d + i for i in range(2, d)]
        mask = torch.cat(parts, dim=-1)[None]  # [1, R, (d-1) R]
        ctx = (torch.cat([k for k, _ in kvs], -2), torch.cat([v for _, v in kvs], -2))
        out, kv = net.layer(x, p[None, :, None].expand(b, r, 1), ctx, mask)
        states.append(out[:, :, 0])
        kvs.append(flat_kv(kv))
    return states


@dataclass
class Eagle3Result:
    loss: torch.Tensor
    top1: list[torch.Tensor]  # per depth [B, W-1] drafter argmax == target argmax
    valid: list[torch.Tensor]  # per depth [W-1] rows that belong to a chain inside the window
    postfix: dict = field(default_factory=dict)


def depth_ce(net: Eagle3Net, s: torch.Tensor, e_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One depth's soft cross-entropy [B, R] against the target's head-row expectation, and the
    drafter's argmax (no gradient): the only part of the step that runs over the vocabulary."""
    normed = net.normed(s)
    logits = net.lm_head(normed).float()
    return torch.logsumexp(logits, -1) - (normed.float() * e_t).sum(-1), logits.detach().argmax(-1)


def eagle3_step(net: Eagle3Net, tp: TargetPass, steps: int, ce_fn: Callable | None = None) -> Eagle3Result:
    """``ce_fn``: :func:`depth_ce` or a compiled copy of it (``--compile``)."""
    b, w = tp.tokens.shape
    r, dev = w - 1, tp.tokens.device
    p = torch.arange(r, device=dev)
    e_t, y_t = tp.e_target[:, 1:], tp.y_star[:, 1:]  # the distribution at p+1 predicts x_{p+2}
    y_ok = torch.ones_like(y_t, dtype=torch.bool) if tp.y_ok is None else tp.y_ok[:, 1:]
    loss = torch.zeros((), device=dev)
    top1, valid = [], []
    for d, s in enumerate(ttt_states(net, tp.taps, tp.tokens, steps), start=1):
        ce, pred = (ce_fn or depth_ce)(net, s, e_t)  # [B, R] each
        ok = (p >= d - 1) & y_ok  # [B, R]
        loss = loss + STEP_DECAY ** (d - 1) * (ce * ok).sum() / ok.sum().clamp_min(1)
        top1.append((pred == y_t) & y_ok)
        valid.append(p >= d - 1)
    return Eagle3Result(loss, top1, valid)


def chain_acceptance(res: Eagle3Result) -> list[float]:
    """Held-out chain acceptance per depth: the share of roots whose draft chain (top-1 at every
    depth, teacher-forced tokens) is right at depths 1..d. Roots R = 1..W-steps (all depths inside)."""
    steps = len(res.top1)
    r = res.top1[0].shape[1]
    roots = torch.arange(1, r - steps + 2)  # R such that row p = R-2+d stays inside for every d
    ok = torch.ones(res.top1[0].shape[0], roots.numel(), dtype=torch.bool)
    out = []
    for d in range(1, steps + 1):
        ok = ok & res.top1[d - 1][:, (roots - 2 + d).to(res.top1[0].device)].cpu()
        out.append(round(float(ok.float().mean()), 4))
    return out
