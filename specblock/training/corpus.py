"""The four-domain training corpus of the lab target, with deterministic held-out splits.

Domains: ``code`` (Python standard library), ``math`` (GSM8K train, question plus worked
answer), ``chat`` (AlpacaEval instruction/response pairs in :func:`chat_prompt`'s template),
``prose`` (tinyshakespeare). Splits are by a stable hash of a document key (file path,
question, instruction id), never by Python's salted ``hash``, so every process agrees.

The same formatting functions (:func:`chat_prompt`, :func:`math_prompt`) build the evaluation
prompts in :mod:`specblock.prompts`, so the model sees at evaluation exactly the separators it
was trained on.
"""

from __future__ import annotations

import hashlib
import json
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from specblock.data import chat_prompt, data_file, data_root, math_prompt  # noqa: F401  (re-exported)

DOMAINS: tuple[str, ...] = ("code", "math", "chat", "prose")
SPLITS: tuple[str, ...] = ("train", "heldout")

# Share of training *tokens* per domain. The evaluation domains are code (HumanEval), math
# (GSM8K) and three chat-template ones (chat, qa, mtbench), so chat gets the largest share and
# prose, which no benchmark uses, the smallest (it is there for general English and is tiny:
# ~0.32M tokens, so a bigger share would mostly repeat it). Sampling by size would give code
# (~2.8M tokens) and chat (~3.5M) nearly everything and math (~1.0M) little. Over ~15M training
# tokens this is ~1.6 epochs of chat and code, ~3.2 of GSM8K and ~3.7 of Shakespeare.
MIX_WEIGHTS: dict[str, float] = {"code": 0.32, "math": 0.22, "chat": 0.38, "prose": 0.08}

HOLDOUT_FRACTION: dict[str, float] = {"code": 0.02, "math": 0.03, "chat": 0.03, "prose": 0.10}

# Standard-library paths that are not human-written code worth modelling (tests, generated
# tables, vendored data) or not the stdlib at all.
_CODE_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
                   "pydoc_data", "encodings", "ensurepip", "turtledemo", "unittest/test"}
_CODE_MAX_BYTES = 200_000


_CALC = re.compile(r"<<[^>]*>>")


def clean_gsm8k_answer(answer: str) -> str:
    """Drop GSM8K's calculator annotations ``<<48/2=24>>``: they are tool markup, not prose."""
    return _CALC.sub("", answer).strip()


def stable_fraction(key: str) -> float:
    """A uniform number in [0, 1) fixed by ``key`` across processes and machines."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def is_heldout(domain: str, key: str) -> bool:
    """Whether the document with this key belongs to the held-out split of ``domain``."""
    return stable_fraction(f"{domain}:{key}") < HOLDOUT_FRACTION[domain]


def _check(domain: str, split: str) -> None:
    if domain not in DOMAINS:
        raise ValueError(f"unknown corpus domain {domain!r}; expected one of {DOMAINS}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")


def _read_jsonl(path: Path) -> Iterator[dict]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def stdlib_files() -> list[Path]:
    """Human-written stdlib ``*.py`` files, sorted so the order is stable."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        parts = set(rel.split("/")[:-1])
        if parts & _CODE_SKIP_DIRS or "/test/" in f"/{rel}" or rel.startswith("lib2to3/tests"):
            continue
        if any(p.startswith("test_") for p in rel.split("/")) or path.stat().st_size > _CODE_MAX_BYTES:
            continue
        out.append(path)
    return out


def _code_docs(split: str) -> Iterator[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in stdlib_files():
        rel = path.relative_to(root).as_posix()
        if is_heldout("code", rel) != (split == "heldout"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            yield text


def _math_docs(split: str) -> Iterator[str]:
    for row in _read_jsonl(data_file("gsm8k", "train.jsonl")):
        if is_heldout("math", row["question"]) == (split == "heldout"):
            yield math_prompt(row["question"]) + clean_gsm8k_answer(row["answer"])


def _chat_docs(split: str) -> Iterator[str]:
    # Split by instruction id: each instruction has 11 model responses, and a held-out
    # instruction must not leak through another model's answer to it.
    for row in _read_jsonl(data_file("alpaca_eval", "train.jsonl")):
        if is_heldout("chat", str(row["id"])) == (split == "heldout"):
            yield chat_prompt(row["instruction"]) + row["output"].strip()


def _prose_docs(split: str, chunk_chars: int = 4000) -> Iterator[str]:
    # The first 90% trains, the tail is held out (a contiguous slice, as the issue asks),
    # cut at a blank line; chunks end at blank lines so documents are whole speeches.
    text = data_file("tinyshakespeare", "input.txt").read_text(encoding="utf-8")
    cut = text.find("\n\n", int(len(text) * (1 - HOLDOUT_FRACTION["prose"])))
    part = text[:cut] if split == "train" else text[cut:].lstrip("\n")
    start = 0
    while start < len(part):
        end = part.find("\n\n", start + chunk_chars)
        end = len(part) if end < 0 else end
        chunk = part[start:end].strip("\n")
        if chunk:
            yield chunk
        start = end + 2


_READERS = {"code": _code_docs, "math": _math_docs, "chat": _chat_docs, "prose": _prose_docs}


def iter_documents(domain: str, split: str = "train") -> Iterator[str]:
    """Documents of one domain and split, in a fixed order (no BOS/EOS: the tokenizer adds them)."""
    _check(domain, split)
    return _READERS[domain](split)


def document_count(domain: str, split: str = "train") -> int:
    """Number of documents (cheap except for code, which reads every file)."""
    return sum(1 for _ in iter_documents(domain, split))
