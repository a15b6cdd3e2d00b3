"""Reduced draft vocabulary (EAGLE-3's ``d2t``), shared by the SpecBlock, EAGLE-3 and Medusa nets.

A drafter's LM head may keep only N rows: the N most frequent target tokens (``training/vocab.py``
picks them). The rows are the target's own head rows ``W[d2t]`` (frozen, copied at load time, never
saved); ``d2t`` (head row -> target id) is saved with the weights when the head is reduced and is
the identity otherwise (not saved, so full-vocabulary drafters keep their files). A drafted head
row goes back to a target id through ``d2t``: a token outside the map is never drafted, and the
target's verification keeps the output lossless whatever the map holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import torch
from pydantic import Field
from torch import nn

from specblock.errors import SpecBlockError

#: The config field: head rows, None = the target's whole vocabulary.
DraftVocabSize = Annotated[int | None, Field(gt=0)]


def read_d2t(path: str | Path, n: int, vocab: int, label: str) -> torch.Tensor:
    """The saved draft-vocabulary map, checked before the head rows are gathered with it."""
    from safetensors import safe_open

    f = Path(path) / "model.safetensors"
    try:
        with safe_open(str(f), "pt") as fh:
            d2t = fh.get_tensor("d2t").long()
    except Exception as e:  # noqa: BLE001 - missing key, truncated file
        raise SpecBlockError(f"cannot read the draft vocabulary (d2t) from {f} ({type(e).__name__}); re-export the {label} drafter") from None
    if d2t.shape != (n,) or int(d2t.min()) < 0 or int(d2t.max()) >= vocab:
        raise SpecBlockError(f"{f}: d2t does not fit draft_vocab {n} / vocab {vocab}; re-export the {label} drafter")
    return d2t


class DraftVocab:
    """Mixin over an ``nn.Module`` whose ``cfg`` has ``vocab_size``, ``draft_vocab`` and ``top_k``;
    the module builds its head with :meth:`draft_head` and names it ``lm_head``."""

    def draft_head(self, hidden: int) -> nn.Linear:
        """The LM head over the draft vocabulary, and the ``d2t`` buffer (persistent only when reduced)."""
        cfg = self.cfg
        n = cfg.draft_vocab or cfg.vocab_size
        if n > cfg.vocab_size or n < cfg.top_k:
            raise SpecBlockError(f"draft_vocab {n} must lie between top_k {cfg.top_k} and the vocabulary {cfg.vocab_size}")
        self.register_buffer("d2t", torch.arange(n), persistent=cfg.draft_vocab is not None)
        return nn.Linear(hidden, n, bias=False)

    def set_vocab(self, d2t: torch.Tensor) -> None:
        """Head rows for these target ids (distinct, ascending); call before ``tie_to_target``."""
        d2t = torch.as_tensor(d2t, dtype=torch.long)
        if d2t.shape != self.d2t.shape or d2t.unique().numel() != d2t.numel() or int(d2t.max()) >= self.cfg.vocab_size:
            raise SpecBlockError(f"a draft vocabulary needs {self.d2t.numel()} distinct ids below {self.cfg.vocab_size}")
        self.d2t.copy_(d2t)

    def t2d(self) -> torch.Tensor:
        """Target id -> head row, -1 outside the draft vocabulary."""
        out = torch.full((self.cfg.vocab_size,), -1, dtype=torch.long, device=self.d2t.device)
        out[self.d2t] = torch.arange(self.d2t.numel(), device=self.d2t.device)
        return out

    def top_tokens(self, logits: torch.Tensor, k: int) -> tuple:
        """The ``k`` best head rows of ``logits [..., rows]`` as target token ids and log-probs, on the
        host (numpy): what a drafter hands to its tree policy."""
        top = torch.log_softmax(logits.float(), -1).topk(min(k, logits.shape[-1]), dim=-1)
        return self.token_ids(top.indices).cpu().numpy(), top.values.cpu().numpy()

    def token_ids(self, rows: torch.Tensor) -> torch.Tensor:
        """Head rows (e.g. a top-k's indices) -> target token ids."""
        return rows if self.cfg.draft_vocab is None else self.d2t[rows]

    def head_rows(self, target_head: torch.Tensor) -> torch.Tensor:
        """The target's LM-head weight restricted to the draft vocabulary (``W[d2t]``)."""
        return target_head if self.cfg.draft_vocab is None else target_head[self.d2t.to(target_head.device)]

    def load_vocab(self, path: str | Path, label: str) -> None:
        """Read a reduced head's map from a saved drafter (before the head rows are gathered)."""
        if self.cfg.draft_vocab is not None:
            self.d2t.copy_(read_d2t(path, self.cfg.draft_vocab, self.cfg.vocab_size, label))
