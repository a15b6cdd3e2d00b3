"""Tiny seeded HF models built from configs, for fast CPU tests."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

FAMILIES = ("llama", "qwen2", "qwen3")


def tiny_config(family: str = "llama", vocab: int = 64, layers: int = 2, hidden: int = 32, ctx: int = 256):
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=ctx,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family]
    extra = {"head_dim": hidden // 4} if family == "qwen3" else {}
    return cls(**common, **extra)


def tiny_model(family: str = "llama", seed: int = 0, attn: str = "sdpa", **kw):
    torch.manual_seed(seed)
    cfg = tiny_config(family, **kw)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32)
    # Sharpen the random init so greedy continuations are not all near-ties.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.eval()
