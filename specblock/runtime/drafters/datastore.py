"""A datastore of the target's own answers: what it tends to write after an n-gram (REST, He et
al. 2023, on a datastore the target wrote itself; our addition, the paper drafts from the network
alone).

Why: prompt lookup only finds what the prompt and the answer so far repeat; a short question
(the bench's qa) gives it nothing. The target's answers to the training instructions repeat its
own phrasing across answers, which a 1-layer drafter learns only in part. Teacher-forced on
the tune split's text, prompt lookup's 4-token chain accepts 0.68 drafts, and 0.99 fed by the
store where the prompt has no match; beside SpecBlock's own chain, 1.31 and 1.40
(``experiments/served_gap.py --lookup --datastore shipped``, docs/real_model.md, stop 76).

The store is one token stream (answers separated by -1) and, per n-gram length, the sorted
n-gram keys with the position after each: a lookup is a ``searchsorted`` and a majority vote
over at most ``CAP`` continuations, a few numpy calls whatever the store's size.
"""

from __future__ import annotations

import io
import zipfile
from functools import lru_cache
from pathlib import Path

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from specblock.atomic import write_atomic
from specblock.errors import SpecBlockError

#: Longest and shortest n-gram looked up; 1-grams match too often to say much.
MAX_NGRAM, MIN_NGRAM = 4, 2
#: Continuations voted on per lookup (the first in the stream's order).
CAP = 256
FORMAT = 1
#: Shipped datastores, one per target: ``<registry name>.npz`` and its ``.json`` (what went in).
SHIPPED = Path(__file__).resolve().parents[2] / "assets" / "datastores"


def resolve(spec: str, target: str) -> Path:
    """``shipped``: the target's own (its registry name, or its directory's name); else a path."""
    if spec != "shipped":
        return Path(spec)
    path = SHIPPED / f"{Path(target).name}.npz"
    if not path.is_file():
        have = ", ".join(sorted(p.stem for p in SHIPPED.glob("*.npz"))) or "none"
        raise SpecBlockError(f"no shipped datastore for {target!r} (shipped: {have}); build one with "
                             "python -m specblock.training datastore and pass its path")
    return path


def _keys(windows: np.ndarray, vocab: int) -> np.ndarray:
    """One int64 per row of token ids (``vocab ** n`` fits int64 for the vocabularies here)."""
    key = np.zeros(windows.shape[0], dtype=np.int64)
    for j in range(windows.shape[1]):
        key = key * vocab + windows[:, j]
    return key


class Datastore:
    """n-gram -> what followed it in the stream; ``chain`` is the drafting call."""

    def __init__(self, stream: np.ndarray, vocab: int, depth: int = 8) -> None:
        if vocab ** MAX_NGRAM >= 2 ** 63:
            raise SpecBlockError(f"a datastore keys {MAX_NGRAM}-grams in int64; a vocabulary of {vocab} is too large")
        self.stream = np.ascontiguousarray(stream, dtype=np.int64)
        self.vocab, self.depth = vocab, depth
        self._padded = np.concatenate([self.stream, np.full(depth, -1, dtype=np.int64)])  # a continuation never runs off
        self._index: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for n in range(MIN_NGRAM, MAX_NGRAM + 1):
            if self.stream.size < n:  # a store too small to hold one n-gram finds nothing
                self._index[n] = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
                continue
            win = sliding_window_view(self.stream, n)
            pos = np.flatnonzero((win >= 0).all(axis=1))  # no n-gram across two answers
            key = _keys(win[pos], vocab)
            order = np.argsort(key, kind="stable")  # stable: equal keys keep the stream's order
            self._index[n] = (key[order], pos[order] + n)

    @classmethod
    def from_sequences(cls, seqs: list[np.ndarray] | list[list[int]], vocab: int) -> "Datastore":
        parts = []
        for s in seqs:
            parts += [np.asarray(s, dtype=np.int64), np.array([-1], dtype=np.int64)]
        return cls(np.concatenate(parts) if parts else np.array([-1], dtype=np.int64), vocab)

    @property
    def tokens(self) -> int:
        return int((self.stream >= 0).sum())

    def chain(self, tokens: np.ndarray, depth: int) -> np.ndarray:
        """The majority continuation of the context's last n tokens (the longest n with one),
        up to ``depth`` tokens: at each depth the most frequent next token among the matches that
        agree so far (ties: the smallest id). Empty where nothing matches."""
        depth = min(depth, self.depth)
        if depth <= 0:
            return tokens[:0]
        for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
            if len(tokens) < n:
                continue
            keys, starts = self._index[n]
            k = _keys(np.asarray(tokens[-n:], dtype=np.int64)[None, :], self.vocab)[0]
            lo = int(np.searchsorted(keys, k))
            hi = int(np.searchsorted(keys, k, side="right"))
            if hi == lo:
                continue
            rows = self._padded[starts[lo : min(hi, lo + CAP)][:, None] + np.arange(depth)[None, :]]
            out = []
            for d in range(depth):
                col = rows[:, d]
                col = col[col >= 0]
                if col.size == 0:
                    break
                vals, counts = np.unique(col, return_counts=True)
                best = vals[int(counts.argmax())]
                out.append(best)
                rows = rows[rows[:, d] == best]
            if out:  # else every match ended an answer: a shorter n-gram may go on
                return np.asarray(out, dtype=np.int64)
        return tokens[:0]

    def save(self, path: Path) -> None:
        """The stream as uint16 where the vocabulary fits (the index is rebuilt on load, about 0.2 s)."""
        dtype = np.uint16 if self.vocab <= 65535 else np.int32
        body = np.where(self.stream < 0, np.iinfo(dtype).max, self.stream).astype(dtype)
        buf = io.BytesIO()
        np.savez_compressed(buf, stream=body, vocab=np.int64(self.vocab), format=np.int64(FORMAT))
        write_atomic(path, buf.getvalue())

    @classmethod
    def load(cls, path: Path) -> "Datastore":
        path = Path(path)
        if not path.is_file():
            raise SpecBlockError(f"no datastore at {path}; build one with python -m specblock.training datastore")
        try:
            with np.load(path) as z:
                body, vocab, fmt = z["stream"], int(z["vocab"]), int(z["format"])
        except (OSError, KeyError, ValueError, zipfile.BadZipFile) as e:
            raise SpecBlockError(f"{path} is not a datastore ({e}); build it again with python -m specblock.training datastore") from e
        if fmt != FORMAT:
            raise SpecBlockError(f"{path}: datastore format {fmt}, this version reads {FORMAT}; build it again")
        stream = body.astype(np.int64)
        stream[body == np.iinfo(body.dtype).max] = -1
        return cls(stream, vocab)


@lru_cache(maxsize=4)
def _load(path: Path) -> Datastore:
    return Datastore.load(path)


def open_datastore(spec: str, target: str, vocab: int) -> Datastore:
    """``resolve`` then load, once per path (a bench builds an engine per method and run; a lookup
    never changes the store), refusing a store built over another vocabulary than the target's."""
    path = resolve(spec, target).resolve()
    store = _load(path)
    if store.vocab != vocab:
        raise SpecBlockError(f"the datastore {path} was built for a vocabulary of {store.vocab} tokens, the target has "
                             f"{vocab}; build one from this target's answers (python -m specblock.training datastore)")
    return store
