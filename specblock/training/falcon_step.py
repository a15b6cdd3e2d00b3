"""Falcon-style training step: F semi-autoregressive blocks per window position, glancing inputs.

For every window position r (the last committed position; root x_{r+1}), block 1 reads the g's
of positions r-bs+1..r (target taps + the next token) with full attention inside the block and the
causal context stream at positions <= r-bs; block n >= 2 reads, per slot i, the drafter's own
output state of slot i in block n-1 fused with the token that slot predicted, and sees every
earlier block of its row: exactly what ``FalconDrafter.propose`` runs for one seed, for all r in
one pass per block.

Glancing (Falcon's CSGD, simplified to per-token draws): the token fed to block n is the drafter's
argmax from block n-1; where it is wrong (differs from the window's token) it is replaced by the
window's token with probability ``glance``, which the recipe lowers over training (teacher forcing
early, the drafter's own predictions late, as at serving time). Loss: ``parallelspec_step``'s
soft CE per depth (d = 1..bs*F) with 0.8^(d-1) weights; rows r < bs-1 have no block 1 and are
masked out.
"""

from __future__ import annotations

import torch

from specblock.runtime.drafters.falcon import FalconNet
from specblock.training.parallelspec_step import DepthResult, context_stream, depth_loss
from specblock.training.specblock_step import TargetPass


def falcon_states(net: FalconNet, tp: TargetPass, forwards: int, glance: float, gen: torch.Generator | None) -> torch.Tensor:
    """``[B, R, bs*F, h]``: row r, depth d's state (block (d-1)//bs, slot (d-1)%bs)."""
    b, w = tp.tokens.shape
    r, dev, bs = w - 1, tp.tokens.device, net.cfg.block_size
    p = torch.arange(r, device=dev)
    i = torch.arange(bs, device=dev)
    g, _, ctx = context_stream(net, tp)
    ctx_mask = (p[None, :] <= p[:, None] - bs)[None]  # context strictly before block 1
    slot_pos = p[:, None] - bs + 1 + i  # [R, bs] block 1's positions
    x = g[:, slot_pos.clamp(min=0)]
    prefix, states = None, []
    for n in range(forwards):
        own = torch.ones(bs, bs * (n + 1), dtype=torch.bool, device=dev)  # block-causal over the row's blocks
        pos = (slot_pos + bs * n).clamp(min=0)[None].expand(b, r, bs)
        out, kvs = net.run(x, pos, ctx, ctx_mask, own, prefix)
        states.append(out)
        if n == forwards - 1:
            break
        prefix = kvs if prefix is None else [(torch.cat([pk, k], -2), torch.cat([pv, v], -2)) for (pk, pv), (k, v) in zip(prefix, kvs)]
        truth = tp.tokens[:, (p[:, None] + bs * n + 2 + i).clamp(max=w - 1)]  # slot i's predicted position
        with torch.no_grad():
            pred = net.token_ids(net.logits(out).argmax(-1))  # head rows -> token ids
            keep = pred != truth
            if glance > 0:
                u = torch.rand(keep.shape, generator=gen, device=dev) if gen is not None else torch.rand(keep.shape, device=dev)
                keep &= u >= glance
        x = net.g(out, torch.where(keep, pred, truth))
    return torch.cat(states, dim=2)


def falcon_step(net: FalconNet, tp: TargetPass, forwards: int, glance: float, gen: torch.Generator | None = None) -> DepthResult:
    w, dev, bs = tp.tokens.shape[1], tp.tokens.device, net.cfg.block_size
    p = torch.arange(w - 1, device=dev)
    label = p[:, None] + torch.arange(1, bs * forwards + 1, device=dev)  # depth d of row r: distribution at r+d
    valid = (label <= w - 1) & (p[:, None] >= bs - 1)
    return depth_loss(net, falcon_states(net, tp, forwards, glance, gen), tp, label, valid)


def glance_at(progress: float, start: float, end: float) -> float:
    """Glancing probability: linear from ``start`` to ``end`` over the run."""
    return start + (end - start) * min(max(progress, 0.0), 1.0)


__all__ = ["falcon_states", "falcon_step", "glance_at", "DepthResult"]
