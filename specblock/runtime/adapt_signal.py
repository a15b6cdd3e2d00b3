"""The free training signal of serving-time adaptation (issue 6), and its teacher-forcing view.

What verification already computed, kept per query: committed tokens, the target's taps at every
committed position and its top-k log-probs at every generated one, plus the error signal ``s``.
:meth:`QueryRecord.sample` turns that into the tensors that teacher-force the drafter's first
block; :func:`block1_rows` runs that block only at the rows that have labels. Split out of
``adapt.py`` so the adapter there is only the serving/training machinery.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from specblock.runtime.drafters.specblock_net import SpecBlockNet

_uids = itertools.count()


class QueryRecord:
    """One query's signal. Chunks are appended whole by the serving thread (one atomic list
    append), so the worker can copy the list at any time and see a consistent prefix."""

    def __init__(self, prompt: np.ndarray, taps: torch.Tensor | None) -> None:
        self.uid = next(_uids)
        self.label_start = len(prompt) - 1  # first position with the target's distribution
        # chunks: (tokens, taps, top-k ids, top-k log-probs, s) per iteration, the prompt first
        self.chunks: list[tuple] = [(np.asarray(prompt, dtype=np.int64), taps, None, None, 0.0)]

    @property
    def s(self) -> float:
        return float(sum(c[4] for c in list(self.chunks)))

    def tokens_and_taps(self) -> tuple[np.ndarray, torch.Tensor | None]:
        ch = list(self.chunks)
        taps = [c[1] for c in ch if c[1] is not None]
        return np.concatenate([c[0] for c in ch]), torch.cat(taps) if taps else None

    def sample(self, K: int, max_ctx: int) -> "Sample | None":
        """Frozen tensors for teacher forcing block 1 at every generated position (None: no label yet)."""
        ch = list(self.chunks)
        if len(ch) < 2:
            return None
        tokens = np.concatenate([c[0] for c in ch])
        taps = torch.cat([c[1] for c in ch if c[1] is not None])
        ids, lps = torch.cat([c[2] for c in ch[1:]]), torch.cat([c[3] for c in ch[1:]])
        n = len(tokens)  # taps: positions 0..n-2; labels: label_start..n-2
        a = max(0, n - max_ctx)
        first = max(self.label_start - 1, a)  # block at p predicts p+1..p+K from labels at p+1..
        if first > n - 3:
            return None
        rows = torch.arange(first, n - 2)  # absolute block positions
        at = rows[:, None] + torch.arange(1, K + 1)  # label position of depth k
        valid = at <= n - 2
        li = (at - self.label_start).clamp(0, ids.shape[0] - 1)
        return Sample(self.uid, n, torch.as_tensor(tokens[a:])[None], taps[a:].float()[None], rows - a,
                      ids[li].long(), lps[li].float(), valid)


@dataclass
class Sample:
    uid: int
    n: int
    tokens: torch.Tensor  # [1, W]
    taps: torch.Tensor  # [1, W-1, n_taps*h]
    rows: torch.Tensor  # [R] block positions (window-relative)
    y_ids: torch.Tensor  # [R, K, top_k] the target's top-k ids at each depth's label
    y_lp: torch.Tensor  # [R, K, top_k] their log-probs
    valid: torch.Tensor  # [R, K] a label exists


def block1_rows(net: SpecBlockNet, taps: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``training.first_block`` restricted to the block rows ``rows``: the context stream runs
    over every position, the query stream only where there are labels. Returns ``[R, K, h]``."""
    r, dev = tokens.shape[1] - 1, tokens.device
    p = torch.arange(r, device=dev)
    rows = rows.to(dev)
    g = net.g_from_target(taps[:, :r].to(net.fuse_taps.weight.dtype), tokens[:, 1:])
    pos_q = (rows[:, None] + torch.arange(1, net.cfg.K + 1, device=dev))[None]
    visible = (p[None, :] <= rows[:, None])[None]  # block p sees context <= p
    hq, _ = net.run(g[:, None], p[None, None], net.queries(g[:, rows]), pos_q, None, None, visible)
    return hq[0]
