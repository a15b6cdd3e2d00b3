"""SpS draft model: build it from the target's config, and one distillation step.

The draft model is a small ``LlamaForCausalLM`` over the target's vocabulary: ``layers`` decoder
layers (default 2), the target's hidden size and head count unless told otherwise, the target's
RoPE base and context length. When the hidden sizes match, its embedding and LM head start as
copies of the target's (trainable: a separate model, unlike the heads-on-target drafters).

Loss: soft cross-entropy to the target's next-token distribution at every position of the window
(distillation, as DistillSpec recommends for speculative drafts; the corpus's own tokens are not
what the target would emit). From a feature cache the distribution is the cached top-k, renormalised. Choices: no valid-prefix mask (a chain drafter is judged position by
position); the target's logits are computed once per batch and shared.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specblock.training.specblock_step import Batched


class SpsNet(torch.nn.Module):
    """Holds the HF draft model; ``save`` writes an ordinary HF directory (safetensors)."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        super().__init__()
        self.model = model

    def save(self, path: str | Path) -> None:
        """bf16 on disk (the weights are served in bf16 and the asset budget counts bytes), written
        to a sibling directory and swapped in, so an interrupted export leaves nothing half-written."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        self.model.to(torch.bfloat16)  # in place: tied embedding and LM head stay one tensor
        try:
            self.model.save_pretrained(tmp, safe_serialization=True)
        finally:
            self.model.float()
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)


def build_draft(target, layers: int = 2, intermediate: int = 1024, hidden: int | None = None,
                tie: bool = False) -> SpsNet:
    """``tie`` shares the input embedding with the LM head (GPT-2 style): at a small hidden size
    the two vocabulary matrices are most of the model's bytes."""
    tcfg = target.config
    h = hidden or int(tcfg.hidden_size)
    heads = int(tcfg.num_attention_heads) if h == int(tcfg.hidden_size) else max(1, h // 64)
    cfg = LlamaConfig(
        vocab_size=int(tcfg.vocab_size), hidden_size=h, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=int(getattr(tcfg, "max_position_embeddings", 2048)),
        rope_theta=float(getattr(tcfg, "rope_theta", 10000.0) or 10000.0),
        rms_norm_eps=float(getattr(tcfg, "rms_norm_eps", 1e-6)), tie_word_embeddings=tie,
        bos_token_id=getattr(tcfg, "bos_token_id", None), eos_token_id=getattr(tcfg, "eos_token_id", None),
        pad_token_id=getattr(tcfg, "pad_token_id", None), architectures=["LlamaForCausalLM"],
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        if h == int(tcfg.hidden_size):
            model.get_input_embeddings().weight.copy_(target.get_input_embeddings().weight)
            if not tie:
                model.get_output_embeddings().weight.copy_(target.get_output_embeddings().weight)
        elif tie and h < int(tcfg.hidden_size):
            # Our choice: a narrower tied vocabulary matrix starts as the target's embedding in its
            # top-h principal directions (E V_h = U_h S_h), so token similarities start as the
            # target's and a short distillation run does not have to learn 49k rows from noise.
            model.get_input_embeddings().weight.copy_(principal_rows(target.get_input_embeddings().weight, h))
    return SpsNet(model.float())


def principal_rows(emb: torch.Tensor, h: int) -> torch.Tensor:
    """``emb`` [V, H] projected on its top-``h`` right singular vectors: [V, h]."""
    e = emb.detach().float()
    _, _, vt = torch.linalg.svd(e, full_matrices=False)
    return e @ vt[:h].T


@dataclass
class SpsPass:
    tokens: torch.Tensor  # [B, W]
    p_star: torch.Tensor  # [B, W, V] the target's next-token distribution, float
    y_star: torch.Tensor  # [B, W]


@torch.no_grad()
def sps_pass(model, tokens: torch.Tensor) -> SpsPass:
    logits = model(input_ids=tokens).logits.float()
    return SpsPass(tokens, torch.softmax(logits, -1), logits.argmax(-1))


@dataclass
class SpsTopkPass(Batched):
    """What a feature cache holds for SpS (``CacheWindows(feature="tokens")``): the target's top-k
    next-token ids and probabilities, no V-sized tensor; the soft CE renormalises over the k."""

    tokens: torch.Tensor  # [B, W]
    ids: torch.Tensor  # [B, W, k] descending: ids[..., 0] is the target's argmax
    probs: torch.Tensor  # [B, W, k]


@dataclass
class SpsResult:
    loss: torch.Tensor
    top1: torch.Tensor  # [B, W] draft argmax == target argmax


def sps_step(net: SpsNet, sp: SpsPass | SpsTopkPass) -> SpsResult:
    logits = net.model(input_ids=sp.tokens).logits.float()
    logp = torch.log_softmax(logits, -1)
    if isinstance(sp, SpsTopkPass):
        p = sp.probs / sp.probs.sum(-1, keepdim=True).clamp_min(1e-20)
        ce, y_star = -(p * logp.gather(-1, sp.ids)).sum(-1), sp.ids[..., 0]
    else:
        ce, y_star = -(sp.p_star * logp).sum(-1), sp.y_star
    return SpsResult(ce.mean(), logits.detach().argmax(-1) == y_star)
