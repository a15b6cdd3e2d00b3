"""SpS (Leviathan et al. 2023; Chen et al. 2023): a small causal LM drafts for the target.

The draft model is a plain HF ``LlamaForCausalLM`` with the target's vocabulary (1-2 layers,
trained by distillation from the target, ``training/sps_step.py``), saved as an ordinary HF model
directory, so HF's own ``generate(assistant_model=...)`` can use the same file.

Drafting. The draft model keeps its own KV cache of committed tokens. Each ``propose`` first
feeds the committed tokens it has not seen (the previous iteration's accepted tokens and the new
root) in one forward, then drafts: by default a chain of ``gamma`` greedy tokens (``top_k = 1``,
the classic method; ``gamma - 1`` more one-token forwards). The tree option (``top_k > 1``)
grows an EAGLE-2-style tree with the small model: every depth expands the ``top_k`` best nodes
by cumulative log-prob in one forward under a tree mask (float additive 4D mask, explicit
positions, as for the target), then the tree is reranked to the budget. Drafted positions are
cut from the cache after every proposal (accepted ones are fed again next time, in one batched
forward), so the cache never holds a rejected token.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedModel

from specblock.errors import SpecBlockError
from specblock.policies.branching import DynamicBranching, TreePolicy, expand, rerank_limits
from specblock.policies.seeds import SeedPolicy, TopScoreSeeds
from specblock.policies.tree import DraftTree
from specblock.runtime.attention import attention_layout
from specblock.runtime.drafters.base import DraftRequest, Drafter
from specblock.runtime.target import DTYPES, TargetModel, load_causal_lm


class SpsDrafter(Drafter):
    name = "sps"
    needs_features = False

    def __init__(
        self,
        model: PreTrainedModel,
        gamma: int = 4,
        top_k: int = 1,
        policy: TreePolicy | None = None,
        seeds: SeedPolicy | None = None,
    ) -> None:
        if gamma < 1 or top_k < 1:
            raise SpecBlockError("sps needs gamma >= 1 and top_k >= 1")
        self.model = model.eval()
        self.gamma, self.top_k = gamma, top_k
        self.policy = policy or DynamicBranching(top_k=top_k)
        self.seed_policy = seeds or TopScoreSeeds()
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self._min = torch.finfo(self.dtype).min
        self.layout = attention_layout(model)
        self.reset()

    @classmethod
    def load(cls, path: str | Path, target: TargetModel, **kw) -> "SpsDrafter":
        dtype = {v: k for k, v in DTYPES.items()}[target.dtype]
        model = load_causal_lm(path, dtype, str(target.device), "sdpa", False)
        if int(model.config.vocab_size) != target.vocab_size:
            raise SpecBlockError(
                f"SpS draft model at {path} has vocab {model.config.vocab_size}, the target has {target.vocab_size}; "
                "train a draft model for this target"
            )
        return cls(model, **kw)

    def reset(self) -> None:
        # A draft model with sliding-window layers keeps every key too (runtime/attention.py): its
        # window layers would otherwise drop keys that _crop assumes are there. Its tree masks
        # then let drafted nodes see past the window: only the proposals differ, never the output.
        self.cache = self.layout.new_cache(self.model.config)
        self.n_cached = 0  # committed tokens whose keys/values the draft cache holds

    def prefill(self, prompt: np.ndarray, features) -> None:
        self.reset()  # the prompt is fed on the first propose, with everything else not yet seen

    def _crop(self, n: int) -> None:
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys = layer.keys[..., :n, :]
                layer.values = layer.values[..., :n, :]

    def _top(self, logits: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        top = torch.log_softmax(logits.float(), -1).topk(self.top_k, dim=-1)
        return top.indices.cpu().numpy(), top.values.cpu().numpy()

    @torch.no_grad()
    def propose(self, req: DraftRequest) -> DraftTree:
        tokens = req.tokens
        root_pos = len(tokens) - 1
        tree = DraftTree.root_only(int(tokens[-1]))
        logits = self._feed(tokens)  # [1, V]: the root's children
        self.n_cached = len(tokens)
        depth = min(self.gamma, req.max_depth)
        if depth < 1 or req.budget < 1:
            return tree
        # Nothing past what the final rerank to the budget can keep (policies.branching)
        depth, width = rerank_limits(self.policy, self.seed_policy, req.budget, depth, self.top_k)
        parents = np.zeros(1, dtype=np.int64)
        expanded = np.zeros(0, dtype=np.int64)  # drafted nodes in the cache, in cache order
        for d in range(1, depth + 1):
            ids, lps = self._top(logits)
            new = expand(tree, parents, ids[:, :width], lps[:, :width], self.policy, req.budget, block=d - 1)
            if d == depth:
                break
            frontier = np.sort(self.seed_policy.select(tree, new[new >= 0], width))
            if frontier.size == 0:
                break
            logits = self._draft_forward(tree, frontier, expanded, root_pos + d)
            expanded = np.concatenate([expanded, frontier])
            parents = frontier
        self._crop(self.n_cached)
        return self.policy.prune(tree, req.budget)

    def _feed(self, tokens: np.ndarray) -> torch.Tensor:
        """The committed tokens the cache has not seen, in one forward; the last one's logits ``[1, V]``."""
        new_ids = torch.as_tensor(tokens[self.n_cached :], device=self.device)[None]
        pos = torch.arange(self.n_cached, len(tokens), device=self.device)[None]
        out = self.model(input_ids=new_ids, position_ids=pos, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1:]

    def _draft_forward(self, tree: DraftTree, frontier: np.ndarray, expanded: np.ndarray, pos: int) -> torch.Tensor:
        """The frontier's nodes at position ``pos``, each over the committed cache, its drafted
        ancestors (``expanded``, in cache order) and itself; their logits ``[S, V]``."""
        s = frontier.size
        anc = np.concatenate([tree.ancestor_mask[np.ix_(frontier, expanded)], np.eye(s, dtype=bool)], axis=1)
        mask = torch.zeros((1, 1, s, self.n_cached + anc.shape[1]), dtype=self.dtype, device=self.device)
        mask[0, 0, :, self.n_cached :].masked_fill_(~torch.as_tensor(anc, device=self.device), self._min)
        x = torch.as_tensor(tree.tokens[frontier], device=self.device)[None]
        return self.model(input_ids=x, position_ids=torch.full((1, s), pos, device=self.device), attention_mask=mask,
                          past_key_values=self.cache, use_cache=True).logits[0]
