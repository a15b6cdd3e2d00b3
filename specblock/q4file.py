"""The file behind ``--dtype q4`` (``runtime/q4.py``): a model's quantized linears, as its GGUF holds them.

A leaf module: ``models/convert.py`` writes the file when it builds a model from a GGUF, and the
runtime reads it; neither room imports the other for it.

Per Q4_1 linear ``NAME`` (transformers' module name): ``NAME.qs`` (uint8 ``[N, K/2]``, two 4-bit
values per byte, element ``2j`` in the low nibble), ``NAME.d`` and ``NAME.m`` (fp16 ``[N, K/32]``),
in the checkpoint's row order: ``w = d * q + m`` per block of 32 inputs.

Per Q8_0 linear (the LM head: llama.cpp keeps the token embedding at 8 bits in a Q4_1 file):
``NAME.q8`` (int8 ``[N, K]``) and ``NAME.d8`` (fp16 ``[N, K/32]``): ``w = d * q``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

Q4_FILE = "q4_1.safetensors"
GROUP = 32  # Q4_1's block, and the int4 kernel's group size


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` values in 0..15 -> uint8 ``[N, K/2]``, element ``2j`` in the low nibble."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K/2]`` -> int32 ``[N, K]`` (the int4-pack converter's input)."""
    lo, hi = (qs & 0xF).to(torch.int32), (qs >> 4).to(torch.int32)
    return torch.stack([lo, hi], -1).reshape(qs.shape[0], -1)


def dequantize_q4_1(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The fp32 weights ``d * q + m`` ``[N, K]`` a Q4_1 triple stands for."""
    q = unpack_nibbles(qs).float().reshape(qs.shape[0], -1, GROUP)
    return (q * d.float()[..., None] + m.float()[..., None]).reshape(qs.shape[0], -1)


def decode_gguf_q4_1(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GGUF Q4_1 bytes ``[rows, blocks * 20]`` -> ``q`` uint8 ``[rows, K]``, ``d``, ``m`` fp16 ``[rows, K/32]``.

    ggml's block: fp16 ``d``, fp16 ``m``, then 16 bytes whose low nibbles are elements 0..15 and
    high nibbles elements 16..31."""
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    qs = blocks[..., 4:]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(rows, -1)
    return q, d, m


def decode_gguf_q8_0(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GGUF Q8_0 bytes ``[rows, blocks * 34]`` -> ``q`` int8 ``[rows, K]`` and ``d`` fp16 ``[rows, K/32]``.

    ggml's block: fp16 ``d``, then 32 signed bytes in order."""
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, 34)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    q = blocks[..., 2:].copy().view(np.int8).reshape(rows, -1)
    return q, d


def dequantize_q8_0(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The fp32 weights ``d * q`` ``[N, K]`` (exact: an fp16 times a byte fits fp32's mantissa)."""
    return (q.float().reshape(q.shape[0], -1, GROUP) * d.float()[..., None]).reshape(q.shape[0], -1)


def quantize_q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's Q8_0 rounding of ``w`` ``[N, K]``: per block of 32, ``d = max |w| / 127``. For tests."""
    n, k = w.shape
    blocks = w.detach().float().reshape(n, k // GROUP, GROUP)
    d = (blocks.abs().amax(-1) / 127).half()
    inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros_like(d.float()))
    q = (blocks * inv[..., None]).round().clamp(-127, 127).to(torch.int8).reshape(n, k)
    return q, d


def quantize_q4_1(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ggml's Q4_1 rounding of ``w`` ``[N, K]``: per block of 32, ``d = (max - min) / 15``, ``m = min``.
    For models without a GGUF (tests); ``q4`` serves a GGUF's own values where there is one."""
    n, k = w.shape
    blocks = w.detach().float().reshape(n, k // GROUP, GROUP)
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    d = ((hi - lo) / 15).half()
    m = lo.half()
    inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros_like(lo))
    q = ((blocks - m.float()[..., None]) * inv[..., None]).round().clamp(0, 15).reshape(n, k)
    return pack_nibbles(q), d, m


def save_q4(path: Path, tensors: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
            q8: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
    """Q4_1 linears (``tensors``: ``qs, d, m``) and Q8_0 ones (``q8``: ``q, d``) into one file."""
    from safetensors.torch import save_file

    flat = {}
    for name, (qs, d, m) in tensors.items():
        flat.update({f"{name}.qs": qs.contiguous(), f"{name}.d": d.contiguous(), f"{name}.m": m.contiguous()})
    for name, (q, d) in (q8 or {}).items():
        flat.update({f"{name}.q8": q.to(torch.int8).contiguous(), f"{name}.d8": d.half().contiguous()})
    save_file(flat, str(path), metadata={"format": "specblock-q4_1", "group": str(GROUP)})
