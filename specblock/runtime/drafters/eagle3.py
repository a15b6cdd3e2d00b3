"""EAGLE-3-style drafter (Li et al. 2025): fused target taps, one decoder layer, EAGLE-2 tree.

Network. The target's low/mid/top hidden states at committed position p are fused by one
``Linear(3h -> h)``; with the embedding of the token that follows (x_{p+1}) it makes the layer's
input ``g_p = fc([norm(feature_p) ; norm(e(x_{p+1}))])``, one decoder layer runs over the g's
(causal, its own KV cache of committed positions), and the output state ``s_p`` predicts
x_{p+2} through the target's (frozen) LM head. For a drafted token there are no target
features: the layer's own output state takes the feature's place (EAGLE-3 feeds its hidden
state back), so depth d+1 reads ``g = fc([norm(s_parent) ; norm(e(token))])``.

Tree. EAGLE-2 dynamic expansion: the root's state offers its top ``top_k`` tokens; at every
depth the ``top_k`` new nodes with the highest cumulative draft log-prob (``TopScoreSeeds``) are
expanded in one batched forward (tree attention over the committed cache plus each node's drafted
ancestors), each offering its own top ``top_k``; after ``depth`` steps the tree is reranked to the
node budget by cumulative log-prob (``DynamicBranching.prune``).

Choices the papers leave open or that we simplify ("-style"): the draft vocabulary is the target's
full one or, with ``draft_vocab``, EAGLE-3's reduced frequency-selected one (``draftvocab.py``), but
the LM head rows are the target's, frozen and not saved (EAGLE-3 trains its own head); the fed-back state is the layer output before the
final norm; feature and embedding are RMS-normed separately and mixed by one ``Linear(2h -> h)``
into the residual stream of a standard pre-norm layer (EAGLE-3 keeps the feature as residual and
widens q/k/v to 2h); RoPE positions continue the sequence's (g_p at position p); the first token
of a one-token prompt gets no draft (no target features exist yet).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from specblock.policies.branching import DynamicBranching, TreePolicy, expand, rerank_limits
from specblock.policies.seeds import SeedPolicy, TopScoreSeeds
from specblock.policies.tree import DraftTree
from specblock.runtime.drafters.base import DraftRequest, Drafter
from specblock.runtime.drafters.draftvocab import DraftVocab, DraftVocabSize
from specblock.runtime.drafters.kvcache import KVCache
from specblock.runtime.drafters.layers import DecoderLayer, FusedInputHeads, flat_kv
from specblock.runtime.drafters.netio import load_net, save_net, tie_frozen
from specblock.runtime.target import TargetModel, TargetOutput
from specblock.runtime.verify import Verdict

FROZEN = ("embed.weight", "lm_head.weight")


class Eagle3Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_heads: int = Field(4, ge=1)
    intermediate_size: int = Field(1024, gt=0)
    tap_layers: tuple[int, ...] = (1, 3, 5)
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    depth: int = Field(6, ge=1)  # serving defaults, overridable per run
    top_k: int = Field(8, ge=1)
    draft_vocab: DraftVocabSize = None  # LM-head rows (a token outside them is never drafted); None = all


class Eagle3Net(FusedInputHeads, DraftVocab, nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.build_front(cfg)
        self.layer = DecoderLayer(cfg.hidden_size, cfg.num_heads, cfg.intermediate_size, cfg.rope_theta, cfg.rms_eps)
        self.build_head(cfg)

    # ----------------------------------------------------------------- files
    def save(self, path: str | Path) -> None:
        save_net(self, self.cfg, "eagle3", path, FROZEN)

    @classmethod
    def load(cls, path: str | Path, target_model) -> "Eagle3Net":
        return load_net(cls, Eagle3Config, path, "eagle3", "EAGLE-3", target_model, FROZEN)

    def tie_to_target(self, target_model) -> None:
        tie_frozen(self, target_model, FROZEN)


class Eagle3Drafter(Drafter):
    name = "eagle3"
    needs_features = True

    def __init__(
        self,
        net: Eagle3Net,
        depth: int | None = None,
        top_k: int | None = None,
        policy: TreePolicy | None = None,
        seeds: SeedPolicy | None = None,
    ) -> None:
        self.net = net.eval()
        self.tap_layers = tuple(net.cfg.tap_layers)  # the engine points the target's taps here per generate
        self.depth = depth or net.cfg.depth
        self.top_k = top_k or net.cfg.top_k
        self.policy = policy or DynamicBranching(top_k=self.top_k)
        self.seed_policy = seeds or TopScoreSeeds()
        p = next(net.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.reset()

    def tree_sizes(self, budget: int) -> tuple[int, ...]:
        """With the default policy and frontier every expanded node offers ``width`` children and
        the frontier takes ``width`` of them, so ``depth`` steps offer ``width + (depth - 1) *
        width**2`` candidates and the rerank keeps the budget's best of them: one size away from the
        context's end (``propose``'s limits). A user's policy or frontier: every size."""
        if type(self.policy) is not DynamicBranching or type(self.seed_policy) is not TopScoreSeeds or budget < 1:
            return super().tree_sizes(budget)
        depth, width = rerank_limits(self.policy, self.seed_policy, budget, self.depth, self.top_k)
        return (1 + min(budget, width + (depth - 1) * width * width),)

    @classmethod
    def load(cls, path: str | Path, target: TargetModel, **kw) -> "Eagle3Drafter":
        net = Eagle3Net.load(path, target.model)
        target.tap_layers = tuple(net.cfg.tap_layers)  # the drafter decides which layers it reads
        return cls(net.to(device=target.device, dtype=target.drafter_dtype), **kw)

    def reset(self) -> None:
        self.cache: KVCache | None = None  # committed positions
        self.pending: torch.Tensor | None = None  # g's of committed positions not yet cached [n, h]
        self.pending_pos: torch.Tensor | None = None

    # ---------------------------------------------------------------- committed state
    def _add_pending(self, taps: torch.Tensor, next_tokens: np.ndarray, first_pos: int) -> None:
        nt = torch.as_tensor(next_tokens, device=self.device)
        with torch.no_grad():
            g = self.net.g_from_taps(taps.to(self.dtype), nt)
        pos = first_pos + torch.arange(len(next_tokens), device=self.device)
        if self.pending is not None:  # never drop committed positions, whatever the caller skipped
            g, pos = torch.cat([self.pending, g]), torch.cat([self.pending_pos, pos])
        self.pending, self.pending_pos = g, pos

    def prefill(self, prompt: np.ndarray, features: TargetOutput | None) -> None:
        self.reset()
        if features is not None and features.taps is not None and len(prompt) > 1:
            self._add_pending(features.taps, prompt[1:], 0)

    def accept(self, tree: DraftTree, verdict: Verdict, features: TargetOutput | None) -> None:
        nxt = np.append(tree.tokens[verdict.path[1:]], verdict.bonus)
        self._add_pending(features.taps, nxt, self._root_pos)

    def _flush(self, room: int) -> torch.Tensor | None:
        """Run the pending committed positions through the layer (one causal block over the
        cache), append their keys/values; returns the last one's state (it predicts depth 1).
        ``room``: rows to keep free past them (the tree's expanded nodes stage their keys there)."""
        if self.pending is None:
            return None
        n, layer = self.pending.shape[0], self.net.layer
        if self.cache is None:
            self.cache = KVCache.empty(1, layer.heads, layer.head_dim, self.pending)
        self.cache = self.cache.reserve(n + room)
        out, _ = self.net.layer(self.pending[None, None], self.pending_pos[None, None], self.cache.slot(0))
        self.cache = self.cache.commit(n)
        self.pending = self.pending_pos = None
        return out[0, 0, -1:]

    # ---------------------------------------------------------------- drafting
    def _top(self, states: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        return self.net.top_tokens(self.net.logits(states), self.top_k)

    @torch.no_grad()
    def propose(self, req: DraftRequest) -> DraftTree:
        root = int(req.tokens[-1])
        self._root_pos = len(req.tokens) - 1
        tree = DraftTree.root_only(root)
        # Nothing past what the final rerank to the budget can keep (policies.branching)
        depth, width = rerank_limits(self.policy, self.seed_policy, req.budget, min(self.depth, req.max_depth), self.top_k)
        states = self._flush(max(depth, 0) * width)  # [S=1, h]: the state behind the root's children
        if states is None or depth < 1 or req.budget < 1:
            return tree
        net, dev = self.net, self.device
        parents = np.zeros(1, dtype=np.int64)
        expanded = np.zeros(0, dtype=np.int64)  # nodes whose keys/values sit past the committed rows, in order
        n_ctx = self.cache.n
        offered: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # per depth: (nodes, ids, logps)
        for d in range(1, depth + 1):
            ids, lps = self._top(states)
            offered.append((parents, ids, lps))
            new = expand(tree, parents, ids[:, :width], lps[:, :width], self.policy, req.budget, block=d - 1)
            if d == depth:
                break
            rows, _ = np.nonzero(new >= 0)
            nodes = new[new >= 0]  # ascending: one extend appends row-major
            frontier = np.sort(self.seed_policy.select(tree, nodes, width))
            if frontier.size == 0:
                break
            src = torch.as_tensor(rows[np.searchsorted(nodes, frontier)], device=dev)
            x = net.g(states[src], torch.as_tensor(tree.tokens[frontier], device=dev))[None, :, None]
            s = frontier.size
            pos = torch.full((1, s, 1), self._root_pos - 1 + d, device=dev)  # depth d+1 sits at R-2+(d+1)
            anc = tree.ancestor_mask[np.ix_(frontier, expanded)]  # drafted ancestors (strict: self not yet cached)
            mask = torch.cat([torch.ones(s, n_ctx, dtype=torch.bool, device=dev), torch.as_tensor(anc, device=dev)], -1)
            # the committed rows and the expanded nodes' keys after them: one view, no copy
            out, kv = net.layer(x, pos, self.cache.view(0, n_ctx + expanded.size), mask[None])
            self.cache.write(0, n_ctx + expanded.size, *flat_kv(kv))  # [1, H, S, d]
            expanded = np.concatenate([expanded, frontier])
            states, parents = out[0, :, 0], frontier
        # every expanded node's full top-k, before the rerank cuts candidates: traces log the
        # target's rank among them, which the simulator's trace fit needs uncensored
        tree.meta["positions"] = {"node": np.concatenate([o[0] for o in offered]),
                                  "ids": np.concatenate([o[1] for o in offered]),
                                  "logp": np.concatenate([o[2] for o in offered])}
        return self.policy.prune(tree, req.budget)
