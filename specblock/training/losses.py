"""SpecBlock's training losses: soft draft cross-entropy under the valid-prefix mask, rank buckets.

    m_{t,1} = 1,   m_{t,k+1} = m_{t,k} * 1[argmax p_{t,k} = y*_{t,k}]
    L = sum_k L_k^draft + L^rank,  L_k^draft = -(1/N_k) sum_t m_{t,k} sum_v p*_{t,k}(v) log p_{t,k}(v)

Positions that sit on a wrong in-block prefix are never verified at inference, so they are not
supervised. ``valid`` marks positions that exist at all (the window's end cuts late blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specblock.runtime.drafters.specblock_net import bucket_of, rank_of


def valid_prefix_mask(correct: torch.Tensor, valid: torch.Tensor, enabled: bool = True) -> torch.Tensor:
    """[..., K] float mask. ``correct[..., k]``: the drafter's argmax at position k is the target's."""
    if not enabled:
        return valid.float()
    prev_ok = torch.cat([torch.ones_like(correct[..., :1]), correct[..., :-1]], dim=-1)
    return (valid & prev_ok).float().cumprod(dim=-1)


@dataclass
class BlockLoss:
    draft: torch.Tensor  # sum over k of the masked mean soft CE
    rank: torch.Tensor  # masked mean CE of the rank head
    mask: torch.Tensor  # [..., K] the valid-prefix mask used
    top1: torch.Tensor  # [..., K] drafter argmax == target argmax
    rank_correct: torch.Tensor  # [..., K] rank head's bucket == true bucket
    true_bucket: torch.Tensor  # [..., K] bucket of the target token's rank in the draft distribution
    pred_bucket: torch.Tensor  # [..., K] the rank head's predicted bucket


def block_loss(
    logits: torch.Tensor,  # [..., K, V]
    rank_logits: torch.Tensor,  # [..., K, 4]
    normed: torch.Tensor,  # [..., K, h] the hidden state the LM head reads
    lse: torch.Tensor,  # [..., K] logsumexp of the draft logits
    e_target: torch.Tensor,  # [..., K, h] E_{v ~ p*}[W_v]: the LM head's rows under the target distribution
    y_star: torch.Tensor,  # [..., K] the target's argmax token
    valid: torch.Tensor,  # [..., K] bool
    start: torch.Tensor | None = None,  # [...] float: block reachable at all (cross-block seeds)
    use_valid_prefix: bool = True,
    per_k_norm: bool = True,
) -> BlockLoss:
    """Soft CE without V-sized targets: with a bias-free LM head W and sum(p*) = 1,
    ``-sum_v p*(v) log p(v) = lse - <h, sum_v p*(v) W_v>`` exactly.

    ``per_k_norm``: the paper's 1/N_k, a mean per in-block index. Early in training N_k for
    k >= 2 is a handful of positions (the valid prefix rarely survives), so those few carry as
    much weight as all of k = 1. ``False`` divides every k by N_1 instead (each valid position
    weighs the same): our option, measured in the issue-4 note."""
    rank = rank_of(logits.detach(), y_star)
    top1 = rank == 0
    mask = valid_prefix_mask(top1, valid, use_valid_prefix)
    if start is not None:
        mask = mask * start[..., None]
    ce = lse - (normed.float() * e_target).sum(-1)  # [..., K]
    n_k = mask.flatten(0, -2).sum(0).clamp_min(1.0)  # valid positions per in-block index k
    if not per_k_norm:
        n_k = n_k[:1].expand_as(n_k)
    draft = ((ce * mask).flatten(0, -2).sum(0) / n_k).sum()
    buckets = bucket_of(rank)
    rce = F.cross_entropy(rank_logits.float().flatten(0, -2), buckets.flatten(), reduction="none").view_as(mask)
    rank_loss = (rce * mask).sum() / mask.sum().clamp_min(1.0)
    pred = rank_logits.argmax(-1)
    return BlockLoss(draft, rank_loss, mask, top1, pred == buckets, buckets, pred)
