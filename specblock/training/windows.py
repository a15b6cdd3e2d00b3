"""Token windows for drafter training, tokenized with the *target's* tokenizer and cached.

``lab``: the four-domain corpus of the small target, mixed by ``MIX_WEIGHTS``. Otherwise a JSONL
file with a ``text`` field per line. Token streams are cached as uint16/uint32 memmaps under
``runs/cache/<tokenizer digest>/`` so restarts skip tokenization.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from specblock.errors import SpecBlockError
from specblock.flags import bad_text
from specblock.training.corpus import DOMAINS, MIX_WEIGHTS, iter_documents

CACHE_ROOT = Path(os.environ.get("SPECBLOCK_CACHE", "runs/cache"))


def _digest(target_dir: Path) -> str:
    f = Path(target_dir) / "tokenizer.json"
    if not f.is_file():
        raise SpecBlockError(f"{target_dir} has no tokenizer.json; drafter training tokenizes with the target's tokenizer")
    return hashlib.sha256(f.read_bytes()).hexdigest()[:16]


def _tokenize_to(path: Path, texts, target_dir: Path) -> np.memmap:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    eos = tok.eos_token_id
    dtype = np.uint16 if len(tok) <= 65535 else np.uint32
    ids: list[int] = []
    for t in texts:
        ids.extend(tok(t)["input_ids"])
        if eos is not None:
            ids.append(eos)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # DDP ranks may tokenize at once: no shared tmp name
    np.asarray(ids, dtype=dtype).tofile(tmp)
    os.replace(tmp, path)
    return np.memmap(path, dtype=dtype, mode="r")


def _stream(name: str, texts_fn, target_dir: Path) -> np.ndarray:
    base = CACHE_ROOT / _digest(target_dir)
    for dtype in (np.uint16, np.uint32):
        p = base / f"{name}.{np.dtype(dtype).name}"
        if p.is_file():
            return np.memmap(p, dtype=dtype, mode="r")
    from transformers import AutoTokenizer

    dtype = np.uint16 if len(AutoTokenizer.from_pretrained(target_dir)) <= 65535 else np.uint32
    return _tokenize_to(base / f"{name}.{np.dtype(dtype).name}", texts_fn(), target_dir)


def read_texts(path: Path) -> list[str]:
    """The ``text`` of every line of a JSONL file; a line that has none is one error naming it."""
    texts = []
    for i, raw in enumerate(path.read_bytes().splitlines(), 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise SpecBlockError(f"{path}:{i}: byte {e.start + 1} is not UTF-8; save the file as UTF-8") from None
        except ValueError as e:
            raise SpecBlockError(f"{path}:{i}: not valid JSON ({e}); each line must be an object with a 'text'") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise SpecBlockError(f"{path}:{i}: each line needs a string field 'text'")
        if why := bad_text(obj["text"]):
            raise SpecBlockError(f"{path}:{i}: {why}")
        texts.append(obj["text"])
    if not texts:
        raise SpecBlockError(f"{path} holds no lines with a 'text'")
    return texts


class WindowSource:
    def __init__(self, data: str, target_dir: Path, window: int, seed: int = 0) -> None:
        self.window = window
        self.rng = np.random.default_rng(seed)
        if data == "lab":
            self.train = {d: _stream(f"{d}.train", lambda d=d: iter_documents(d, "train"), target_dir) for d in DOMAINS}
            self.held = {d: _stream(f"{d}.heldout", lambda d=d: iter_documents(d, "heldout"), target_dir) for d in DOMAINS}
            self.weights = {d: MIX_WEIGHTS[d] for d in DOMAINS}
        else:
            path = Path(data)
            if not path.is_file():
                raise SpecBlockError(f"no data file at {path}; pass --data lab or a JSONL file with a 'text' field")
            texts = read_texts(path)
            cut = max(1, len(texts) // 50)
            key = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
            self.train = {"data": _stream(f"{key}.train", lambda: texts[cut:], target_dir)}
            self.held = {"data": _stream(f"{key}.heldout", lambda: texts[:cut], target_dir)}
            self.weights = {"data": 1.0}
        for name, s in {**self.train, **self.held}.items():
            if s.size <= window:
                raise SpecBlockError(f"the {name} stream has {s.size} tokens, fewer than one window of {window}")

    def batch(self, n: int) -> torch.Tensor:
        names = list(self.weights)
        w = np.array([self.weights[k] for k in names])
        rows = []
        for k in self.rng.choice(len(names), size=n, p=w / w.sum()):
            s = self.train[names[k]]
            a = int(self.rng.integers(0, s.size - self.window))
            rows.append(np.asarray(s[a : a + self.window], dtype=np.int64))
        return torch.from_numpy(np.stack(rows))

    def heldout(self, per_stream: int) -> torch.Tensor:
        """Fixed, evenly spaced held-out windows (the same at every evaluation)."""
        rows = []
        for s in self.held.values():
            for a in np.linspace(0, s.size - self.window - 1, per_stream).astype(np.int64):
                rows.append(np.asarray(s[a : a + self.window], dtype=np.int64))
        return torch.from_numpy(np.stack(rows))
