"""Training windows read from the feature cache instead of a target forward (``--features``).

A window is ``W`` consecutive positions of one shard's concatenated sequences, drawn uniformly
over all training tokens (shards weighted by size; ``own_share`` instead fixes the share of windows
from the target's own answers, the chatgen shards, against the reference ``ref_*`` shards); like the lab corpus' windows it may cross a
sequence boundary, where the target's features restart with the new sequence's own context.
Soft targets are the cached top-k renormalised (over the draft vocabulary when the drafter has
one), so no V-sized tensor is ever built. Held-out windows come from the chatgen held-out shards.
The hidden state handed to the step is the recipe's (``Recipe.cached``): the tap layers' for the
feature drafters (a ``TargetPass``), the target's top state for Medusa (a ``MedusaPass``).
"""

from __future__ import annotations

import numpy as np
import torch

from specblock.errors import SpecBlockError
from specblock.training.featcache import FeatureCache, as_tensor, is_reference
from specblock.training.medusa_step import MedusaPass
from specblock.training.specblock_step import TargetPass, to_draft_vocab
from specblock.training.sps_step import SpsTopkPass

#: Cached array -> the step input built around it (both: tokens, features, e_target, y_star, y_ok);
#: "tokens": no hidden state, the top-k as it is (SpS distils a whole small LM from it).
PASSES = {"taps": TargetPass, "top": MedusaPass, "tokens": SpsTopkPass}


def repeats(tokens: np.ndarray, n: int) -> np.ndarray:
    """``[B, W]`` bool: token i closes an n-gram (tokens i-n+1..i) that already occurred earlier in its row.

    A small target's greedy answers fall into loops: in the cached chatgen answers 36% of positions
    close a repeated 8-gram, against 3.6% in the first 48 answer tokens, the part a bench decodes."""
    b, w = tokens.shape
    out = np.zeros((b, w), dtype=bool)
    if w < n:
        return out
    grams = np.ascontiguousarray(np.lib.stride_tricks.sliding_window_view(tokens, n, axis=1))  # [B, W-n+1, n]
    for i in range(b):
        keys = grams[i].view(np.dtype((np.void, grams.dtype.itemsize * n)))[:, 0]
        _, first, inv = np.unique(keys, return_index=True, return_inverse=True)
        out[i, n - 1:] = first[inv.reshape(-1)] < np.arange(len(keys))
    return out


class CacheWindows:
    def __init__(self, cache: FeatureCache, window: int, seed: int = 0, feature: str = "taps",
                 own_share: float | None = None, skip_loops: int = 0) -> None:
        if feature not in PASSES:
            raise SpecBlockError(f"the feature cache holds no {feature!r} for training; use one of {', '.join(PASSES)}")
        if skip_loops and feature == "tokens":
            raise SpecBlockError("--skip-loops: SpS distils the cached top-k with no per-position mask; drop the flag")
        self.cache, self.window, self.feature, self.own_share = cache, window, feature, own_share
        self.skip_loops = skip_loops
        self.rng = np.random.default_rng(seed)
        self._open: dict = {}
        self._index()
        if not self.train or not self.held:
            raise SpecBlockError(f"feature cache {cache.root} needs a held-out shard and a training shard longer than "
                                 f"--window {self.window}; let featcache run longer or lower --window")

    def _index(self) -> None:
        cache, window = self.cache, self.window
        held = set(cache.manifest.get("heldout_shards", []))
        sizes = {n: cache.manifest["shards"][n]["tokens"] for n in cache.names}
        self.train = [n for n in cache.names if n not in held and sizes[n] > window]
        self.held = [n for n in cache.names if n in held and sizes[n] > window]
        self.sizes = np.array([sizes[n] for n in self.train], dtype=np.float64)
        self.p = self.sizes / max(self.sizes.sum(), 1.0)
        own = np.array([not is_reference(n) for n in self.train])
        if self.own_share is not None and own.any() and (~own).any():
            self.p = np.where(own, self.own_share * self.sizes / self.sizes[own].sum(),
                              (1 - self.own_share) * self.sizes / self.sizes[~own].sum())

    def refresh(self) -> int:
        """Take in training shards a running featcache finished since; the held-out set stays
        as it was (evaluations stay comparable). Returns how many shards joined."""
        before, held = len(self.train), self.held
        self.cache.reload()
        self._index()
        self.held = held
        return len(self.train) - before

    def _shard(self, name: str):
        if name not in self._open:
            self._open[name] = self.cache.shard(name)
        return self._open[name]

    def _passes(self, spans: list[tuple[str, int]], net, skip_loops: int = 0) -> TargetPass | MedusaPass | SpsTopkPass:
        w = self.window
        sh = [self._shard(n) for n, _ in spans]
        raw = np.stack([s.tokens[a:a + w] for s, (_, a) in zip(sh, spans)]).astype(np.int64)
        tokens = torch.from_numpy(raw)
        ids = torch.from_numpy(np.stack([s.topk_ids[a:a + w] for s, (_, a) in zip(sh, spans)]).astype(np.int64))
        probs = torch.from_numpy(np.stack([s.topk_logp[a:a + w] for s, (_, a) in zip(sh, spans)])).float().exp()
        if self.feature == "tokens":
            return SpsTopkPass(tokens, ids, probs)
        feats = torch.stack([as_tensor(getattr(s, self.feature)[a:a + w], s.bf16) for s, (_, a) in zip(sh, spans)]).float()
        with torch.no_grad():
            e_target, y_star, y_ok = to_draft_vocab(probs, ids, net.lm_head.weight, net.t2d())
        y_ok = None if net.cfg.draft_vocab is None else y_ok
        if skip_loops:  # position q's target is token q+1: off where that token closes a repeated n-gram
            loop = torch.from_numpy(repeats(raw, skip_loops))
            keep = torch.ones_like(loop)
            keep[:, :-1] = ~loop[:, 1:]
            y_ok = keep if y_ok is None else y_ok & keep
        return PASSES[self.feature](tokens, feats, e_target, y_star, y_ok)

    def batch(self, n: int, net) -> TargetPass | MedusaPass:
        picks = self.rng.choice(len(self.train), size=n, p=self.p)
        spans = [(self.train[i], int(self.rng.integers(0, int(self.sizes[i]) - self.window))) for i in picks]
        return self._passes(spans, net, self.skip_loops)  # held-out windows keep every position (comparable figures)

    def heldout(self, n: int, net) -> TargetPass | MedusaPass:
        """``n`` fixed, evenly spaced windows over the held-out shards (the same at every evaluation)."""
        spans = []
        for j in range(n):
            name = self.held[j % len(self.held)]
            size = self.cache.manifest["shards"][name]["tokens"]
            k = j // len(self.held)
            per = -(-n // len(self.held))
            spans.append((name, int((size - self.window - 1) * k / max(per - 1, 1))))
        return self._passes(spans, net)
