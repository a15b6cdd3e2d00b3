"""Fast checks of the lab corpus splits and the five evaluation prompt sets (no model, no torch)."""

from __future__ import annotations

import pytest

from specblock import prompts
from specblock.training import corpus

SMALL = ("math", "chat", "prose")  # code reads ~600 stdlib files; checked more cheaply below


@pytest.mark.parametrize("domain", SMALL)
def test_splits_disjoint_deterministic_nonempty(domain: str) -> None:
    train = list(corpus.iter_documents(domain, "train"))
    held = list(corpus.iter_documents(domain, "heldout"))
    assert train and held
    assert not set(train) & set(held)
    assert held == list(corpus.iter_documents(domain, "heldout"))
    assert len(held) < 0.15 * (len(train) + len(held))


def test_code_split_by_file_path() -> None:
    files = corpus.stdlib_files()
    assert len(files) > 100
    rels = [f.as_posix() for f in files]
    assert not any("/test/" in r or "/tests/" in r or "site-packages" in r for r in rels)
    import sysconfig
    from pathlib import Path

    root = Path(sysconfig.get_paths()["stdlib"])
    held = [f for f in files if corpus.is_heldout("code", f.relative_to(root).as_posix())]
    assert 0 < len(held) < 0.1 * len(files)
    first = next(corpus.iter_documents("code", "heldout"))
    assert "def " in first or "import " in first


def test_stable_fraction_is_process_independent() -> None:
    # Pinned value: Python's salted hash() would change between processes, sha256 does not.
    import hashlib

    expect = int.from_bytes(hashlib.sha256(b"math:abc").digest()[:8], "big") / 2.0**64
    assert corpus.stable_fraction("math:abc") == expect
    assert 0.0 <= corpus.stable_fraction("x") < 1.0


def test_chat_split_keeps_all_responses_of_an_instruction_together() -> None:
    import json

    rows = [json.loads(x) for x in open(corpus.data_file("alpaca_eval", "train.jsonl"))]
    by_id: dict[int, set[bool]] = {}
    for r in rows:
        by_id.setdefault(r["id"], set()).add(corpus.is_heldout("chat", str(r["id"])))
    assert all(len(v) == 1 for v in by_id.values())


def test_unknown_domain_and_split_raise() -> None:
    with pytest.raises(ValueError, match="unknown corpus domain"):
        corpus.iter_documents("poetry")
    with pytest.raises(ValueError, match="unknown split"):
        corpus.iter_documents("math", "valid")
    with pytest.raises(ValueError, match="unknown prompt domain"):
        prompts.load_prompts("poetry")


def test_missing_data_dir_is_a_clear_error(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("SPECBLOCK_DATA", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="SPECBLOCK_DATA"):
        prompts.load_prompts("math")


@pytest.mark.parametrize("domain", prompts.DOMAINS)
def test_each_prompt_domain_loads(domain: str) -> None:
    ps = prompts.load_prompts(domain)
    assert len(ps) >= 50
    assert all(p.domain == domain and p.text.strip() for p in ps)
    assert len({p.id for p in ps}) == len(ps)
    assert prompts.load_prompts(domain, n=3) == ps[:3]


@pytest.mark.parametrize("domain", prompts.DOMAINS)
def test_the_tune_split_is_each_sets_last_prompts_apart_from_the_benchs(domain: str) -> None:
    every = prompts.load_prompts(domain)
    tune = prompts.load_prompts(domain, split="tune")
    assert tune == every[-prompts.TUNE_PROMPTS:] and len(tune) == prompts.TUNE_PROMPTS
    assert prompts.load_prompts(domain, 3, "tune") == tune[:3]
    assert not {p.id for p in tune} & {p.id for p in prompts.load_prompts(domain, 47)}  # the bench's first N
    with pytest.raises(ValueError, match="at most 8"):
        prompts.load_prompts(domain, prompts.TUNE_PROMPTS + 1, "tune")
    with pytest.raises(ValueError, match="unknown prompt split"):
        prompts.load_prompts(domain, 1, "train")


def test_chat_template_shared_by_corpus_and_prompts() -> None:
    for domain in ("chat", "qa", "mtbench"):
        p = prompts.load_prompts(domain, n=1)[0]
        assert p.text.startswith("### Instruction:\n") and p.text.endswith("\n\n### Response:\n")
    doc = next(corpus.iter_documents("chat", "train"))
    head = doc.split("### Response:\n")[0] + "### Response:\n"
    assert corpus.chat_prompt(head[len("### Instruction:\n"):-len("\n\n### Response:\n")]) == head


def test_math_prompt_is_the_training_prefix() -> None:
    doc = next(corpus.iter_documents("math", "train"))
    assert doc.startswith("Question: ") and "\nAnswer:\n" in doc and "<<" not in doc
    p = prompts.load_prompts("math", n=1)[0].text
    assert p.startswith("Question: ") and p.endswith("\nAnswer:\n")


def test_eval_chat_prompts_never_in_training() -> None:
    heads = {d.split("### Response:\n")[0] for d in corpus.iter_documents("chat", "train")}
    heads |= {d.split("### Response:\n")[0] for d in corpus.iter_documents("chat", "heldout")}
    for p in prompts.load_prompts("chat"):
        assert p.text.split("### Response:\n")[0] not in heads
