"""Falcon-style drafter (Gao et al. 2024): semi-autoregressive blocks of 2 tokens per forward.

Network. The EAGLE-style front end shared with ParallelSpec (``parallelspec.FeatureNet``: fused
target taps + next-token embedding, a small decoder stack with its own causal KV cache of committed
positions). A drafting forward runs one *block* of ``block_size`` (bs, default 2) slots; slot i's
input is ``g(feature, token)`` for the i-th of the last bs known tokens of the path and its output
predicts the i-th of the next bs tokens (the state at position p predicts x_{p+bs+1}). Slots of a
block see each other both ways (Falcon's "relaxed", block-causal mask), every earlier block of
their own path, and the committed context before the block.

Forward 1 re-reads the last bs committed positions (their target taps) as a block, in the same
forward that caches the not-yet-cached context positions; forward n >= 2 reads the bs tokens that
forward n-1 drafted, each fed with the drafter's own output state of the slot that predicted it (as
EAGLE-3 feeds its state back). F forwards make a tree of depth bs*F (defaults: 3 forwards, depth 6).

Tree (our reading of Falcon's "custom-designed decoding tree"): inside a block, slot i is not
conditioned on the token chosen at slot i-1, so each block hangs a top-1 *spine* with top-k
siblings as leaves (``policies.branching.grow_block``, ``TopKBranching``); the next forward
extends the ``max_seeds`` best last-slot nodes by cumulative draft log-prob (``TopScoreSeeds``),
all seeds batched in one forward, each reading the spine token before it and its own token.

Training (``training/falcon_step.py``) runs the same blocks for every position of a window, F
forwards deep, with glancing-style inputs: blocks >= 2 read the drafter's own previous predictions,
except that a wrong one is replaced by the ground-truth token with a probability that falls over
training (Falcon's coupled sequential glancing distillation, simplified: per token, not by
Hamming-distance sampling). Choices: the committed context the blocks see is the causal context
stream (not blocks), and block 1 sees context strictly before it; the target's LM head is shared
and frozen; the first tokens of a prompt shorter than bs+1 get no draft.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from pydantic import Field

from specblock.policies.branching import TopKBranching, TreePolicy, grow_block
from specblock.policies.seeds import SeedPolicy, TopScoreSeeds
from specblock.policies.tree import DraftTree
from specblock.runtime.drafters.base import DraftRequest
from specblock.runtime.drafters.netio import load_net, save_net
from specblock.runtime.drafters.parallelspec import FROZEN, ContextDrafter, FeatureConfig, FeatureNet, cat_kv, flat


class FalconConfig(FeatureConfig):
    block_size: int = Field(2, ge=1)  # tokens per drafter forward
    forwards: int = Field(3, ge=1)  # serving default: forwards per tree (depth block_size * forwards)
    max_seeds: int = Field(2, ge=1)  # serving default: block ends the next forward extends


class FalconNet(FeatureNet):
    def save(self, path: str | Path) -> None:
        save_net(self, self.cfg, "falcon", path, FROZEN)

    @classmethod
    def load(cls, path: str | Path, target_model) -> "FalconNet":
        return load_net(cls, FalconConfig, path, "falcon", "Falcon", target_model, FROZEN)


class FalconDrafter(ContextDrafter):
    name = "falcon"
    NET = FalconNet

    def __init__(
        self,
        net: FalconNet,
        forwards: int | None = None,
        top_k: int | None = None,
        max_seeds: int | None = None,
        policy: TreePolicy | None = None,
        seeds: SeedPolicy | None = None,
    ) -> None:
        self._bind(net)
        self.bs = net.cfg.block_size
        self.forwards = forwards or net.cfg.forwards
        self.max_seeds = max_seeds or net.cfg.max_seeds
        self.policy = policy or TopKBranching(k=top_k or net.cfg.top_k)
        self.seed_policy = seeds or TopScoreSeeds()
        self.reset()

    def reset(self) -> None:
        super().reset()
        self.recent: torch.Tensor | None = None  # g's of the last bs committed positions [<= bs, h]

    # ---------------------------------------------------------------- drafting
    def _top(self, states: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        return self.net.top_tokens(self.net.logits(states), self.width)

    def _first_forward(self, lim: int, draft: bool) -> tuple[torch.Tensor | None, list | None]:
        """Cache the pending context positions and, when ``draft``, run block 1 (the last bs
        committed g's at positions lim..lim+bs-1) in the same forward. Returns block 1's states
        ``[1, bs, h]`` and its per-layer keys/values ``[1, H, bs, d]``."""
        ctx, net, dev, bs = self.ctx, self.net, self.device, self.bs
        n, c0 = ctx.pending.shape[0], ctx.cached
        recent = ctx.pending if self.recent is None else torch.cat([self.recent, ctx.pending])
        self.recent = recent[-bs:]
        m = bs if draft else 0
        x = torch.cat([ctx.pending, self.recent[:m]])[None, None]
        pos = torch.cat([ctx.pending_pos, lim + torch.arange(m, device=dev)])
        own = torch.zeros(n + m, n + m, dtype=torch.bool, device=dev)
        own[:n, :n] = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
        own[n:, :n] = ctx.pending_pos < lim
        own[n:, n:] = True
        cmask = torch.ones(1, 1, n + m, c0, dtype=torch.bool, device=dev)
        cmask[0, 0, n:] = torch.arange(c0, device=dev) < lim
        out, kvs = net.run(x, pos[None, None], ctx.cache, cmask, own)
        ctx.commit(kvs, n)
        if not draft:
            return None, None
        return out[0, :, n:], [(k[:, :, 0, n:], v[:, :, 0, n:]) for k, v in kvs]

    @torch.no_grad()
    def propose(self, req: DraftRequest) -> DraftTree:
        root, bs, dev = int(req.tokens[-1]), self.bs, self.device
        self._root_pos = len(req.tokens) - 1
        tree = DraftTree.root_only(root)
        if self.ctx.pending is None:  # a one-token prompt: no target features yet
            return tree
        lim = self._root_pos - bs  # block 1 sits at lim..R-1 and sees committed positions < lim
        have = (0 if self.recent is None else self.recent.shape[0]) + self.ctx.pending.shape[0]
        draft = have >= bs and req.max_depth >= 1 and req.budget >= 1
        states, bkeys = self._first_forward(lim, draft)
        if not draft:
            return tree
        n_fwd = min(self.forwards, math.ceil(req.max_depth / bs))
        seeds = np.zeros(1, dtype=np.int64)
        row_ids = np.zeros(1, dtype=np.int64)  # global block-row id of each row of `states`
        row_anc = np.ones((1, 1), dtype=bool)  # [rows, rows]: row j is row i or one of its ancestors
        ctx_ok = torch.arange(self.ctx.cached, device=dev) < lim
        for f in range(n_fwd):
            ids, lps = self._top(states)
            spine = grow_block(tree, seeds, ids, lps, None, self.policy, req.budget, block=f)
            if f == n_fwd - 1 or tree.size - 1 >= req.budget:
                break
            nodes, pos_in = tree.meta["block_nodes"], tree.meta["block_pos"]
            seeds = np.sort(self.seed_policy.select(tree, nodes[pos_in == bs - 1], self.max_seeds))
            if seeds.size == 0:
                break
            rows = tree.meta["block_rows"][np.searchsorted(nodes, seeds)]
            toks = np.concatenate([tree.tokens[spine[rows, : bs - 1]], tree.tokens[seeds][:, None]], axis=1)
            s = seeds.size
            x = self.net.g(states[torch.as_tensor(rows, device=dev)], torch.as_tensor(toks, device=dev))[None]
            pos = (lim + bs * (f + 1) + torch.arange(bs, device=dev)).expand(1, s, bs)
            anc = row_anc[row_ids[rows]]  # [S, T] ancestor block rows of each new row
            vis = torch.as_tensor(np.repeat(anc, bs, axis=1), device=dev)
            cmask = torch.cat([ctx_ok.expand(s, -1), vis], -1)[None]
            own = torch.ones(bs, bs, dtype=torch.bool, device=dev)
            out, kvs = self.net.run(x, pos, cat_kv(self.ctx.cache, bkeys), cmask, own)
            states, bkeys = out[0], cat_kv(bkeys, [flat(kv) for kv in kvs])
            t = row_anc.shape[0]
            grown = np.zeros((t + s, t + s), dtype=bool)
            grown[:t, :t] = row_anc
            grown[t:, :t] = anc
            grown[np.arange(t, t + s), np.arange(t, t + s)] = True
            row_anc, row_ids = grown, t + np.arange(s)
        return tree
