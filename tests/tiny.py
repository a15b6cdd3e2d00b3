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


#: Decoder families for the architecture matrix: name -> (model_type, config fields beyond the
#: common ones). WINDOW is the sliding window of the families that have one: small, so that
#: prompts and outputs of a few dozen tokens run far past it.
WINDOW = 6
MATRIX = {
    "llama": ("llama", {}),
    "mistral-sw": ("mistral", {"sliding_window": WINDOW}),
    "qwen2": ("qwen2", {}),
    "qwen2-sw": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1,
                           "layer_types": ["full_attention", "sliding_attention", "full_attention"]}),
    "qwen3": ("qwen3", {"head_dim": 8}),
    "qwen3-moe": ("qwen3_moe", {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                "decoder_sparse_step": 1}),
    "gemma": ("gemma", {"head_dim": 8}),
    "gemma2": ("gemma2", {"head_dim": 8, "sliding_window": WINDOW,
                          "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
    "gemma3": ("gemma3_text", {"head_dim": 8, "sliding_window": WINDOW,
                               "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]}),
    "phi3": ("phi3", {"pad_token_id": 0}),
    "olmo2": ("olmo2", {}),
    "granite": ("granite", {}),
    "stablelm": ("stablelm", {}),
    "cohere2": ("cohere2", {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]}),
    "smollm3": ("smollm3", {}),
    "mixtral-sw": ("mixtral", {"sliding_window": WINDOW, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "starcoder2-sw": ("starcoder2", {"sliding_window": WINDOW}),
}


def matrix_config(name: str, vocab: int = 64, layers: int = 3, hidden: int = 32, ctx: int = 256):
    from transformers import AutoConfig

    model_type, extra = MATRIX[name]
    if "layer_types" in extra:  # the pattern repeats over any depth
        extra = {**extra, "layer_types": (extra["layer_types"] * layers)[:layers]}
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=ctx, bos_token_id=0,
                  eos_token_id=1, pad_token_id=0, tie_word_embeddings=False)
    return AutoConfig.for_model(model_type, **{**common, **extra})


def tiny_model(family: str = "llama", seed: int = 0, attn: str = "sdpa", **kw):
    torch.manual_seed(seed)
    cfg = tiny_config(family, **kw) if family in FAMILIES else matrix_config(family, **kw)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32)
    # Sharpen the random init so greedy continuations are not all near-ties.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.eval()


def tiny_tokenizer(vocab: int = 64):
    """A character-level tokenizer whose ids fit a tiny model's vocabulary (0 bos, 1 eos)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)][: vocab - 3]
    table = {"<s>": 0, "</s>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tk = Tokenizer(models.WordLevel(vocab=table, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<s>")


def save_tiny(path, family: str = "llama", vocab: int = 64, **kw):
    """Write a tiny model (safetensors) and tokenizer to ``path``; returns the path."""
    model = tiny_model(family, vocab=vocab, **kw)
    model.save_pretrained(path)
    tiny_tokenizer(vocab).save_pretrained(path)
    return path


#: The tiny q4 model's vocabulary.
Q4_VOCAB = 48


def save_tiny_q4(path, head: bool = True, **kw):
    """A tiny llama with a Q4_1 file for its block linears and a Q8_0 head (no GGUF:
    ``quantize_q4_1`` / ``quantize_q8_0`` of its weights)."""
    from specblock.q4file import Q4_FILE, quantize_q4_1, quantize_q8_0, save_q4
    from specblock.runtime.target import TargetModel

    save_tiny(path, "llama", vocab=Q4_VOCAB, hidden=64, **kw)
    model = TargetModel.load(path, "float32", "cpu").model
    save_q4(path / Q4_FILE, {name: quantize_q4_1(mod.weight) for name, mod in model.named_modules()
                             if isinstance(mod, torch.nn.Linear) and name != "lm_head"},
            {"lm_head": quantize_q8_0(model.lm_head.weight)} if head else None)
    return path


def save_tiny_packed_q4(path, **kw):
    """``save_tiny_q4``'s model with its checkpoint rewritten as ``models/convert.py`` writes one from
    a GGUF: each linear the Q4_1 file holds (and the Q8_0 head) dequantized and rounded to bf16,
    saved in bf16 (what ``--dtype packed-q4`` needs)."""
    from safetensors.torch import load_file

    from specblock.q4file import Q4_FILE, dequantize_q4_1, dequantize_q8_0
    from specblock.runtime.target import TargetModel

    save_tiny_q4(path, **kw)
    model = TargetModel.load(path, "float32", "cpu").model
    stored = load_file(str(path / Q4_FILE))
    mods = dict(model.named_modules())
    with torch.no_grad():
        for key in stored:
            name, kind = key.rsplit(".", 1)
            if kind == "qs":
                w = dequantize_q4_1(stored[key], stored[f"{name}.d"], stored[f"{name}.m"])
            elif kind == "q8":
                w = dequantize_q8_0(stored[key], stored[f"{name}.d8"])
            else:
                continue
            mods[name].weight.copy_(w.bfloat16().float())
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def hf_greedy(model, prompt, n: int) -> list[int]:
    """The reference every lossless test compares against: HF generate(do_sample=False)."""
    out = model.generate(torch.tensor(prompt)[None], max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def assert_drafters_match_greedy(target, vocab: int, seed: int, trials: int = 3, n: int = 24, max_budget: int = 16) -> None:
    """Random prompts and budgets; a random drafter's and prompt lookup's trees each give the target's
    own greedy decoding token for token, and some drafts are accepted (the check is not vacuous)."""
    import numpy as np

    from specblock.runtime.drafters import LookupDrafter, RandomDrafter
    from specblock.runtime.engine import Engine

    rng = np.random.default_rng(seed)
    accepted = 0
    for trial in range(trials):
        prompt = rng.integers(2, vocab, int(rng.integers(2, 16)))
        ref = hf_greedy(target.model, prompt, n)
        for drafter in (RandomDrafter(vocab, seed=trial), LookupDrafter(branches=3, max_ngram=2)):
            res = Engine(target, drafter, budget=int(rng.integers(2, max_budget))).generate(prompt, n)
            assert res.token_ids == ref, (drafter.name, trial)
            accepted += sum(res.stats.accepted)
    assert accepted > 0


def perturb(net, noise: float) -> None:
    """Move every trainable tensor far from its init ("random weights" for lossless tests)."""
    with torch.no_grad():
        for p in net.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * noise)


def run_cli(capsys, *argv):
    """``python -m specblock.runtime ARGV`` in-process: (exit status, stdout, stderr)."""
    from specblock.runtime.cli import main

    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def experiment(name: str):
    """``experiments/NAME.py`` imported as a module (the scripts are not a package; their folder goes
    on ``sys.path`` so that one script may import a sibling, as heldout_compare imports vocab_sweep)."""
    import importlib.util
    import sys
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "experiments"
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
