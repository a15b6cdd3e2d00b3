"""ParallelSpec-style training step: every window position drafts k tokens at once, soft CE.

The context stream runs the drafter causally over the window's g's (target taps at p fused with
x_{p+1}); the state at p predicts depth 1 (x_{p+2}). For every position p a group of k-1 [MASK]
queries at positions p+1..p+k-1 sees the context <= p and the group's earlier masks (causal), and
predicts depths 2..k: exactly what ``ParallelSpecDrafter.propose`` runs, for all p in one pass.

Loss: soft cross-entropy to the target's distribution at the position before each predicted
token (distillation; the ``lse - <h, E_p*[W]>`` identity with the frozen, shared LM head), mean
over valid positions per depth, depths weighted 0.8^(d-1) (as our EAGLE-3 and Medusa recipes).
Choices: no valid-prefix mask (ParallelSpec has none); corpus tokens as the context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specblock.runtime.drafters.parallelspec import FeatureNet, ParallelSpecNet, flat
from specblock.training.specblock_step import TargetPass

DEPTH_DECAY = 0.8


@dataclass
class DepthResult:
    loss: torch.Tensor
    top1: torch.Tensor  # [B, R, D] drafter argmax == target argmax at depth d (False where it has no head row)
    valid: torch.Tensor  # [R, D] the depth-d label of row r lies inside the window


def depth_loss(net: FeatureNet, states: torch.Tensor, tp: TargetPass, label: torch.Tensor, valid: torch.Tensor) -> DepthResult:
    """states ``[B, R, D, h]``; ``label [R, D]``: the window position whose target distribution
    depth d of row r is scored against. Under a draft vocabulary a label whose target argmax has
    no head row is not supervised (it can never be drafted right) and counts as a miss."""
    b, w = tp.tokens.shape
    j = label.clamp(0, w - 1)
    normed = net.normed(states)
    logits = net.lm_head(normed).float()
    ce = torch.logsumexp(logits, -1) - (normed.float() * tp.e_target[:, j]).sum(-1)  # [B, R, D]
    ok = valid[None].expand(b, *valid.shape)
    if tp.y_ok is not None:
        ok = ok & tp.y_ok[:, j]
    vf = ok.float()
    per_depth = (ce * vf).sum((0, 1)) / vf.sum((0, 1)).clamp_min(1)
    decay = DEPTH_DECAY ** torch.arange(label.shape[1], device=states.device, dtype=torch.float32)
    top1 = logits.detach().argmax(-1) == tp.y_star[:, j]
    return DepthResult((per_depth * decay).sum(), top1 if tp.y_ok is None else top1 & ok, valid)


def context_stream(net: FeatureNet, tp: TargetPass):
    """The causal pass over the window's g's: top states ``[B, R, h]`` and per-layer keys/values
    ``[B, H, R, d]`` (what the drafter's cache holds at serving time)."""
    b, w = tp.tokens.shape
    r, dev = w - 1, tp.tokens.device
    p = torch.arange(r, device=dev)
    g = net.g_from_taps(tp.taps[:, :r], tp.tokens[:, 1:])
    causal = torch.ones(r, r, dtype=torch.bool, device=dev).tril()
    out, kvs = net.run(g[:, None], p[None, None].expand(b, 1, r), None, None, causal)
    return g, out[:, 0], [flat(kv) for kv in kvs]


def parallelspec_states(net: ParallelSpecNet, tp: TargetPass) -> torch.Tensor:
    """``[B, R, k, h]``: row p, depth d's state (d = 1 from the context, 2..k from the masks)."""
    b, w = tp.tokens.shape
    r, dev, m = w - 1, tp.tokens.device, net.cfg.k - 1
    p = torch.arange(r, device=dev)
    _, top, ctx = context_stream(net, tp)
    pos = (p[:, None] + torch.arange(1, m + 1, device=dev))[None].expand(b, r, m)
    ctx_mask = (p[None, :] <= p[:, None])[None]  # the group of row p sees context <= p
    causal = torch.ones(m, m, dtype=torch.bool, device=dev).tril()
    q, _ = net.run(net.masks(b, r, m).to(top.dtype), pos, ctx, ctx_mask, causal)
    return torch.cat([top[:, :, None], q], dim=2)


def parallelspec_step(net: ParallelSpecNet, tp: TargetPass) -> DepthResult:
    w, dev = tp.tokens.shape[1], tp.tokens.device
    p = torch.arange(w - 1, device=dev)
    label = p[:, None] + torch.arange(1, net.cfg.k + 1, device=dev)  # depth d of row p: distribution at p+d
    return depth_loss(net, parallelspec_states(net, tp), tp, label, label <= w - 1)


def chain_acceptance(res: DepthResult) -> list[float]:
    """Held-out chain acceptance per depth: share of rows (with every depth inside the window)
    whose top-1 is right at every depth up to d (teacher-forced context)."""
    rows = res.valid.all(-1)
    ok = res.top1[:, rows].float().cumprod(-1)
    return [round(float(x), 4) for x in ok.mean((0, 1))]
