"""SpecBlock at serving time: M block forwards grow one tree, verified once by the target.

Block 1 starts from the root: its prefix summary is the g of the root's parent position (target
taps fused with the root token). Later blocks start from seeds that the seed policy picks among
the previous block's nodes, all seeds batched in one forward, each with the drafter's own top
hidden state at the seed plus the seed token's embedding. The drafter's KV cache holds only
committed positions: what a block computes for drafted tokens is thrown away, and the target's
taps at accepted nodes become the next context positions (``accept``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specblock.policies.branching import RankBucketBranching, TreePolicy, grow_block
from specblock.policies.expected import ExpectedAcceptanceBranching
from specblock.policies.seeds import DeepestConfidentSeeds, SeedPolicy
from specblock.policies.tree import DraftTree
from specblock.runtime.drafters.base import DraftRequest, Drafter
from specblock.runtime.drafters.kvcache import KVCache
from specblock.runtime.drafters.specblock_net import SpecBlockNet
from specblock.runtime.target import TargetModel, TargetOutput
from specblock.runtime.verify import Verdict


def pack_candidates(logp: torch.Tensor, ids: torch.Tensor, rank_logits: torch.Tensor) -> torch.Tensor:
    """``[..., 2k + 4]``: log-probs, target ids and the rank head's logits side by side, so that one
    device-to-host copy carries them all (ids below 2^24 are exact). The bucket and its
    probabilities are worked out on the host from the 4 logits: no device op of their own."""
    return torch.cat([logp, ids.to(logp.dtype), rank_logits.to(logp.dtype)], -1)


def unpack_candidates(host: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``pack_candidates``' columns back: ids, log-probs, predicted buckets (the first maximal logit,
    as torch's argmax) and the rank head's probabilities."""
    logits = host[..., 2 * k :].astype(np.float64)
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return host[..., k : 2 * k].astype(np.int64), host[..., :k], logits.argmax(-1), e / e.sum(-1, keepdims=True)


class SpecBlockDrafter(Drafter):
    name = "specblock"
    needs_features = True

    def __init__(
        self,
        net: SpecBlockNet,
        M: int = 2,
        policy: TreePolicy | None = None,
        seeds: SeedPolicy | None = None,
        max_seeds: int = 2,
    ) -> None:
        self.net = net.eval()
        self.tap_layers = tuple(net.cfg.tap_layers)  # the engine points the target's taps here per generate
        self.M, self.max_seeds = M, max_seeds
        self.policy = policy or RankBucketBranching((2, 4, 10, 0))
        self.seed_policy = seeds or DeepestConfidentSeeds()
        p = next(net.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.reset()

    def tree_sizes(self, budget: int) -> tuple[int, ...]:
        """The sizes one block (``M = 1``) under rank widths can take (``grow_block``): its spine
        grows until a position's bucket has width 0, or all ``K`` positions deep, each position
        keeping its bucket's width of candidates (at most ``top_k``), and the budget cuts the total.
        So a tree holds ``min(budget, w_1 + ... + w_j)`` nodes below the root for some widths' run.
        Widths with no 0 fill any budget up to ``K`` times the smallest: one size. The shipped
        widths (2, 4, 10, 0) at budget 3 give 1, 3 or 4 nodes, never 2. Expected-acceptance widths
        that fill the budget: one size. Later blocks' seeds (``M > 1``) and other policies: every size."""
        pol = self.policy
        if type(pol) is ExpectedAcceptanceBranching and pol.min_value == 0 and budget >= 1:
            # it fills the budget in block 1 (other sizes, rare, pad up to this one)
            return (1 + min(budget, self.net.cfg.K * min(self.net.cfg.top_k, pol.max_width)),)
        if self.M != 1 or type(pol) is not RankBucketBranching or budget < 1:
            return super().tree_sizes(budget)
        widths = {min(int(w), self.net.cfg.top_k) for w in pol.widths_by_bucket}
        ends, live = set(), {0}  # totals of spines that ended; totals of spines still growing
        for _ in range(self.net.cfg.K):
            if 0 in widths:
                ends |= live  # a width of 0 at this position ends the spine
            live = {min(budget, t + w) for t in live for w in widths if w > 0}
        return tuple(sorted({1 + t for t in ends | live}))  # every total is capped at the budget already

    @classmethod
    def load(cls, path: str | Path, target: TargetModel, **kw) -> "SpecBlockDrafter":
        m = target.model
        net = SpecBlockNet.load(path, m.get_input_embeddings().weight, m.get_output_embeddings().weight)
        return cls(net.to(device=target.device, dtype=target.drafter_dtype), **kw)

    def reset(self) -> None:
        self.cache: KVCache | None = None  # committed positions (the compiled drafter: views of its buffers)
        self.pending: torch.Tensor | None = None  # g's of committed positions not yet cached [n, h]
        self.pending_pos: torch.Tensor | None = None

    # ---------------------------------------------------------------- committed state
    def _set_pending(self, taps: torch.Tensor, next_tokens: np.ndarray, first_pos: int) -> None:
        nt = torch.as_tensor(next_tokens, device=self.device)
        with torch.no_grad():
            self.pending = self.net.g_from_target(taps.to(self.dtype), nt)
        self.pending_pos = first_pos + torch.arange(len(next_tokens), device=self.device)

    def prefill(self, prompt: np.ndarray, features: TargetOutput | None) -> None:
        self.reset()
        if features is not None and features.taps is not None and len(prompt) > 1:
            self._set_pending(features.taps, prompt[1:], 0)

    def accept(self, tree: DraftTree, verdict: Verdict, features: TargetOutput | None) -> None:
        nxt = np.append(tree.tokens[verdict.path[1:]], verdict.bonus)
        self._set_pending(features.taps, nxt, self._root_pos)

    # ---------------------------------------------------------------- drafting
    def _first_block(self, root: int) -> tuple[torch.Tensor, int]:
        """Block 1: the pending context positions and K queries in one causal forward; the
        pending positions' keys/values join the cache."""
        net = self.net
        if self.pending is None:  # a one-token prompt: no target taps yet, start from the embedding
            zero = torch.zeros(1, net.cfg.hidden_size, device=self.device, dtype=self.dtype)
            g_prefix = net.g_from_drafter(zero, torch.tensor([root], device=self.device))
            prefix_pos, n_new = self._root_pos - 1, 0
            x, pos = net.queries(g_prefix[None]), torch.zeros(1, 1, 0, device=self.device, dtype=torch.long)
        else:
            g_prefix, prefix_pos, n_new = self.pending[-1:], int(self.pending_pos[-1]), self.pending.shape[0]
            x = torch.cat([self.pending[None, None], net.queries(g_prefix[None])], dim=-2)
            pos = self.pending_pos[None, None]
        pos_q = prefix_pos + torch.arange(1, net.cfg.K + 1, device=self.device)[None, None]
        self.cache = self._room(n_new + net.cfg.K, x)
        hq, _ = net.run_serving(x, torch.cat([pos, pos_q], dim=-1), self.cache, stage=True)
        self.cache = self.cache.commit(n_new)  # the new context positions' keys, staged first in the row
        self.pending = self.pending_pos = None
        return hq, prefix_pos

    def _room(self, rows: int, like: torch.Tensor) -> KVCache:
        """The cache, with room for ``rows`` more (a first block's new positions and queries)."""
        cfg = self.net.cfg
        if self.cache is None:
            return KVCache.empty(cfg.num_layers, cfg.num_heads, cfg.hidden_size // cfg.num_heads, like).reserve(rows)
        return self.cache.reserve(rows)

    def _seed_block(self, g_seed: torch.Tensor, seed_pos: torch.Tensor) -> torch.Tensor:
        """Later blocks: one row per seed, [seed position, K queries] causal over the cache."""
        net = self.net
        x = torch.cat([g_seed[None, :, None, :], net.queries(g_seed[None])], dim=-2)  # [1, S, 1+K, h]
        pos = seed_pos[None, :, None] + torch.arange(0, net.cfg.K + 1, device=self.device)
        hq, _ = net.run_serving(x, pos, self.cache)
        return hq

    def _candidates(self, hq: torch.Tensor):
        """Top-k ids and log-probs [S, K, k], predicted buckets [S, K] and the rank head's
        probabilities [S, K, 4], moved to host once."""
        k = self.net.cfg.top_k
        logp, rows, rank = self.net.serving_heads(hq[0], k)
        # Head rows to target ids (a reduced draft vocabulary): nothing outside it is ever drafted.
        return unpack_candidates(pack_candidates(logp, self.net.token_ids(rows), rank).cpu().numpy(), k)

    @torch.no_grad()
    def propose(self, req: DraftRequest) -> DraftTree:
        root = int(req.tokens[-1])
        self._root_pos = len(req.tokens) - 1
        tree = DraftTree.root_only(root)
        hq, prefix_pos = self._first_block(root)
        seeds = np.zeros(1, dtype=np.int64)
        block_base = torch.full((1,), prefix_pos, device=self.device)  # g position of each row
        cuts: list[tuple] = []
        offered: list[tuple] = []
        for m in range(self.M):
            ids, lps, buckets, bucket_prob = self._candidates(hq)
            spine = grow_block(tree, seeds, ids, lps, buckets, self.policy, req.budget, block=m, bucket_prob=bucket_prob)
            cuts.append(tree.meta["block_cuts"])
            # every position with a parent on the tree (seed, or the spine node above it): the whole
            # top-k, whatever the policy kept of it; traces log the target's rank among it (pool.py)
            par = np.concatenate([seeds[:, None], spine[:, :-1]], axis=1)
            r, d = np.nonzero(par >= 0)
            offered.append((par[r, d], ids[r, d], lps[r, d], np.full(r.size, m), d, buckets[r, d]))
            if m == self.M - 1 or tree.size - 1 >= req.budget:
                break
            nodes = tree.meta["block_nodes"]
            # Only leaves may seed: a node with a child in its own block already has a continuation.
            seeds = self.seed_policy.select(tree, nodes[tree.is_leaf[nodes]], self.max_seeds)
            if seeds.size == 0:
                break
            where = np.searchsorted(nodes, seeds)  # block_nodes is ascending (nodes are appended)
            rows = torch.as_tensor(tree.meta["block_rows"][where], device=self.device)
            pos = torch.as_tensor(tree.meta["block_pos"][where], device=self.device)
            h_seed = hq[0, rows, pos]  # the state that predicted each seed's token
            seed_pos = block_base[rows] + pos + 1
            g_seed = self.net.g_from_drafter(h_seed, torch.as_tensor(tree.tokens[seeds], device=self.device))
            hq = self._seed_block(g_seed, seed_pos)
            block_base = seed_pos
        cat = lambda i: np.concatenate([o[i] for o in offered])
        tree.meta["positions"] = {"node": cat(0), "ids": cat(1), "logp": cat(2), "block": cat(3), "pos": cat(4),
                                  "bucket": cat(5)}
        tree.meta["cuts"] = {  # where the rank head ended a branch (b3): the simulator fits on them
            "parent": np.concatenate([c[0] for c in cuts]).tolist(),
            "bucket": np.concatenate([c[1] for c in cuts]).tolist(),
            "block": sum(([c[2]] * len(c[0]) for c in cuts), []),
        }
        return tree
