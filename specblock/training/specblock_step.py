"""One SpecBlock training step on a window of tokens: target pass, two blocks, losses.

Every position p of a window starts a block (teacher forcing over the context, K queries per
block attending to context <= p). The second block starts at a split point j drawn uniformly
from 1..K inside each first block, from the drafter's own hidden state there and the target's
token at that depth (cross-block training, so training sees what inference feeds block 2).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from specblock.runtime.drafters.specblock_net import SpecBlockNet
from specblock.training.losses import BlockLoss, block_loss


class Batched:
    """Moving and chunking a dataclass of per-window tensors (any field may be None)."""

    def _parts(self) -> tuple:
        return tuple(getattr(self, f.name) for f in fields(self))

    def to(self, device):
        return type(self)(*(None if t is None else t.to(device) for t in self._parts()))

    def split(self, n: int) -> list:
        """Chunks of ``n`` windows (held-out evaluation runs in small batches)."""
        parts = self._parts()
        chunks = len(parts[0].split(n))
        cut = lambda t: [None] * chunks if t is None else list(t.split(n))
        return [type(self)(*row) for row in zip(*(cut(t) for t in parts))]


@dataclass
class TargetPass(Batched):
    tokens: torch.Tensor  # [B, W]
    taps: torch.Tensor  # [B, W, n_taps*h]
    e_target: torch.Tensor  # [B, W, h] float: E_{v ~ p*}[W_v], p* the target's next-token distribution
    y_star: torch.Tensor  # [B, W] the target's argmax next token (a head row under a draft vocabulary)
    y_ok: torch.Tensor | None = None  # [B, W] bool: that token is in the draft vocabulary (None: all are)


def to_draft_vocab(e_probs: torch.Tensor, ids: torch.Tensor, head_rows: torch.Tensor, t2d: torch.Tensor):
    """Soft targets restricted to the draft vocabulary: the target's (top-k or full) probabilities
    ``e_probs`` over token ``ids`` [..., k] kept where the token has a head row, renormalised, and
    their expectation over those rows; the argmax (``ids[..., 0]``) as a head row, and whether it has
    one. A position whose argmax has no row can never be drafted right: its valid mask is off."""
    rows = t2d[ids]
    keep = rows >= 0
    p = e_probs * keep
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-20)
    e_target = torch.einsum("...k,...kh->...h", p, head_rows.float()[rows.clamp_min(0)])
    return e_target, rows[..., 0].clamp_min(0), keep[..., 0]


def soft_targets(logits: torch.Tensor, model, net=None):
    """The target's next-token distribution reduced at once to its expectation over the (shared,
    frozen) LM-head rows, its argmax, and whether that has a head row; under a draft vocabulary
    (``net.cfg.draft_vocab``) over the N rows the drafter has, argmax as a head row (else None)."""
    p_star = torch.softmax(logits.float(), dim=-1)
    if net is not None and getattr(net.cfg, "draft_vocab", None) is not None:
        p = p_star[..., net.d2t]
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-20)
        rows = net.t2d()[logits.argmax(-1)]
        return p @ net.lm_head.weight.float(), rows.clamp_min(0), rows >= 0
    return p_star @ model.get_output_embeddings().weight.float(), logits.argmax(-1), None


@torch.no_grad()
def target_pass(model, tokens: torch.Tensor, tap_layers: tuple[int, ...], net=None) -> TargetPass:
    """Features and soft targets in the target's own dtype (the one it serves in), so the
    drafter trains on the features it will see at inference (soft targets: :func:`soft_targets`)."""
    out = model(input_ids=tokens, output_hidden_states=True)
    taps = torch.cat([out.hidden_states[i] for i in tap_layers], dim=-1).float()
    return TargetPass(tokens, taps, *soft_targets(out.logits, model, net))


def _gather_positions(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, W, ...] at idx [R, K] (clamped) -> [B, R, K, ...]."""
    w = x.shape[1]
    return x[:, idx.clamp(max=w - 1)]


@dataclass
class StepResult:
    loss: torch.Tensor
    blocks: list[BlockLoss]


def first_block(net: SpecBlockNet, taps: torch.Tensor, tokens: torch.Tensor):
    """Block 1 at every position p = 0..W-2 of the window: the top hidden states ``[B, R, K, h]``
    and the context stream's per-layer keys/values (the cache later blocks attend to)."""
    b, w = tokens.shape
    r, dev = w - 1, tokens.device
    p = torch.arange(r, device=dev)
    g = net.g_from_target(taps[:, :r], tokens[:, 1:])  # [B, R, h] at positions p
    pos_q = (p[:, None] + torch.arange(1, net.cfg.K + 1, device=dev))[None].expand(b, r, -1)
    causal = torch.ones(r, r, dtype=torch.bool, device=dev).tril()[None]
    return net.run(g[:, None], p[None, None].expand(b, 1, r), net.queries(g), pos_q, None, None, causal)


def seed_block(net: SpecBlockNet, ctx_kv, h_seed: torch.Tensor, seed_tok: torch.Tensor, seed_pos: torch.Tensor):
    """Block 2 from one seed per first block (row r may see context <= r and its own seed)."""
    r, dev = h_seed.shape[1], h_seed.device
    g2 = net.g_from_drafter(h_seed, seed_tok)  # [B, R, h] at seed_pos
    pos_q = seed_pos[:, :, None] + torch.arange(1, net.cfg.K + 1, device=dev)
    causal = torch.ones(r, r, dtype=torch.bool, device=dev).tril()[None]
    q_mask = torch.cat([causal[0], torch.eye(r, dtype=torch.bool, device=dev)], -1)[None]
    hq, _ = net.run(g2[:, :, None], seed_pos[:, :, None], net.queries(g2), pos_q, ctx_kv, causal, q_mask)
    return hq


def specblock_step(
    net: SpecBlockNet,
    tp: TargetPass,
    gen: torch.Generator,
    rank_weight: float,
    use_valid_prefix: bool = True,
    cross_block: bool = True,
    per_k_norm: bool = True,
) -> StepResult:
    b, w = tp.tokens.shape
    kk, dev = net.cfg.K, tp.tokens.device
    r = w - 1
    p = torch.arange(r, device=dev)
    ks = torch.arange(1, kk + 1, device=dev)
    hq, ctx_kv = first_block(net, tp.taps, tp.tokens)
    idx1 = p[:, None] + ks  # the target distribution for depth k sits at position p+k
    valid1 = (idx1 <= w - 1)[None].expand(b, r, kk)
    if tp.y_ok is not None:  # a target token outside the draft vocabulary ends the chain there
        valid1 = valid1 & _gather_positions(tp.y_ok, idx1)
    first = block_loss(*net.heads(hq, with_lse=True), _gather_positions(tp.e_target, idx1),
                       _gather_positions(tp.y_star, idx1), valid1, None, use_valid_prefix, per_k_norm)
    blocks = [first]

    if cross_block and kk > 1:
        j = torch.randint(1, kk + 1, (b, r), generator=gen, device=dev)  # split depth per block
        h_seed = hq.gather(2, (j - 1)[..., None, None].expand(b, r, 1, hq.shape[-1]))[:, :, 0]
        seed_pos = p[None] + j
        seed_tok = tp.y_star.gather(1, seed_pos.clamp(max=w - 1))  # the target's token at depth j
        if tp.y_ok is not None:
            seed_tok = net.d2t[seed_tok]  # a head row back to the token (unreachable where it has none)
        hq2 = seed_block(net, ctx_kv, h_seed, seed_tok, seed_pos)
        idx2 = (seed_pos[:, :, None] + ks).clamp(max=w - 1)  # [B, R, K]
        rows = torch.arange(b, device=dev)[:, None, None]
        # Block 2 is reachable only if block 1 was right up to the seed's parent (m_{t,j}).
        start = first.mask.gather(-1, (j - 1)[..., None])[..., 0]
        valid2 = seed_pos[:, :, None] + ks <= w - 1
        if tp.y_ok is not None:
            valid2 = valid2 & tp.y_ok[rows, idx2]
        blocks.append(block_loss(*net.heads(hq2, with_lse=True), tp.e_target[rows, idx2], tp.y_star[rows, idx2],
                                 valid2, start, use_valid_prefix, per_k_norm))

    loss = sum(bl.draft + rank_weight * bl.rank for bl in blocks)
    return StepResult(loss, blocks)
