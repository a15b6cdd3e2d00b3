"""Where the shared data sets live, and the lab model's plain-text prompt formats.

Both training (the lab corpus, self-generated data) and evaluation (``specblock.prompts``) read
from here, so evaluation prompts never depend on the training package.
"""

from __future__ import annotations

import os
from pathlib import Path

from specblock.errors import SpecBlockError


class DataMissing(SpecBlockError, FileNotFoundError):
    """The shared data (or one of its files) is not where it should be: one line from the CLI, and
    still a FileNotFoundError to callers that catch that."""


def data_root() -> Path:
    """The shared data directory: ``$SPECBLOCK_DATA`` or ``<repo>/../shared/data``."""
    env = os.environ.get("SPECBLOCK_DATA")
    root = Path(env) if env else Path(__file__).resolve().parents[1].parent / "shared" / "data"
    if not root.is_dir():
        raise DataMissing(
            f"shared data not found at {root}; set SPECBLOCK_DATA to the folder holding "
            "gsm8k/, alpaca_eval/, tinyshakespeare/, humaneval/, spec_bench/")
    return root


def data_file(*parts: str) -> Path:
    """A file under :func:`data_root`, with a one-line error if it is missing."""
    path = data_root().joinpath(*parts)
    if not path.is_file():
        raise DataMissing(f"missing data file {path} (SPECBLOCK_DATA={data_root()})")
    return path


def chat_prompt(instruction: str) -> str:
    """The lab model's one chat format (it has no chat template), for training text and eval prompts."""
    return f"### Instruction:\n{instruction.strip()}\n\n### Response:\n"


def math_prompt(question: str) -> str:
    """GSM8K question framing for the lab model; it continues with a worked solution ending '#### n'."""
    return f"Question: {question.strip()}\nAnswer:\n"


def code_instruction(code: str) -> str:
    """How a code prompt is put to a chat model: one user turn asking to complete the function.

    HumanEval prompts are function heads with docstrings; a chat model given one bare answers
    about it rather than continuing it, so the user message asks for the completion and quotes
    the head in a fenced block (training code prompts use the same words).
    """
    return f"Complete the following Python function.\n\n```python\n{code.rstrip()}\n```"
