"""The SpecBlock drafter network: K positions per forward, layer-wise shift, rank head.

Inputs (paper, SPECBLOCK.md): the target's low/mid/top hidden states at the last verified
position, fused by one linear layer (EAGLE-3) and fused again with the embedding of the token
that follows it: ``g_p = W_in [W_taps taps_p ; e(x_{p+1})]``. The drafter keeps a causal KV cache
over the g's of committed positions (the *context stream*). A block is K position queries
``q_k = g + P_k`` (the prefix summary g broadcast to every position, plus a learned in-block
position vector) that attend to the context and, causally, to each other. Between consecutive
layers position k is re-projected with the state of position k-1 from the layer below,
``h~_k = W_l [h_k ; h_{k-1}]`` (h_0 = 0; W_l starts as [I, 0], so an untrained shift is the
identity). For a block that starts from a drafted seed there are no target features: the seed's
g uses the drafter's own top hidden state instead, as one private context position.

Choices the digest leaves open, made here: the embedding and LM head are the target's (frozen,
not saved: they are copied from the target at load time); RoPE positions continue the
sequence's; the 15 rank-head statistics are the top-10 log-probs, the gaps top1-top2, top2-top3
and top1-top10, the max probability and the entropy.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from specblock.errors import SpecBlockError
from specblock.policies.tree import BUCKET_UPPER
from specblock.runtime.drafters.draftvocab import DraftVocab, DraftVocabSize
from specblock.runtime.drafters.kvcache import KVCache
from specblock.runtime.drafters.layers import DecoderLayer, RMSNorm, flat_kv, rope_cos_sin
from specblock.runtime.drafters.netio import load_weights, read_config, save_net

N_STATS = 15


FROZEN_FROM_TARGET = ("embed.weight", "lm_head.weight")


def rank_of(logits: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    """0-based rank of each target token in the draft distribution (ties count in its favour): the
    rank head's label, here beside the head so that training and serving-time adaptation share it
    without the runtime importing ``training``."""
    tgt = logits.gather(-1, target_ids[..., None])
    return (logits > tgt).sum(-1)


def bucket_of(rank: torch.Tensor) -> torch.Tensor:
    """Ranks (0-based) to buckets b0..b3: the same thresholds as policies.tree.rank_to_bucket."""
    edges = torch.tensor(BUCKET_UPPER, device=rank.device)
    return torch.bucketize(rank + 1, edges, right=False)


class SpecBlockConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(6, ge=1)
    intermediate_size: int = Field(1024, gt=0)
    K: int = Field(4, ge=1)  # positions per block
    tap_layers: tuple[int, ...] = (1, 3, 5)
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    shift: bool = True  # layer-wise hidden-state shift (ablation: False)
    prefix_broadcast: bool = True  # add g to every query (ablation: False, queries see g only via attention)
    rank_hidden: int = 128
    top_k: int = 10  # candidates per position handed to the tree policy
    # LM-head rows: the N most frequent target tokens (EAGLE-3's reduced draft vocabulary; the
    # ``d2t`` map is saved with the weights), None = the target's whole vocabulary. A token outside
    # it is never drafted; the head's cost shrinks by V / N, and it runs K x M times per step.
    draft_vocab: DraftVocabSize = None


def rank_stats(logits: torch.Tensor, lse: torch.Tensor | None = None) -> torch.Tensor:
    """The 15 distribution statistics the rank head reads (float32, no gradient).

    Vocabulary-wide passes are the cost here (training runs K x M positions per token), so the
    float logits and the log-normaliser are shared with the loss when the caller has them.
    """
    lf = logits.detach().float()
    lse = torch.logsumexp(lf, dim=-1) if lse is None else lse.detach()
    entropy = lse - (torch.exp(lf - lse[..., None]) * lf).sum(-1)
    return _stats(lf.topk(10, dim=-1).values - lse[..., None], entropy)


def _stats(top: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
    """From the top-10 (or more) log-probs and the entropy: top-10, 3 gaps, p1, entropy."""
    gaps = torch.stack([top[..., 0] - top[..., 1], top[..., 1] - top[..., 2], top[..., 0] - top[..., 9]], -1)
    top10 = top if top.shape[-1] == 10 else top[..., :10]  # a slice is an op too
    return torch.cat([top10, gaps, top[..., :1].exp(), entropy[..., None]], dim=-1)


class SpecBlockNet(DraftVocab, nn.Module):
    def __init__(self, cfg: SpecBlockConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.embed = nn.Embedding(cfg.vocab_size, h)
        self.fuse_taps = nn.Linear(len(cfg.tap_layers) * h, h, bias=False)
        self.fuse_in = nn.Linear(2 * h, h, bias=False)
        self.pos_query = nn.Parameter(torch.randn(cfg.K, h) * 0.02)
        self.layers = nn.ModuleList(
            DecoderLayer(h, cfg.num_heads, cfg.intermediate_size, cfg.rope_theta, cfg.rms_eps) for _ in range(cfg.num_layers)
        )
        self.shifts = nn.ModuleList(nn.Linear(2 * h, h, bias=False) for _ in range(cfg.num_layers - 1))
        with torch.no_grad():
            for s in self.shifts:
                s.weight.zero_()
                s.weight[:, :h].copy_(torch.eye(h))
        self.norm = RMSNorm(h, cfg.rms_eps)
        self.lm_head = self.draft_head(h)  # and d2t: head row -> target id (draftvocab.py)
        self.rank_head = nn.Sequential(nn.Linear(h + N_STATS, cfg.rank_hidden), nn.SiLU(), nn.Linear(cfg.rank_hidden, 4))

    # ----------------------------------------------------------------- pieces
    def g_from_target(self, taps: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        return self.fuse_in(torch.cat([self.fuse_taps(taps), self.embed(next_tokens)], dim=-1))

    def g_from_drafter(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.fuse_in(torch.cat([hidden, self.embed(tokens)], dim=-1))

    def queries(self, g: torch.Tensor) -> torch.Tensor:
        """[G, R, h] prefix summaries -> [G, R, K, h] block queries (prefix broadcast)."""
        q = self.pos_query.to(g.dtype).expand(*g.shape[:-1], -1, -1)
        return q + g[..., None, :] if self.cfg.prefix_broadcast else q.contiguous()

    def _shift(self, layer: int, hq: torch.Tensor) -> torch.Tensor:
        prev = F.pad(hq[..., :-1, :], (0, 0, 1, 0))  # h_{k-1}, zeros before the first position
        return self.shifts[layer](torch.cat([hq, prev], dim=-1))

    def run(
        self,
        xc: torch.Tensor | None,  # context stream [Gc, Rc, Kc, h] (new positions), or None
        pos_c: torch.Tensor | None,
        xq: torch.Tensor,  # query stream [G, R, K, h]
        pos_q: torch.Tensor,
        cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None,  # per layer [G|1, H, C, d]
        c_mask: torch.Tensor | None = None,  # context stream over the cache [.., Rc, C]
        q_mask: torch.Tensor | None = None,  # queries over cache + context stream [.., R, C + Rc*Kc]
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Both streams through every layer in lockstep. Returns the queries' top hidden state
        (pre-norm) and the context stream's per-layer keys/values (for the caller's cache)."""
        new_kv = []
        for i, layer in enumerate(self.layers):
            ctx = None if cache is None else cache[i]
            if xc is not None:
                xc, kv = layer(xc, pos_c, ctx, c_mask)
                kc, vc = flat_kv(kv)
                new_kv.append((kc, vc))
                if ctx is not None:
                    g = max(ctx[0].shape[0], kc.shape[0])
                    kc = torch.cat([ctx[0].expand(g, -1, -1, -1), kc.expand(g, -1, -1, -1)], dim=-2)
                    vc = torch.cat([ctx[1].expand(g, -1, -1, -1), vc.expand(g, -1, -1, -1)], dim=-2)
                ctx = (kc, vc)
            xq, _ = layer(xq, pos_q, ctx, q_mask)
            if self.cfg.shift and i < len(self.layers) - 1:
                xq = self._shift(i, xq)
        return xq, new_kv

    def run_serving(
        self,
        x: torch.Tensor,  # [G, R, n, h]: per row, new context positions then the K block queries
        pos: torch.Tensor,  # [G, R, n]
        cache: KVCache | list[tuple[torch.Tensor, torch.Tensor]] | None,
        stage: bool = False,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Serving-time forward: one causal stream per row instead of two streams.

        At serving time a row's context positions and its queries form one causal sequence (the
        queries see every new context position, the context positions see only earlier ones), so
        both streams of :meth:`run` fuse into one, halving the layer calls per block. The shift
        acts on the last K positions only, with zeros before the first query, exactly as in
        ``run`` (a test holds the two against each other). Returns the queries' top hidden
        states and every position's per-layer keys/values ``[G, H, R, n, d]``. ``stage`` (one row
        over a :class:`KVCache` with room for it, the caller's ``reserve``): its keys are written to
        the cache's free rows, so the caller keeps its new context positions' with ``cache.commit``
        instead of copying them in; without it the cache is only read.
        """
        k = self.cfg.K
        kvs = []
        first = self.layers[0]
        cs = rope_cos_sin(pos[:, None], first.head_dim, first.rope_theta, x.dtype)  # once for all layers
        for i, layer in enumerate(self.layers):
            ctx = None if cache is None else cache.slot(i) if stage else cache[i]
            x, kv = layer(x, pos, ctx, None, cs)
            kvs.append(kv)
            if self.cfg.shift and i < len(self.layers) - 1:
                x = torch.cat([x[..., :-k, :], self._shift(i, x[..., -k:, :])], dim=-2)
        return x[..., -k:, :], kvs

    def heads(self, hq: torch.Tensor, with_lse: bool = False):
        """Draft logits and rank-bucket logits; the rank head sees no backbone gradient.

        ``with_lse`` (training) also returns the normed hidden state and the log-normaliser, from
        which the soft cross-entropy is computed without touching V-sized target tensors.
        """
        normed = self.norm(hq)
        logits = self.lm_head(normed).float()
        lse = torch.logsumexp(logits, dim=-1) if with_lse else None
        rank = self.rank_head(torch.cat([hq.detach(), rank_stats(logits, lse).to(hq.dtype)], dim=-1))
        if with_lse:
            return logits, rank, normed, lse
        return logits, rank

    def serving_heads(self, hq: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Serving: the top-k head rows with their log-probs, and the rank head's bucket logits.

        One log-softmax and one top-k serve both the rank statistics and the candidates: ops are
        what a block costs on a CPU, and torch's ``logsumexp`` over a row of the head took 4x a
        ``log_softmax`` of it (40 against 11 us at [4, 8192], 2 threads). Same values as ``heads``
        followed by a log-softmax top-k, up to float rounding.
        """
        lp = torch.log_softmax(self.lm_head(self.norm(hq)).float(), dim=-1)
        top = lp.topk(max(k, 10), dim=-1)
        logp = top.values
        entropy = -(lp.exp() * lp).sum(-1)
        rank = self.rank_head(torch.cat([hq, _stats(logp, entropy).to(hq.dtype)], dim=-1))
        if k == logp.shape[-1]:
            return logp, top.indices, rank
        return logp[..., :k], top.indices[..., :k], rank

    # ----------------------------------------------------------------- files
    def save(self, path: str | Path) -> None:
        """Config plus safetensors (d2t stays int64); both replace the old pair together."""
        save_net(self, self.cfg, "specblock", path, FROZEN_FROM_TARGET)

    @classmethod
    def load(cls, path: str | Path, target_embed: torch.Tensor, target_lm_head: torch.Tensor) -> "SpecBlockNet":
        path = Path(path)
        cfg = read_config(path, "specblock", SpecBlockConfig, "SpecBlock")
        if cfg.vocab_size != target_embed.shape[0] or cfg.hidden_size != target_embed.shape[1]:
            raise SpecBlockError(
                f"drafter at {path} was trained for vocab {cfg.vocab_size} / hidden {cfg.hidden_size}, "
                f"the target has {target_embed.shape[0]} / {target_embed.shape[1]}; train a drafter for this target"
            )
        net = cls(cfg)
        net.load_vocab(path, "SpecBlock")
        head = net.head_rows(target_lm_head.detach().float())
        load_weights(net, path, {"embed.weight": target_embed.detach().float(), "lm_head.weight": head}, "SpecBlock")
        return net.eval()

    def init_from_target(self, target_model) -> None:
        """Start the backbone from the target's top layers (our choice, for short CPU budgets).

        Drafter layer i copies target layer ``L - n + i`` (Llama-family layout: q/k/v/o, gate/up/
        down, two RMSNorms; shapes must match), the final norm copies the target's, ``fuse_taps``
        starts by passing the top tap through and ``fuse_in`` by adding the token embedding to it.
        So block 1 starts out reading what the target's last layers read, and training only has to
        learn the shift to later positions.
        """
        layers = target_model.model.layers
        n, h = len(self.layers), self.cfg.hidden_size
        src = layers[len(layers) - n :]
        with torch.no_grad():
            for mine, theirs in zip(self.layers, src):
                a, m = theirs.self_attn, theirs.mlp
                if a.q_proj.weight.shape != (h, h) or m.gate_proj.weight.shape[0] != self.cfg.intermediate_size:
                    raise ValueError("init_from_target needs the drafter's hidden/heads/intermediate to match the target's")
                mine.qkv.weight.copy_(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
                mine.o.weight.copy_(a.o_proj.weight)
                mine.gate_up.weight.copy_(torch.cat([m.gate_proj.weight, m.up_proj.weight]))
                mine.down.weight.copy_(m.down_proj.weight)
                mine.attn_norm.weight.copy_(theirs.input_layernorm.weight)
                mine.mlp_norm.weight.copy_(theirs.post_attention_layernorm.weight)
            self.norm.weight.copy_(target_model.model.norm.weight)
            self.fuse_taps.weight.zero_()
            self.fuse_taps.weight[:, -h:].copy_(torch.eye(h))
            self.fuse_in.weight.copy_(torch.cat([torch.eye(h), torch.eye(h)], dim=1))

    def tie_to_target(self, target_model) -> None:
        """Copy (not share) the target's embedding and LM head, frozen: training never moves them."""
        with torch.no_grad():
            self.embed.weight.copy_(target_model.get_input_embeddings().weight)
            self.lm_head.weight.copy_(self.head_rows(target_model.get_output_embeddings().weight))
        self.embed.weight.requires_grad_(False)
        self.lm_head.weight.requires_grad_(False)
