"""Medusa-1 (Cai et al. 2024): K residual heads on the frozen target's top hidden state.

Head i reads the target's final (post-norm) hidden state at the last committed position,
``s_i = x + SiLU(W_i x + b_i)`` (W_i zero-initialised, so an untrained head starts as the
target's own next-token head), and the LM head turns ``s_i`` into a distribution over the token
i+1 places after the root (x_{t+2+i} for the state at position t). All heads run in one
forward; positions are predicted independently of each other.

Tree. Medusa's static tree: node = a path of per-head ranks (r_1, .., r_d); depth d takes head
d-1's rank-r_d candidate whatever its parent's token. The tree is chosen once per budget by
best-first search over paths (``policies.static_tree``, shared with the simulator), scoring a
path by the product of calibrated per-(head, rank) accuracies, which Medusa measures on
held-out data; ``rank_acc`` in the config holds them (the trainer writes them at export).
Verification is the project's lossless one, never Medusa's "typical acceptance".

Choices: the LM head is the target's, frozen and shared by all heads (Medusa-1 gives each head a
trainable copy, initialised from it), optionally cut to a draft vocabulary (``draftvocab.py``); without calibration the prior accuracy of (head i, rank r)
is ``0.6 * 0.8**i * 0.5**r`` (our placeholder, so an untrained drafter still builds a sensible
tree); the first token of a one-token prompt gets no draft (no target state yet).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from specblock.policies.static_tree import static_tree
from specblock.policies.tree import NO_BUCKET, DraftTree
from specblock.runtime.drafters.base import DraftRequest, Drafter
from specblock.runtime.drafters.draftvocab import DraftVocab, DraftVocabSize
from specblock.runtime.drafters.netio import load_net, save_net, tie_frozen
from specblock.runtime.target import TargetModel, TargetOutput
from specblock.runtime.verify import Verdict

FROZEN = ("lm_head.weight",)


class MedusaConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    heads: int = Field(4, ge=1)
    top_k: int = Field(10, ge=1)  # candidates per head the static tree may use
    rank_acc: list[list[float]] | None = None  # [heads, top_k] calibrated accuracy of each (head, rank)
    draft_vocab: DraftVocabSize = None  # LM-head rows (a token outside them is never drafted); None = all

    def accuracy_table(self) -> np.ndarray:
        if self.rank_acc is not None:
            acc = np.asarray(self.rank_acc, dtype=np.float64)
            if acc.shape == (self.heads, self.top_k):
                return np.clip(acc, 1e-6, 1.0)
        return 0.6 * 0.8 ** np.arange(self.heads)[:, None] * 0.5 ** np.arange(self.top_k)[None, :]


class MedusaNet(DraftVocab, nn.Module):
    def __init__(self, cfg: MedusaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.res = nn.ModuleList(nn.Linear(h, h) for _ in range(cfg.heads))
        with torch.no_grad():
            for lin in self.res:
                lin.weight.zero_()
        self.lm_head = self.draft_head(h)

    def states(self, top: torch.Tensor) -> torch.Tensor:
        """[..., h] -> [..., heads, h]."""
        return torch.stack([top + F.silu(lin(top)) for lin in self.res], dim=-2)

    def logits(self, top: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.states(top)).float()

    def save(self, path: str | Path) -> None:
        save_net(self, self.cfg, "medusa", path, FROZEN)

    @classmethod
    def load(cls, path: str | Path, target_model) -> "MedusaNet":
        return load_net(cls, MedusaConfig, path, "medusa", "Medusa", target_model, FROZEN)

    def tie_to_target(self, target_model) -> None:
        tie_frozen(self, target_model, FROZEN)


class MedusaDrafter(Drafter):
    name = "medusa"
    needs_features = True

    def __init__(self, net: MedusaNet) -> None:
        self.net = net.eval()
        self.acc = net.cfg.accuracy_table()
        self._trees: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self.reset()

    @classmethod
    def load(cls, path: str | Path, target: TargetModel) -> "MedusaDrafter":
        net = MedusaNet.load(path, target.model)
        return cls(net.to(device=target.device, dtype=target.drafter_dtype))

    def reset(self) -> None:
        self.top: torch.Tensor | None = None  # [1, h] target's top state at the root's parent

    def prefill(self, prompt: np.ndarray, features: TargetOutput | None) -> None:
        self.reset()
        if features is not None and features.top is not None and len(prompt) > 1:
            self.top = features.top[-1:]

    def accept(self, tree: DraftTree, verdict: Verdict, features: TargetOutput | None) -> None:
        self.top = features.top[-1:]  # the last accepted node: the bonus token was predicted there

    def tree_sizes(self, budget: int) -> tuple[int, ...]:
        """One static tree a budget (``tree_shape``): one size."""
        return (self.tree_shape(budget)[0].size,) if budget >= 1 else (1,)

    def tree_shape(self, budget: int):
        if budget not in self._trees:
            self._trees[budget] = static_tree(self.acc, budget)
        return self._trees[budget]

    def _candidates(self, top: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """Each head's ``top_k`` target ids and log-probs ``[heads, top_k]`` from the state ``[1, h]``
        (``compiled/medusa.py`` runs this as one compiled graph)."""
        return self.net.top_tokens(self.net.logits(top.to(self.net.lm_head.weight.dtype))[0], self.net.cfg.top_k)

    @torch.no_grad()
    def propose(self, req: DraftRequest) -> DraftTree:
        root = int(req.tokens[-1])
        if self.top is None or req.budget < 1 or req.max_depth < 1:
            return DraftTree.root_only(root)
        ids, lps = self._candidates(self.top)
        parent, depth, rank = self.tree_shape(req.budget)
        head = np.maximum(depth - 1, 0)
        r = np.maximum(rank, 0)
        tokens = np.where(depth > 0, ids[head, r], root)
        logprob = np.where(depth > 0, lps[head, r], 0.0).astype(np.float32)
        n = parent.size
        return DraftTree(tokens=tokens, parent=parent.copy(), depth=depth.copy(), logprob=logprob, rank=rank.copy(),
                         bucket=np.full(n, NO_BUCKET, np.int64), block=np.where(depth > 0, 0, -1))
