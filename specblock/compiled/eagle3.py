"""EAGLE-3's step on static shapes, compiled (issue 16, item 2): the compiled comparison with
SpecBlock made fair, since SpecBlock's block already runs compiled (``compiled/drafter.py``).

The same scheme as SpecBlock's block (read that module first), for EAGLE-3's two kinds of forward:

- the flush: the new committed positions (taps and next tokens, fused inside the graph) padded to
  4 or ``ROWS`` rows, written at their own slots, plus the LM head and top-k at the last real one: one graph
  per row count (and span), one host copy;
- each depth: the frontier's rows, padded to a power of two, each reading the committed slots,
  its drafted ancestors' slots and its own (the visibility is built on the host from the tree,
  a few hundred booleans), written after the committed ones; the head and top-k in the same graph.
  Drafted slots are stale once the step is over, and the next flush overwrites them.

Where the drafter attends in the fused op (fp32 on the CPU) a compiled step's span is the whole
buffer (``one_span``, as SpecBlock's block and the compiled target): the op skips hidden slots and
stops at a row's last visible one, so one graph per row count serves every context; elsewhere
spans are powers of two, each its own graph. Padded rows write to scratch slots past every span
and nobody reads them. A flush of more than
``ROWS`` positions (after a prompt, or a long accepted chain) runs the same function eagerly,
unpadded. Trees equal the eager drafter's up to float rounding (tests hold them equal at fp32).
"""

from __future__ import annotations

import numpy as np
import torch

from specblock.compiled.drafter import ROW_BUCKETS, ROWS, _layer, _rope, attention_mask, fused_attention_applies, pad_rows
from specblock.compiled.step import CompiledStep
from specblock.compiled.target import bucket_of, span_of
from specblock.policies.branching import expand, rerank_limits
from specblock.policies.tree import DraftTree
from specblock.runtime.drafters.base import DraftRequest
from specblock.runtime.drafters.eagle3 import Eagle3Drafter
from specblock.runtime.target import TargetOutput
from specblock.runtime.verify import Verdict

#: Frontier rows per depth are padded to one of these (each size compiles on first use).
WIDTHS = (1, 2, 4, 8, 16, 32)


class StaticEagle3Drafter(Eagle3Drafter):
    """An ``Eagle3Drafter`` on static buffers, compiled (``compile=True``) or eager (the same
    padded steps: the tests' cheap check of the padding)."""

    def __init__(self, drafter: Eagle3Drafter, max_context: int, compile: bool = True) -> None:
        super().__init__(drafter.net, drafter.depth, drafter.top_k, drafter.policy, drafter.seed_policy)
        self.max_rows = bucket_of(self.top_k, WIDTHS)  # a frontier never exceeds top_k (rerank_limits)
        self.capacity = max_context + ROWS + self.depth * self.max_rows  # committed + drafted slots
        self.compiled = compile
        # fp32 on CPU: attention in the fused op, so compiled steps attend over the whole buffer (one
        # graph per row count for every context: a request never waits for a compile as it grows);
        # False keeps power-of-two spans (SDPA's bool mask reads every slot of its span)
        self.fused_attention = fused_attention_applies(self.device, self.dtype)
        self.one_span = self.fused_attention
        self.row_buckets = ROW_BUCKETS  # flushes padded to 4 or 8 rows, as SpecBlock's block
        # keys (rows, span) for the flush, (frontier rows, span) for a depth step
        self.flush = CompiledStep(self._flush_step, self.net, self.device, {"rows": ROWS, "fn": "flush"}) if compile else None
        self.depth_step = CompiledStep(self._depth_step, self.net, self.device, {"rows": ROWS, "fn": "depth"}) if compile else None
        self.reset()

    def reset(self) -> None:
        super().reset()
        if getattr(self, "capacity", None) is None:
            return  # the base constructor's call: buffers come once the capacity is known
        layer = self.net.layer
        shape = (1, layer.heads, self.capacity + max(ROWS, self.max_rows), layer.head_dim)  # + scratch slots
        if getattr(self, "_kb", None) is None:
            self._kb = torch.zeros(shape, device=self.device, dtype=self.dtype)
            self._vb = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.cached = 0
        self._new: tuple[torch.Tensor, torch.Tensor] | None = None  # raw taps and next tokens, not yet cached

    # ---------------------------------------------------------------- committed state
    def _add_pending(self, taps: torch.Tensor, next_tokens: np.ndarray, first_pos: int) -> None:
        """Keep the raw taps and tokens: their fusion runs inside the flush graph."""
        toks = torch.as_tensor(next_tokens, device=self.device)
        taps = taps.to(self.dtype)
        if self._new is not None:  # never drop committed positions, whatever the caller skipped
            taps, toks = torch.cat([self._new[0], taps]), torch.cat([self._new[1], toks])
        elif first_pos != self.cached:
            raise RuntimeError(f"drafter cache holds {self.cached} positions, new ones start at {first_pos}")
        self._new = (taps, toks)

    def prefill(self, prompt: np.ndarray, features: TargetOutput | None) -> None:
        if len(prompt) > self.capacity - ROWS - self.depth * self.max_rows:
            raise ValueError(f"prompt of {len(prompt)} tokens exceeds the drafter's buffers")
        super().prefill(prompt, features)

    def accept(self, tree: DraftTree, verdict: Verdict, features: TargetOutput | None) -> None:
        self._add_pending(features.taps, np.append(tree.tokens[verdict.path[1:]], verdict.bonus), self._root_pos)

    @torch.no_grad()
    def warm(self) -> list[tuple]:
        """Compile (or load) the flush of every row bucket and the depth step of every frontier width
        at the first span, before a server listens; leaves the buffers empty. Returns the shapes."""
        if not self.compiled:
            return []
        dev, h = self.device, self.net.cfg.hidden_size
        span = self._span(1, True)  # the first span (with ``one_span`` the only one)
        taps_width = len(self.net.cfg.tap_layers) * h  # the taps, concatenated
        for rows in self.row_buckets:
            self.flush((rows, span), f"EAGLE-3's flush of {rows} positions over {span} slots",
                       torch.zeros(rows, taps_width, device=dev, dtype=self.dtype), torch.zeros(rows, dtype=torch.long, device=dev),
                       torch.tensor(1, device=dev), torch.tensor(0, device=dev), span)
        for w in (b for b in WIDTHS if b <= self.max_rows):
            visible = torch.zeros(w, span, dtype=torch.bool, device=dev)
            visible[:, 0] = True
            self.depth_step((w, span), f"EAGLE-3's depth step of {w} rows over {span} slots",
                            torch.zeros(w, h, device=dev, dtype=self.dtype), torch.zeros(w, dtype=torch.long, device=dev),
                            torch.tensor(1, device=dev), self.capacity + torch.arange(w, device=dev), visible, span)
        self.reset()
        return sorted(("flush", *k) for k in self.flush.shapes) + sorted(("depth", *k) for k in self.depth_step.shapes)

    def _span(self, need: int, compiled: bool) -> int:
        """The slots a step attends over: the whole buffer for a compiled step with ``one_span``, else
        the power of two holding ``need`` (an eager step's mask is per row)."""
        return self.capacity if compiled and self.one_span else span_of(need, self.capacity)

    # ---------------------------------------------------------------- the two steps
    def _top_packed(self, states: torch.Tensor) -> torch.Tensor:
        """``[S, 2k]``: the top-k log-probs and target ids of each state (``top_tokens``, on device)."""
        net = self.net
        logits = net.logits(states)
        top = torch.log_softmax(logits.float(), -1).topk(min(self.top_k, logits.shape[-1]), dim=-1)
        return torch.cat([top.values, net.token_ids(top.indices).to(top.values.dtype)], -1)

    def _flush_step(self, taps: torch.Tensor, toks: torch.Tensor, n_new: torch.Tensor, past: torch.Tensor, span: int):
        """Rows ``[taps, toks]`` (``n_new`` real) become positions ``past, past+1, ...``; returns the
        last real row's state ``[1, h]`` and its top-k, packed."""
        net, p = self.net, taps.shape[0]
        i = torch.arange(p, device=taps.device)
        pos = past + i
        slots = torch.where(i < n_new, pos, self.capacity + i)
        x = net.g_from_taps(taps, toks)[None, None]
        mask = attention_mask(torch.arange(span, device=taps.device)[None, :] <= pos[:, None], x.dtype, self.fused_attention)
        x = _layer(net.layer, x, _rope(pos[None, None, None], net.layer, x.dtype), self._kb, self._vb, slots, mask, span)
        state = x[0, 0].index_select(0, (n_new - 1).clamp(min=0)[None])
        return state, self._top_packed(state)

    def _depth_step(self, feats: torch.Tensor, toks: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                    visible: torch.Tensor, span: int):
        """Frontier rows (fed-back states and their tokens) at one position, written at ``slots``,
        each reading the slots ``visible`` marks; returns their states and top-k, packed."""
        net = self.net
        x = net.g(feats, toks)[None, None]
        cs = _rope(pos.expand(toks.shape[0])[None, None, None], net.layer, x.dtype)
        x = _layer(net.layer, x, cs, self._kb, self._vb, slots, attention_mask(visible, x.dtype, self.fused_attention), span)[0, 0]
        return x, self._top_packed(x)

    def _flush_static(self) -> tuple[torch.Tensor, np.ndarray, np.ndarray] | None:
        if self._new is None:
            return None
        taps, toks = self._new
        n, past = taps.shape[0], self.cached
        rows = pad_rows(n, self.row_buckets)
        padded = rows is not None
        if padded:
            taps = torch.cat([taps, taps.new_zeros(rows - n, taps.shape[1])])
            toks = torch.cat([toks, toks.new_zeros(rows - n)])
        span = self._span(past + taps.shape[0], self.compiled and padded)
        args = (taps, toks, torch.tensor(n, device=self.device), torch.tensor(past, device=self.device), span)
        if self.compiled and padded:
            state, packed = self.flush((rows, span), f"EAGLE-3's flush of {rows} positions over {span} slots", *args)
        else:
            state, packed = self._flush_step(*args)
        self.cached, self._new = past + n, None
        return state, *self._unpack(packed)

    def _unpack(self, packed: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        host = packed.cpu().numpy()
        k = host.shape[-1] // 2
        return host[:, k:].astype(np.int64), host[:, :k]

    @torch.no_grad()
    def propose(self, req: DraftRequest) -> DraftTree:
        root = int(req.tokens[-1])
        self._root_pos = len(req.tokens) - 1
        tree = DraftTree.root_only(root)
        flushed = self._flush_static()
        depth = min(self.depth, req.max_depth)
        if flushed is None or depth < 1 or req.budget < 1:
            return tree
        states, ids, lps = flushed
        depth, width = rerank_limits(self.policy, self.seed_policy, req.budget, depth, self.top_k)
        parents = np.zeros(1, dtype=np.int64)
        drafted = 0  # drafted slots written after the committed ones
        slot_of = np.full(0, -1, dtype=np.int64)  # tree node -> its slot (-1: not written)
        offered = []
        for d in range(1, depth + 1):
            offered.append((parents, ids, lps))
            new = expand(tree, parents, ids[:, :width], lps[:, :width], self.policy, req.budget, block=d - 1)
            if d == depth:
                break
            rows, _ = np.nonzero(new >= 0)
            nodes = new[new >= 0]
            frontier = np.sort(self.seed_policy.select(tree, nodes, width))
            if frontier.size == 0:
                break
            s = frontier.size
            if s > self.max_rows:  # a user's seed policy past top_k: the buffers hold top_k a depth
                raise RuntimeError(f"{s} frontier nodes at depth {d}; the static EAGLE-3 step holds {self.max_rows}")
            w = bucket_of(s, WIDTHS)
            slot_of = np.concatenate([slot_of, np.full(tree.size - slot_of.size, -1, dtype=np.int64)])
            slot_of[frontier] = self.cached + drafted + np.arange(s)
            span = self._span(self.cached + drafted + s, self.compiled)
            slots = np.concatenate([slot_of[frontier], self.capacity + np.arange(w - s)])
            visible = np.zeros((w, span), dtype=bool)
            visible[:, : self.cached] = True
            anc = tree.ancestor_mask[frontier]  # [s, tree]: drafted ancestors and the node itself
            r, c = np.nonzero(anc & (slot_of[None, :] >= 0))
            visible[r, slot_of[c]] = True
            src = np.concatenate([rows[np.searchsorted(nodes, frontier)], np.zeros(w - s, dtype=np.int64)])
            toks = np.concatenate([tree.tokens[frontier], np.zeros(w - s, dtype=np.int64)])
            args = (states[torch.as_tensor(src, device=self.device)], torch.as_tensor(toks, device=self.device),
                    torch.tensor(self._root_pos - 1 + d, device=self.device), torch.as_tensor(slots, device=self.device),
                    torch.as_tensor(visible, device=self.device), span)
            if self.compiled:
                out, packed = self.depth_step((w, span), f"EAGLE-3's depth step of {w} rows over {span} slots", *args)
            else:
                out, packed = self._depth_step(*args)
            states = out[:s]
            ids, lps = self._unpack(packed[:s])
            drafted += s
            parents = frontier
        tree.meta["positions"] = {"node": np.concatenate([o[0] for o in offered]),
                                  "ids": np.concatenate([o[1] for o in offered]),
                                  "logp": np.concatenate([o[2] for o in offered])}
        return self.policy.prune(tree, req.budget)
