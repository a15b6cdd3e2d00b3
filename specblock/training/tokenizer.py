"""Byte-level BPE tokenizer for the lab target, trained on a sample of the corpus mix.

Saved as a plain HF fast tokenizer (``tokenizer.json`` + ``tokenizer_config.json``) so
``AutoTokenizer.from_pretrained(dir)`` loads it like any hub model's. The post-processor
prepends ``<|bos|>`` (as Llama's does), so ``tok(prompt)`` matches training, where every
document is ``<|bos|> text <|eos|>``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from specblock.training.corpus import DOMAINS, MIX_WEIGHTS, iter_documents

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS: list[str] = [BOS, EOS, PAD]  # ids 0, 1, 2
VOCAB_SIZE = 8192


def _sample_texts(total_chars: int, seed: int) -> Iterator[str]:
    """Train-split documents, each domain capped at its mix share of ``total_chars``."""
    rng = random.Random(seed)
    for domain in DOMAINS:
        docs = list(iter_documents(domain, "train"))
        rng.shuffle(docs)
        budget = int(total_chars * MIX_WEIGHTS[domain])
        for doc in docs:
            if budget <= 0:
                break
            yield doc[:budget]
            budget -= len(doc)


def train_tokenizer(out_dir: Path, vocab_size: int = VOCAB_SIZE,
                    sample_chars: int = 12_000_000, seed: int = 0) -> Path:
    """Train the BPE on a domain-balanced sample and save an HF-loadable tokenizer dir."""
    tok = Tokenizer(models.BPE())
    # Newlines are isolated before the byte-level split, so "\n" never merges with the next
    # line's indentation: prompts that end in "\n" (HumanEval, the chat template) then end on
    # the same token boundary that training text had there.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex("\n"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_sample_texts(sample_chars, seed), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    return save_hf_tokenizer(tok, out_dir)


def save_hf_tokenizer(tok: Tokenizer, out_dir: Path) -> Path:
    """Write ``tok`` as an HF fast tokenizer with bos/eos/pad declared."""
    from transformers import PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                 pad_token=PAD, model_max_length=1024)
    hf.save_pretrained(str(out_dir))
    return out_dir


def load_tokenizer(path: Path):
    """Load through the generic HF entry point, as users of the shipped model will."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
