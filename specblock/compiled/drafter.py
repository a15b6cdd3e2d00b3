"""SpecBlock's block 1 on static shapes, compiled per attention span (issue 16, item 2).

Why: on the compiled target a SpecBlock step spent about a fifth of its time drafting (the CLI's
``draft_share``), most of it in block 1's eager forward, its heads and the fusion of the target's
taps: a few hundred small ops, each paying the dispatcher. ``torch.compile(dynamic=True)`` of the
same code was slower (``compiled_drafters.md``): dynamic shapes brought guards and kept the host
work. Here every shape is fixed, as for the target (``compiled/target.py``):

- the drafter's KV cache is one preallocated buffer per layer, written with ``index_copy_`` at
  the positions' own slots (the cache holds positions 0, 1, ... in order, so slot = position);
- the new context positions (the last step's accepted path plus the bonus token: the target's
  taps there and the tokens after them) are padded to 4 or ``ROWS`` (``ROW_BUCKETS``); padded rows write to scratch
  slots past the attention span and nobody reads them;
- attention runs over a span of the buffer, stale slots hidden by position (a row sees the slots
  up to its own position): the whole buffer where the fused op runs (``one_span``, as the compiled
  target's: the op stops at a row's last visible slot, so one graph a row bucket serves every
  context and a conversation never waits for a compile as it grows), else a power of two;
- an fp32 drafter on the CPU attends in the target's fused op (``runtime/tree_attention.py``, an
  additive mask made once a step), not SDPA;
- one graph holds the fusion of the taps (moved here from ``accept``), both layers, the shift,
  the heads, the draft vocabulary's map and the bucket argmax: one call and one host copy a step.

Later blocks (M > 1) run eagerly on views of the same buffers (``cache``). The first block after
a prompt (many new positions) runs the same function eagerly, unpadded. Trees are those of the
eager drafter up to float rounding (tests hold them equal at fp32). Not with ``--adapt``: an
update swaps the net's weights while it serves, so the adapting drafter stays eager.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from specblock.compiled.step import CompiledStep
from specblock.compiled.target import span_of
from specblock.runtime import tree_attention
from specblock.runtime.drafters.layers import DecoderLayer, apply_rope
from specblock.runtime.drafters.specblock import SpecBlockDrafter, pack_candidates, unpack_candidates
from specblock.runtime.target import TargetOutput

#: New context positions per compiled step: the accepted path plus the bonus token. A tree deeper
#: than ``ROWS - 1`` that is accepted whole runs that one step eagerly.
ROWS = 8
#: The padded step's row counts (each its own graph per span): a block's forward is bound by its
#: multiply-adds on this CPU, and most steps commit tau ~ 2-3 positions, so 8 rows paid for padding.
ROW_BUCKETS: tuple[int, ...] = (4, ROWS)
#: Attention of an fp32 CPU drafter in the fused op; False keeps SDPA (the baseline).
USE_FUSED = True


def fused_attention_applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a static drafter attends in the fused op: an fp32 drafter on the CPU, where it builds."""
    return device.type == "cpu" and dtype == torch.float32 and USE_FUSED and tree_attention.load()


def pad_rows(n: int, buckets: tuple[int, ...] = ROW_BUCKETS) -> int | None:
    """The smallest bucket holding ``n`` new positions; None past the largest (an unpadded step)."""
    return next((b for b in buckets if n <= b), None)


def _layer(layer: DecoderLayer, x: torch.Tensor, cs, kb: torch.Tensor, vb: torch.Tensor, slots: torch.Tensor,
           mask: torch.Tensor, span: int) -> torch.Tensor:
    """``DecoderLayer.forward`` for one row of ``n`` positions over a static buffer: the row's keys
    and values are written at ``slots`` first, then it attends to the buffer's first ``span`` slots.
    ``mask``: bool ``[n, span]`` (True: visible) for SDPA, or additive fp32 ``[1, 1, n, span]`` for the
    fused op (``runtime/tree_attention.py``)."""
    g, r, n, h = x.shape
    qkv = layer.qkv(layer.attn_norm(x)).view(g, r, n, 3, layer.heads, layer.head_dim).permute(3, 0, 4, 1, 2, 5)
    qk = apply_rope(qkv[:2], *cs)
    q, k, v = qk[0, :, :, 0], qk[1, :, :, 0], qkv[2, :, :, 0]  # [1, H, n, d]
    kb.index_copy_(2, slots, k)
    vb.index_copy_(2, slots, v)
    if mask.dtype == torch.bool:
        att = F.scaled_dot_product_attention(q, kb[:, :, :span], vb[:, :, :span], attn_mask=mask).permute(0, 2, 1, 3)
    else:
        att = tree_attention.tree_attention(q, kb[:, :, :span], vb[:, :, :span], mask)  # [1, n, H, d]
    x = x + layer.o(att.reshape(g, r, n, h))
    gate, up = layer.gate_up(layer.mlp_norm(x)).chunk(2, dim=-1)
    return x + layer.down(F.silu(gate) * up)


def attention_mask(visible: torch.Tensor, dtype: torch.dtype, fused: bool) -> torch.Tensor:
    """``_layer``'s mask from bool ``[n, span]`` (True: visible): as it is for SDPA, or the fused
    op's additive ``[1, 1, n, span]`` (0 visible, the dtype's min hidden: the op skips those slots)."""
    if not fused:
        return visible
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, torch.finfo(dtype).min)[None, None]


def _rope(pos: torch.Tensor, layer: DecoderLayer, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope_cos_sin`` without its module-level table: a saved graph's guard on that dict's entry
    failed to load in a fresh process, where the table is still empty (the graph folds the
    frequencies into a constant anyway)."""
    d = layer.head_dim
    inv = 1.0 / layer.rope_theta ** (torch.arange(0, d, 2, device=pos.device, dtype=torch.float32) / d)
    ang = pos.float()[..., None] * inv
    ang = torch.cat([ang, ang], -1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


class StaticSpecBlockDrafter(SpecBlockDrafter):
    """A ``SpecBlockDrafter`` whose block 1 runs on static buffers, compiled (``compile=True``) or
    eagerly (``compile=False``: the same padded step, the tests' cheap check of the padding)."""

    def __init__(self, drafter: SpecBlockDrafter, capacity: int, compile: bool = True) -> None:
        self.capacity = capacity  # positions the buffers hold (the target's context); reset() needs it
        super().__init__(drafter.net, drafter.M, drafter.policy, drafter.seed_policy, drafter.max_seeds)
        self.compiled = compile
        # fp32 on CPU: attention in the target's fused op (two SDPA calls were about a tenth of the step)
        self.fused_attention = fused_attention_applies(self.device, self.dtype)
        self.row_buckets = ROW_BUCKETS  # (ROWS,) pads every step to 8 rows, as before (experiments/drafter_rows.py)
        # compiled steps attend over the whole buffer (False: power-of-two spans, experiments/drafter_rows.py --ab span)
        self.one_span = self.fused_attention
        # keys (rows, span)
        self.block = CompiledStep(self._step, self.net, self.device, {"rows": ROWS}) if compile else None

    def reset(self) -> None:
        super().reset()
        cfg = self.net.cfg
        shape = (1, cfg.num_heads, self.capacity + ROWS, cfg.hidden_size // cfg.num_heads)
        if getattr(self, "_kb", None) is None:
            self._kb = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in self.net.layers]
            self._vb = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in self.net.layers]
        self.cached = 0  # positions 0 .. cached-1 hold committed context
        self._new: tuple[torch.Tensor, torch.Tensor] | None = None  # taps and next tokens not yet cached

    # ---------------------------------------------------------------- committed state
    def _set_pending(self, taps: torch.Tensor, next_tokens: np.ndarray, first_pos: int) -> None:
        """Keep the raw taps and tokens: their fusion into g runs inside the compiled step."""
        if first_pos != self.cached:
            raise RuntimeError(f"drafter cache holds {self.cached} positions, new ones start at {first_pos}")
        self._new = (taps.to(self.dtype), torch.as_tensor(next_tokens, device=self.device))
        self.pending = self._new[0]  # not None: the base class reads "has context" from it

    # ---------------------------------------------------------------- block 1
    def _step(self, taps: torch.Tensor, toks: torch.Tensor, n_new: torch.Tensor, past: torch.Tensor, span: int):
        """Rows ``[taps, toks]`` (``n_new`` real, the rest padding) become context positions
        ``past, past+1, ...``; the K queries follow the last real one. Returns the queries' top
        states and ``[K, 2k+4]``: the candidates packed for one host copy (``pack_candidates``)."""
        net, p, k = self.net, taps.shape[0], self.net.cfg.K
        g = net.g_from_target(taps, toks)  # [P, h]
        last = (n_new - 1).clamp(min=0)
        x = torch.cat([g, net.queries(g.index_select(0, last[None]))[0]], dim=0)[None, None]  # [1, 1, P+K, h]
        i = torch.arange(p, device=g.device)
        pos_q = past + n_new + torch.arange(k, device=g.device)
        pos = torch.cat([past + i, pos_q])
        slots = torch.cat([torch.where(i < n_new, past + i, self.capacity + i), pos_q])
        # [P+K, span]; the fused op's additive form is made once for both layers
        mask = attention_mask(torch.arange(span, device=g.device)[None, :] <= pos[:, None], x.dtype, self.fused_attention)
        cs = _rope(pos[None, None, None], net.layers[0], x.dtype)
        for j, layer in enumerate(net.layers):
            x = _layer(layer, x, cs, self._kb[j], self._vb[j], slots, mask, span)
            if net.cfg.shift and j < len(net.layers) - 1:
                x = torch.cat([x[..., :-k, :], net._shift(j, x[..., -k:, :])], dim=-2)
        hq = x[..., -k:, :]
        top = net.cfg.top_k
        logp, rows, rank = net.serving_heads(hq[0], top)
        return hq, pack_candidates(logp, net.token_ids(rows), rank)

    def _first_block(self, root: int) -> tuple[torch.Tensor, int]:
        if self._new is None:  # a one-token prompt: nothing cached, the base class's path
            return super()._first_block(root)
        taps, toks = self._new
        n = taps.shape[0]
        past = self.cached
        rows = pad_rows(n, self.row_buckets)
        padded = rows is not None  # padded in eager mode too, so that the tests see the compiled step's inputs
        if padded:
            taps = torch.cat([taps, taps.new_zeros(rows - n, taps.shape[1])])
            toks = torch.cat([toks, toks.new_zeros(rows - n)])
        compiled = self.compiled and padded
        span = self._span(past + taps.shape[0] + self.net.cfg.K, compiled)
        args = (taps, toks, torch.tensor(n, device=self.device), torch.tensor(past, device=self.device), span)
        hq, packed = self._run_block(rows, span, *args) if compiled else self._step(*args)
        self._packed = packed
        self.cached = past + n
        self.cache = [(kb[:, :, : self.cached], vb[:, :, : self.cached]) for kb, vb in zip(self._kb, self._vb)]
        self._new = self.pending = None
        return hq, past + n - 1

    def _span(self, need: int, compiled: bool) -> int:
        """The slots a step attends over: the whole buffer for a compiled step with ``one_span``; an
        eager step (the first block after a prompt) keeps the power of two, its mask is per row."""
        return self.capacity if compiled and self.one_span else span_of(need, self.capacity)

    @torch.no_grad()
    def warm(self) -> list[tuple]:
        """Compile (or load) the block of every row bucket at the first span (with ``one_span`` the
        only one), now rather than in a request (``Session.warm_compiled``, before a server
        listens); leaves the buffers empty. Returns the shapes warmed."""
        if not self.compiled:
            return []
        span = self._span(1, True)  # the first span
        width = len(self.net.cfg.tap_layers) * self.net.cfg.hidden_size  # the taps, concatenated
        for rows in self.row_buckets:
            self._run_block(rows, span, torch.zeros(rows, width, device=self.device, dtype=self.dtype),
                            torch.zeros(rows, dtype=torch.long, device=self.device), torch.tensor(1, device=self.device),
                            torch.tensor(0, device=self.device), span)
        self.reset()
        return sorted(self.block.shapes)

    def _run_block(self, rows: int, span: int, *args):
        return self.block((rows, span), f"SpecBlock's block for {rows} new positions over {span} slots", *args)

    def _candidates(self, hq: torch.Tensor):
        packed = getattr(self, "_packed", None)
        if packed is None:  # later blocks (eager)
            return super()._candidates(hq)
        self._packed = None
        return unpack_candidates(packed.cpu().numpy(), self.net.cfg.top_k)

    def prefill(self, prompt: np.ndarray, features: TargetOutput | None) -> None:
        if len(prompt) > self.capacity:
            raise ValueError(f"prompt of {len(prompt)} tokens exceeds the drafter's buffers ({self.capacity})")
        super().prefill(prompt, features)

