"""Small decoder layers for drafters, written for *block* attention.

Why not HF's decoder layer: drafters attend to a shared context (their own KV cache of committed
positions) from many blocks at once, each block causal inside and seeing only part of the
context. One primitive covers training (every position of a sequence starts a block) and
inference (one block after the root, or one per seed), without materialising the context once
per block:

    q      [G, H, R, K, d]   G groups, R blocks per group, K queries per block (causal inside)
    ctx    [G, H, C, d]      keys/values every block of the group may see
    mask   [G|1, R, C] bool  which context positions each block sees (None: all)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from specblock.runtime import exact_parts
from specblock.runtime.drafters.kvcache import KVSlot


class RMSNorm(nn.Module):
    #: Serve through the one-op C++ norm of ``exact_parts`` (set by ``drafters.norm_op`` beside a packed
    #: target whose own norms take it): 7 ops a call become one, 5-10 calls a propose.
    #: Training (grad on) and compiled forwards (inductor fuses the formula) keep the formula.
    op: bool = False

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.op and x.dtype == torch.float32 and not torch.is_grad_enabled() and not torch.compiler.is_compiling():
            return exact_parts.rms_norm(x, self.weight, self.eps)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


_INV_FREQ: dict[tuple, torch.Tensor] = {}


def rope_cos_sin(pos: torch.Tensor, d: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions ``pos`` (Llama's half-split layout), ``[*pos.shape, d]``.

    Computed once per forward and shared by q and k of every layer: at serving sizes a drafter's
    time follows the number of ops it dispatches (experiments/drafter_cost.py), and recomputing
    the angles per call was a fifth of a SpecBlock block forward's ops."""
    key = (d, float(theta), pos.device)
    inv = _INV_FREQ.get(key)
    if inv is None:
        inv = _INV_FREQ[key] = 1.0 / theta ** (torch.arange(0, d, 2, device=pos.device, dtype=torch.float32) / d)
    ang = pos.float()[..., None] * inv
    ang = torch.cat([ang, ang], -1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (Llama's half-split layout); ``pos`` broadcasts against ``x[..., 0]``."""
    return apply_rope(x, *rope_cos_sin(pos, x.shape[-1], theta, x.dtype))


def block_attention(
    q: torch.Tensor,
    k_own: torch.Tensor,
    v_own: torch.Tensor,
    k_ctx: torch.Tensor | None,
    v_ctx: torch.Tensor | None,
    ctx_mask: torch.Tensor | None,
) -> torch.Tensor:
    """Softmax attention of each block over (visible context) + (its own causal prefix)."""
    kq = q.shape[-2]
    if ctx_mask is None:
        # Serving: every block sees the whole context, so context + own prefix is one key set with
        # a lower-triangular mask offset by C, and one fused SDPA call replaces ~30 ops of einsums
        # and masking per layer (same math; softmax accumulates in float32 either way).
        if k_ctx is not None and k_ctx.shape[-2]:
            c = k_ctx.shape[-2]
            shape = (*k_ctx.shape[:2], q.shape[2], c, k_ctx.shape[-1])
            k_own = torch.cat([k_ctx[:, :, None].expand(shape), k_own], dim=-2)
            v_own = torch.cat([v_ctx[:, :, None].expand(shape), v_own], dim=-2)
        c = k_own.shape[-2] - kq
        mask = torch.ones(kq, c + kq, dtype=torch.bool, device=q.device).tril(c)
        g, h, r, _, d = q.shape  # 4-D, or SDPA leaves its fused CPU kernel for ~25 ops of math
        out = F.scaled_dot_product_attention(q.reshape(g, h * r, kq, d), k_own.reshape(g, h * r, c + kq, d),
                                             v_own.reshape(g, h * r, c + kq, d), attn_mask=mask)
        return out.view(g, h, r, kq, d)
    scale = 1.0 / math.sqrt(q.shape[-1])
    own = torch.einsum("ghrkd,ghrjd->ghrkj", q, k_own).float() * scale
    causal = torch.ones(kq, kq, dtype=torch.bool, device=q.device).tril()
    own = own.masked_fill(~causal, float("-inf"))
    if k_ctx is None or k_ctx.shape[-2] == 0:
        return torch.einsum("ghrkj,ghrjd->ghrkd", own.softmax(-1).to(v_own.dtype), v_own)
    ctx = torch.einsum("ghrkd,ghcd->ghrkc", q, k_ctx).float() * scale
    if ctx_mask is not None:
        ctx = ctx.masked_fill(~ctx_mask[:, None, :, None, :], float("-inf"))
    probs = torch.cat([ctx, own], dim=-1).softmax(-1).to(q.dtype)
    c = k_ctx.shape[-2]
    return torch.einsum("ghrkc,ghcd->ghrkd", probs[..., :c], v_ctx) + torch.einsum(
        "ghrkj,ghrjd->ghrkd", probs[..., c:], v_own
    )


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP (Llama's layer), over block-shaped inputs."""

    def __init__(self, hidden: int, heads: int, intermediate: int, rope_theta: float, eps: float = 1e-6) -> None:
        super().__init__()
        self.heads, self.head_dim, self.rope_theta = heads, hidden // heads, rope_theta
        self.attn_norm, self.mlp_norm = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # [G, R, K, h]
        pos: torch.Tensor,  # [G, R, K]
        ctx: tuple[torch.Tensor, torch.Tensor] | KVSlot | None = None,  # [G|1, H, C, d] each, or a cache's layer
        ctx_mask: torch.Tensor | None = None,
        rope_cs: tuple[torch.Tensor, torch.Tensor] | None = None,  # from rope_cos_sin(pos[:, None]): shared by layers
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        g, r, k, h = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(g, r, k, 3, self.heads, self.head_dim)
        qkv = qkv.permute(3, 0, 4, 1, 2, 5)  # [3, G, H, R, K, d]
        if rope_cs is None:
            rope_cs = rope_cos_sin(pos[:, None], self.head_dim, self.rope_theta, x.dtype)  # heads broadcast
        qk = apply_rope(qkv[:2], *rope_cs)  # q and k in one pass
        q, kk, v = qk[0], qk[1], qkv[2]
        if isinstance(ctx, KVSlot):  # one causal row over a cache: its keys staged there, no copy of the context
            if g != 1 or r != 1 or ctx_mask is not None:
                raise ValueError("a KVSlot serves one row over the whole cache; pass its views for more")
            att = ctx.attend(q[:, :, 0], kk[:, :, 0], v[:, :, 0])[:, :, None]
        else:
            k_ctx = v_ctx = None
            if ctx is not None:
                k_ctx, v_ctx = (t.expand(g, -1, -1, -1) for t in ctx)
            att = block_attention(q, kk, v, k_ctx, v_ctx, ctx_mask)  # [G, H, R, K, d]
        x = x + self.o(att.permute(0, 2, 3, 1, 4).reshape(g, r, k, h))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        x = x + self.down(F.silu(gate) * up)
        return x, (kk, v)


def flat_kv(kv: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """[G, H, R, K, d] -> [G, H, R*K, d]: a stream's own keys as context for another stream."""
    k, v = kv
    g, hh, r, kk, d = k.shape
    return k.reshape(g, hh, r * kk, d), v.reshape(g, hh, r * kk, d)


class FusedInputHeads:
    """The EAGLE-style front end and output head shared by the feature drafters (EAGLE-3,
    ParallelSpec, Falcon): a layer input from a feature (fused target taps, or the drafter's own
    state) plus the next token's embedding, and logits through the final norm. A mixin over an
    ``nn.Module`` that owns ``fuse_taps``, ``feat_norm``, ``emb_norm``, ``fc``, ``embed``,
    ``norm`` and ``lm_head``, so saved parameter names do not change."""

    def build_front(self, cfg) -> None:
        """The front end's modules from a drafter config (``hidden_size``, ``vocab_size``,
        ``tap_layers``, ``rms_eps``); the subclass adds its layers, then :meth:`build_head`. The
        order is the parameters' order, which saved optimiser states rely on."""
        h = cfg.hidden_size
        self.embed = nn.Embedding(cfg.vocab_size, h)
        self.fuse_taps = nn.Linear(len(cfg.tap_layers) * h, h, bias=False)
        self.feat_norm, self.emb_norm = RMSNorm(h, cfg.rms_eps), RMSNorm(h, cfg.rms_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)

    def build_head(self, cfg) -> None:
        """The final norm and the LM head (``draft_head``: ``DraftVocab``'s, reduced when the config
        sets a draft vocabulary)."""
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = self.draft_head(cfg.hidden_size)

    def g(self, feature: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.feat_norm(feature), self.emb_norm(self.embed(tokens))], dim=-1))

    def g_from_taps(self, taps: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.g(self.fuse_taps(taps), tokens)

    def normed(self, s: torch.Tensor) -> torch.Tensor:
        return self.norm(s)

    def logits(self, s: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(s)).float()

