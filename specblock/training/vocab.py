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


def pick_draft_vocab(args, source, vocab_size: int) -> np.ndarray:
    """The N most frequent tokens of the training data (answers only, from a feature cache)."""
    counts = vocab_counts(args, source, vocab_size)
    d2t = top_n(counts, args.draft_vocab)
    print(f"draft vocabulary: {args.draft_vocab} of {vocab_size} tokens cover "
          f"{100 * coverage(counts, d2t):.2f}% of the training tokens", flush=True)
    return d2t


def vocab_counts(args, source, vocab_size: int) -> np.ndarray:
    """Token frequencies behind ``--draft-vocab`` (``args``: features, vocab_corpus, target, window);
    also what ``experiments/vocab_sweep.py`` re-heads drafters with."""
    if args.features:
        counts = count_tokens(cache_answer_streams(source.cache), vocab_size)
        if args.vocab_corpus > 0:
            # A few hours of answers see a few thousand distinct tokens; the corpus of the same
            # domains fills in the ones they will hold (measured on held-out answers, N = 8192,
            # 33.6k answer tokens: 92.0% of tokens covered from answers alone, 95.5% mixed 50/50).
            from specblock.training.windows import WindowSource  # the lab corpus: only here

            lab = WindowSource("lab", args.target, args.window).train.values()
            corpus = count_tokens(lab, vocab_size)
            counts = (1 - args.vocab_corpus) * counts / max(counts.sum(), 1) + args.vocab_corpus * corpus / max(corpus.sum(), 1)
    else:
        counts = count_tokens(source.train.values(), vocab_size)
    return counts
