"""The five evaluation prompt sets every benchmark in the project uses.

Domains mirror the paper's benchmarks: ``code`` (HumanEval), ``math`` (GSM8K test), ``chat``
(AlpacaEval instructions never trained on), ``qa`` (Spec-Bench natural questions: a domain the
target never trained on) and ``mtbench`` (Spec-Bench MT-Bench first turns).

Each prompt carries two renderings of the same question. ``text`` is the lab model's plain-text
format (the functions that built its corpus, so it continues in-domain); ``instruction`` is the
user message for a model with a chat template (code prompts framed by ``data.code_instruction``).
``runtime.chat.encode_prompt`` picks by the tokenizer, so every method of a run decodes the same ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specblock.data import chat_prompt, code_instruction, data_file, math_prompt

DOMAINS: tuple[str, ...] = ("code", "math", "chat", "qa", "mtbench")

# Spec-Bench stores MT-Bench's 80 questions under their 8 MT-Bench categories (no category is
# literally "mt_bench"); its other categories are qa, math_reasoning and summarization.
MTBENCH_CATEGORIES = frozenset(
    {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"})


@dataclass(frozen=True)
class Prompt:
    """One evaluation prompt: a stable id, its domain, the lab model's text and a chat model's message."""

    id: str
    domain: str
    text: str
    instruction: str


def _rows(*parts: str) -> list[dict]:
    path: Path = data_file(*parts)
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _code() -> list[Prompt]:
    return [Prompt(r["task_id"], "code", r["prompt"], code_instruction(r["prompt"]))
            for r in _rows("humaneval", "HumanEval.jsonl")]


def _math() -> list[Prompt]:
    return [Prompt(f"gsm8k/test/{i}", "math", math_prompt(r["question"]), r["question"].strip())
            for i, r in enumerate(_rows("gsm8k", "test.jsonl"))]


def _chat() -> list[Prompt]:
    return [Prompt(f"alpaca_eval/{r['id']}", "chat", chat_prompt(r["instruction"]), r["instruction"].strip())
            for r in _rows("alpaca_eval", "eval_prompts.jsonl")]


def _spec_bench(domain: str, keep) -> list[Prompt]:
    return [Prompt(f"spec_bench/{r['question_id']}", domain, chat_prompt(r["turns"][0]), r["turns"][0].strip())
            for r in _rows("spec_bench", "question.jsonl") if keep(r["category"])]


_LOADERS = {
    "code": _code,
    "math": _math,
    "chat": _chat,
    "qa": lambda: _spec_bench("qa", lambda c: c == "qa"),
    "mtbench": lambda: _spec_bench("mtbench", lambda c: c in MTBENCH_CATEGORIES),
}


#: ``split="tune"``: the last this many prompts of each set, for choosing settings (``runtime tune``)
#: on prompts the bench's tables do not report. The bench reads a set's first N (10 at most in the
#: committed tables), so the two stay apart up to N = 47 (chat's 55 - 8).
TUNE_PROMPTS = 8
SPLITS: tuple[str, ...] = ("eval", "tune")


def load_prompts(domain: str, n: int | None = None, split: str = "eval") -> list[Prompt]:
    """The first ``n`` prompts (all if ``None``) of ``domain``, in the data set's order; ``split="tune"``:
    the first ``n`` of its last ``TUNE_PROMPTS``."""
    if domain not in _LOADERS:
        raise ValueError(f"unknown prompt domain {domain!r}; expected one of {DOMAINS}")
    if split not in SPLITS:
        raise ValueError(f"unknown prompt split {split!r}; expected one of {SPLITS}")
    prompts = _LOADERS[domain]()
    if split == "tune":
        if n is not None and n > TUNE_PROMPTS:
            raise ValueError(f"the tune split holds {TUNE_PROMPTS} prompts per domain, not {n}; "
                             f"ask for at most {TUNE_PROMPTS}")
        prompts = prompts[-TUNE_PROMPTS:]
    return prompts if n is None else prompts[:n]

