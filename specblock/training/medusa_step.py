"""Medusa-1 training step: head i at position p learns the token x_{p+2+i}.

Targets: by default the target's own distribution at position p+1+i (soft CE, Medusa's
"self-distillation"; the project's rule that a drafter predicts the *target's* token), or with
``hard=True`` the window's token x_{p+2+i} (Medusa-1's plain cross-entropy). Head losses are
weighted 0.8^i as in the Medusa paper. The target is frozen: only the residual blocks learn.
Under a draft vocabulary (``MedusaNet.cfg.draft_vocab``) labels are head rows and a label outside
the vocabulary is not supervised (it can never be drafted right).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specblock.runtime.drafters.medusa import MedusaNet
from specblock.training.specblock_step import Batched, soft_targets

HEAD_DECAY = 0.8


@dataclass
class MedusaPass(Batched):
    tokens: torch.Tensor  # [B, W]
    top: torch.Tensor  # [B, W, h] the target's final (post-norm) hidden state, float
    e_target: torch.Tensor  # [B, W, h] E_{v ~ p*}[W_v] for the distribution at each position
    y_star: torch.Tensor  # [B, W] the target's argmax next token (a head row under a draft vocabulary)
    y_ok: torch.Tensor | None = None  # [B, W] bool: that token is in the draft vocabulary (None: all are)


@torch.no_grad()
def medusa_pass(model, tokens: torch.Tensor, net: MedusaNet | None = None) -> MedusaPass:
    out = model(input_ids=tokens, output_hidden_states=True)
    return MedusaPass(tokens, out.hidden_states[-1].float(), *soft_targets(out.logits, model, net))


@dataclass
class MedusaResult:
    loss: torch.Tensor
    logits: torch.Tensor  # [B, W, heads, V] (detached use only)
    valid: torch.Tensor  # [B, W, heads] position p has a label for head i (in the draft vocabulary)
    labels: torch.Tensor  # [B, W, heads] the token each head is scored against (target argmax, or x for hard)
    top1: torch.Tensor  # [B, W, heads]


def medusa_step(net: MedusaNet, mp: MedusaPass, hard: bool = False) -> MedusaResult:
    b, w = mp.tokens.shape
    heads, dev = net.cfg.heads, mp.tokens.device
    p = torch.arange(w, device=dev)
    i = torch.arange(heads, device=dev)
    src = p[:, None] + 1 + i[None, :]  # [W, heads]: the target position whose next token head i predicts
    valid = (src + (1 if hard else 0) <= w - 1)[None].expand(b, w, heads)
    src = src.clamp(max=w - 1)
    states = net.states(mp.top.to(net.lm_head.weight.dtype))  # [B, W, heads, h]
    logits = net.lm_head(states).float()
    lse = torch.logsumexp(logits, -1)
    if hard:
        labels = net.t2d()[mp.tokens[:, (src + 1).clamp(max=w - 1)]]  # token ids -> head rows, -1 outside
        valid = valid & (labels >= 0)
        labels = labels.clamp_min(0)
        ce = lse - logits.gather(-1, labels[..., None])[..., 0]
    else:
        labels = mp.y_star[:, src]
        if mp.y_ok is not None:
            valid = valid & mp.y_ok[:, src]
        ce = lse - (states.float() * mp.e_target[:, src]).sum(-1)  # lse - <s, E_p*[W]>, exact for soft CE
    vf = valid.float()
    per_head = (ce * vf).sum((0, 1)) / vf.sum((0, 1)).clamp_min(1)
    loss = (per_head * HEAD_DECAY ** i.float()).sum()
    top1 = (logits.detach().argmax(-1) == labels) & valid
    return MedusaResult(loss, logits.detach(), valid, labels, top1)


@torch.no_grad()
def rank_accuracy(res: MedusaResult, top_k: int) -> torch.Tensor:
    """[heads, top_k]: share of valid positions whose label sits at rank r of head i (ties count
    in the label's favour). What Medusa's static tree search is calibrated on."""
    tgt = res.logits.gather(-1, res.labels[..., None])
    rank = (res.logits > tgt).sum(-1)  # [B, W, heads]
    onehot = torch.nn.functional.one_hot(rank.clamp(max=top_k), top_k + 1)[..., :top_k].float()
    vf = res.valid.float()[..., None]
    return (onehot * vf).sum((0, 1)) / vf.sum((0, 1)).clamp_min(1)
