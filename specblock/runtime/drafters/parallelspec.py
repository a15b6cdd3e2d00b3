"""ParallelSpec-style drafter (Xiao et al. 2024): k tokens from ONE drafter forward via [MASK] queries.

Network. The EAGLE-3 front end (``eagle3.py``): the target's low/mid/top hidden states at a
committed position p are fused (``Linear(3h -> h)``) and mixed with the embedding of the token that
follows, ``g_p = fc([norm(feature_p) ; norm(e(x_{p+1}))])``; a small decoder stack runs causally
over the g's and keeps its own KV cache of committed positions. The state at the last committed
position R-1 (whose g carries the root token x_R) predicts depth 1. Behind it, k-1 [MASK] queries
(one learned vector in the layer's input space; the position comes from RoPE: mask i sits at
R-1+i) predict depths 2..k, all in the same forward as the not-yet-cached context positions.

Group attention (our choice, the paper leaves it open): the mask queries see the whole committed
context and each other *causally* (mask i sees masks < i), so a deeper mask can use what shallower
ones computed; nobody sees a mask from the context side. Training (``training/parallelspec_step``)
runs exactly this pattern for every position of a window at once, with soft CE to the target's
distributions at t+1..t+k (distillation).

Tree. Depth d's distribution is not conditioned on the token chosen at depth d-1, so the top-1
tokens form a *spine* and the other kept candidates at each depth are leaves hanging on the spine
node one depth up (``policies.branching.grow_block``, widths from ``TopKBranching(top_k)``; top_k
1 is a chain). One drafter forward per iteration, whatever the depth.

Also here, shared with ``falcon.py``: :class:`FeatureNet` (the EAGLE-style front end and a stack of
``DecoderLayer`` weights), :class:`ContextDrafter` (a drafter over its committed context) and :func:`layer_step`, which runs a ``DecoderLayer`` under an explicit
within-group mask and per-query context masks (``layers.block_attention`` is causal-only inside a
block and masks context per block; Falcon's relaxed within-block mask needs more).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Self

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from specblock.policies.branching import TopKBranching, TreePolicy, grow_block
from specblock.policies.tree import DraftTree
from specblock.runtime.drafters.base import DraftRequest, Drafter
from specblock.runtime.drafters.draftvocab import DraftVocab, DraftVocabSize
from specblock.runtime.drafters.kvcache import KVCache
from specblock.runtime.drafters.layers import DecoderLayer, FusedInputHeads, rope
from specblock.runtime.drafters.netio import load_net, save_net, tie_frozen
from specblock.runtime.target import TargetModel, TargetOutput
from specblock.runtime.verify import Verdict

FROZEN = ("embed.weight", "lm_head.weight")
KV = tuple[torch.Tensor, torch.Tensor]


# --------------------------------------------------------------------------- shared layer helpers
def group_attention(q, k_own, v_own, own_mask, k_ctx=None, v_ctx=None, ctx_mask=None) -> torch.Tensor:
    """q ``[G, H, R, Kq, d]`` over its group's own keys ``[G, H, R, Ko, d]`` (``own_mask [Kq, Ko]``)
    plus shared context ``[G, H, C, d]`` (``ctx_mask [G|1, R, C]`` per group or ``[G|1, R, Kq, C]``
    per query; None: all visible). Every query must see at least one own key (itself)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    own = torch.einsum("ghrkd,ghrjd->ghrkj", q, k_own).float() * scale
    own = own.masked_fill(~own_mask, float("-inf"))
    if k_ctx is None or k_ctx.shape[-2] == 0:
        return torch.einsum("ghrkj,ghrjd->ghrkd", own.softmax(-1).to(v_own.dtype), v_own)
    ctx = torch.einsum("ghrkd,ghcd->ghrkc", q, k_ctx).float() * scale
    if ctx_mask is not None:
        m = ctx_mask if ctx_mask.dim() == 4 else ctx_mask[:, :, None]
        ctx = ctx.masked_fill(~m[:, None], float("-inf"))
    probs = torch.cat([ctx, own], dim=-1).softmax(-1).to(q.dtype)
    c = k_ctx.shape[-2]
    return torch.einsum("ghrkc,ghcd->ghrkd", probs[..., :c], v_ctx) + torch.einsum(
        "ghrkj,ghrjd->ghrkd", probs[..., c:], v_own)


def layer_step(layer: DecoderLayer, x, pos, ctx: KV | None, ctx_mask, own_mask, own_prefix: KV | None = None):
    """``DecoderLayer``'s computation (same weights) with :func:`group_attention`.

    x ``[G, R, K, h]``, pos ``[G, R, K]``; ``own_prefix``: keys/values ``[G, H, R, P, d]`` of earlier
    queries of the same group (Falcon's previous blocks), placed before this call's own keys.
    Returns the new states and this call's keys/values ``[G, H, R, K, d]``.
    """
    g, r, k, h = x.shape
    qkv = layer.qkv(layer.attn_norm(x)).view(g, r, k, 3, layer.heads, layer.head_dim)
    q, kk, v = (qkv[..., i, :, :].permute(0, 3, 1, 2, 4) for i in range(3))
    p = pos[:, None]
    q, kk = rope(q, p, layer.rope_theta), rope(kk, p, layer.rope_theta)
    ko, vo = (kk, v) if own_prefix is None else (torch.cat([own_prefix[0], kk], -2), torch.cat([own_prefix[1], v], -2))
    k_ctx = v_ctx = None
    if ctx is not None:
        k_ctx, v_ctx = (t.expand(g, -1, -1, -1) for t in ctx)
    att = group_attention(q, ko, vo, own_mask, k_ctx, v_ctx, ctx_mask)
    x = x + layer.o(att.permute(0, 2, 3, 1, 4).reshape(g, r, k, h))
    gate, up = layer.gate_up(layer.mlp_norm(x)).chunk(2, dim=-1)
    return x + layer.down(F.silu(gate) * up), (kk, v)


def flat(kv: KV) -> KV:
    """``[G, H, R, K, d]`` -> ``[G, H, R*K, d]``."""
    k, v = kv
    return k.flatten(2, 3), v.flatten(2, 3)


def cat_kv(a: list[KV] | None, b: list[KV]) -> list[KV]:
    """Append per-layer keys/values ``b`` to ``a`` along the sequence axis."""
    if a is None:
        return list(b)
    return [(torch.cat([ka, kb], -2), torch.cat([va, vb], -2)) for (ka, va), (kb, vb) in zip(a, b)]


class FeatureConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_heads: int = Field(4, ge=1)
    num_layers: int = Field(1, ge=1)
    intermediate_size: int = Field(1024, gt=0)
    tap_layers: tuple[int, ...] = (1, 3, 5)
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    top_k: int = Field(3, ge=1)  # serving: candidates kept per drafted position
    draft_vocab: DraftVocabSize = None  # LM-head rows (a token outside them is never drafted); None = all


class FeatureNet(FusedInputHeads, DraftVocab, nn.Module):
    """EAGLE-style front end (fused taps + next-token embedding) and a stack of decoder layers;
    the LM head and the embedding are the target's, frozen and never saved (the head reduced to a
    draft vocabulary when ``draft_vocab`` is set, as EAGLE-3's)."""

    def __init__(self, cfg: FeatureConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.build_front(cfg)
        self.layers = nn.ModuleList(DecoderLayer(cfg.hidden_size, cfg.num_heads, cfg.intermediate_size, cfg.rope_theta,
                                                 cfg.rms_eps) for _ in range(cfg.num_layers))
        self.build_head(cfg)

    def run(self, x, pos, ctx: list[KV] | None, ctx_mask, own_mask, own_prefix: list[KV] | None = None):
        """All layers; returns the top states and per-layer keys/values of this call's queries."""
        kvs = []
        for i, layer in enumerate(self.layers):
            x, kv = layer_step(layer, x, pos, None if ctx is None else ctx[i], ctx_mask, own_mask,
                               None if own_prefix is None else own_prefix[i])
            kvs.append(kv)
        return x, kvs

    def tie_to_target(self, target_model) -> None:
        tie_frozen(self, target_model, FROZEN)


class CommittedContext:
    """The drafter's view of committed positions: g's not yet cached, and the per-layer cache.

    ``add`` mirrors EAGLE-3's bookkeeping: the target's taps at the accepted nodes, fused with the
    token that followed each, become the next context positions (never dropped, whatever the
    caller skipped)."""

    def __init__(self, net: FeatureNet, device, dtype) -> None:
        self.net, self.device, self.dtype = net, device, dtype
        self.cache: KVCache | None = None  # positions 0..C-1
        self.pending: torch.Tensor | None = None  # [n, h]
        self.pending_pos: torch.Tensor | None = None

    def add(self, taps: torch.Tensor, next_tokens: np.ndarray, first_pos: int) -> None:
        nt = torch.as_tensor(next_tokens, device=self.device)
        with torch.no_grad():
            g = self.net.g_from_taps(taps.to(self.dtype), nt)
        pos = first_pos + torch.arange(len(next_tokens), device=self.device)
        if self.pending is not None:
            g, pos = torch.cat([self.pending, g]), torch.cat([self.pending_pos, pos])
        self.pending, self.pending_pos = g, pos

    def commit(self, kvs: list[KV], n: int) -> None:
        """Cache the first ``n`` queries of a call (the pending positions) and clear them."""
        new = [(k[:, :, 0, :n], v[:, :, 0, :n]) for k, v in kvs]
        self.cache = KVCache.of(new) if self.cache is None else self.cache.append(new)  # in place, no copy of the context
        self.pending = self.pending_pos = None

    @property
    def cached(self) -> int:
        return 0 if self.cache is None else self.cache.n


class ContextDrafter(Drafter):
    """What ParallelSpec's and Falcon's drafters share: a :class:`FeatureNet` (``NET``, what
    ``load`` reads) over a :class:`CommittedContext` that the target's taps at every committed
    position feed; the subclass drafts (``propose``)."""

    needs_features = True
    NET: type[FeatureNet] = FeatureNet

    def _bind(self, net: FeatureNet) -> None:
        self.net = net.eval()
        self.tap_layers = tuple(net.cfg.tap_layers)  # the engine points the target's taps here per generate
        p = next(net.parameters())
        self.device, self.dtype = p.device, p.dtype

    @classmethod
    def load(cls, path: str | Path, target: TargetModel, **kw) -> Self:
        net = cls.NET.load(path, target.model)
        target.tap_layers = tuple(net.cfg.tap_layers)  # the drafter decides which layers it reads
        return cls(net.to(device=target.device, dtype=target.drafter_dtype), **kw)

    def reset(self) -> None:
        self.ctx = CommittedContext(self.net, self.device, self.dtype)

    def prefill(self, prompt: np.ndarray, features: TargetOutput | None) -> None:
        self.reset()
        if features is not None and features.taps is not None and len(prompt) > 1:
            self.ctx.add(features.taps, prompt[1:], 0)

    def accept(self, tree: DraftTree, verdict: Verdict, features: TargetOutput | None) -> None:
        self.ctx.add(features.taps, np.append(tree.tokens[verdict.path[1:]], verdict.bonus), self._root_pos)

    @property
    def width(self) -> int:
        """Candidates fetched per depth: a TopKBranching never keeps more than its k."""
        return int(getattr(self.policy, "k", None) or self.net.cfg.top_k)


# --------------------------------------------------------------------------- ParallelSpec
class ParallelSpecConfig(FeatureConfig):
    k: int = Field(5, ge=2)  # tokens drafted per forward: depth 1 + (k-1) mask queries


class ParallelSpecNet(FeatureNet):
    def __init__(self, cfg: ParallelSpecConfig) -> None:
        super().__init__(cfg)
        self.mask_embed = nn.Parameter(torch.randn(cfg.hidden_size) * 0.02)

    def masks(self, *lead: int) -> torch.Tensor:
        return self.mask_embed.expand(*lead, -1)

    def save(self, path: str | Path) -> None:
        save_net(self, self.cfg, "parallelspec", path, FROZEN)

    @classmethod
    def load(cls, path: str | Path, target_model) -> "ParallelSpecNet":
        return load_net(cls, ParallelSpecConfig, path, "parallelspec", "ParallelSpec", target_model, FROZEN)


class ParallelSpecDrafter(ContextDrafter):
    name = "parallelspec"
    NET = ParallelSpecNet

    def __init__(self, net: ParallelSpecNet, top_k: int | None = None, policy: TreePolicy | None = None) -> None:
        self._bind(net)
        self.policy = policy or TopKBranching(k=top_k or net.cfg.top_k)
        self.reset()

    @torch.no_grad()
    def propose(self, req: DraftRequest) -> DraftTree:
        root = int(req.tokens[-1])
        self._root_pos = len(req.tokens) - 1
        tree = DraftTree.root_only(root)
        ctx = self.ctx
        if ctx.pending is None:  # a one-token prompt: no target features yet
            return tree
        n, net = ctx.pending.shape[0], self.net
        depth = max(min(net.cfg.k, req.max_depth), 1)
        m = depth - 1  # mask queries
        x = torch.cat([ctx.pending, net.masks(m)])[None, None]  # [1, 1, n+m, h]
        pos = torch.cat([ctx.pending_pos, self._root_pos - 1 + torch.arange(1, m + 1, device=self.device)])
        causal = torch.ones(n + m, n + m, dtype=torch.bool, device=self.device).tril()
        out, kvs = net.run(x, pos[None, None], ctx.cache, None, causal)
        ctx.commit(kvs, n)
        if req.max_depth < 1 or req.budget < 1:
            return tree
        ids, lps = net.top_tokens(net.logits(out[0, 0, n - 1:]), self.width)
        ids, lps = ids[None], lps[None]  # [1, depth, k]
        grow_block(tree, np.zeros(1, dtype=np.int64), ids, lps, None, self.policy, req.budget, block=0)
        return tree
