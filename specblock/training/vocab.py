"""Draft vocabulary: the N target tokens a drafter's LM head keeps (EAGLE-3's ``d2t`` / ``t2d``).

The tied head of a small chat model is a large share of its cost (SmolLM2-135M: 49,152 x 576,
about a fifth of the target per token), and SpecBlock evaluates it K x M times per step. Most of
those rows are tokens the target almost never writes, so the head keeps the N most frequent
tokens of the training data (the target's own answers when the data is self-generated); a token
outside them is never drafted, which costs acceptance only where the target writes a rare token.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from specblock.errors import SpecBlockError


def count_tokens(streams: Iterable[np.ndarray], vocab_size: int) -> np.ndarray:
    """Occurrences of every token id over the given id arrays."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for s in streams:
        counts += np.bincount(np.asarray(s, dtype=np.int64), minlength=vocab_size)[:vocab_size]
    return counts


def cache_answer_streams(cache) -> Iterable[np.ndarray]:
    """The answer tokens of a feature cache's training shards (prompts are the user's text, not
    what the drafter will be asked to draft)."""
    held = set(cache.manifest.get("heldout_shards", []))
    for name in cache.names:
        if name in held:
            continue
        sh = cache.shard(name)
        for i in range(len(sh.prompt_lens)):
            yield sh.tokens[int(sh.offsets[i]) + int(sh.prompt_lens[i]):int(sh.offsets[i + 1])]


def top_n(counts: np.ndarray, n: int) -> np.ndarray:
    """The ``n`` most frequent ids, ascending (ties broken by the smaller id, so it is deterministic)."""
    if not 0 < n <= counts.size:
        raise SpecBlockError(f"--draft-vocab must lie in 1..{counts.size} (the target's vocabulary), got {n}")
    order = np.lexsort((np.arange(counts.size), -counts))  # by count descending, then id
    return np.sort(order[:n]).astype(np.int64)


def coverage(counts: np.ndarray, d2t: np.ndarray) -> float:
    """Share of the counted tokens that the draft vocabulary holds."""
    return float(counts[d2t].sum() / max(int(counts.sum()), 1))
