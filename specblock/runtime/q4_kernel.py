"""``--dtype q4``'s own kernels, in AVX512, row-independent: Q4_1 (and Q8_0) weights times fp32
activations (``linear``, the "fp32" kernel) or times the activations rounded to int8 (``linear8``,
the "int8" kernel, AVX512-VNNI). The C++ is ``q4_kernel.cpp`` beside this file (the fp32 kernel,
the keyed weights, the ops) and ``q4_int8.cpp`` (the int8 kernel), built as one text.

Why our own: torch's CPU int4 kernel (``_weight_int4pack_mm_for_cpu``) rounds its input and output
to bf16, so a q4 target was lossless only like bf16 (speculative methods parted from plain decoding
at near-ties, ``experiments/results/q4_rows.md``). Ours give every output the same sequence of
operations whatever the number of rows in the call or which rows share a pass, so a token's result
does not depend on the tree it sits in, and a q4 target is lossless like fp32: every method equals
plain decoding token for token (``tests/test_q4.py``).

fp32 (``layout``): fp32 activations and sums, the exact Q4_1 weights ``d * q + m`` (``d * q`` is
exact in fp32 since ``d`` is fp16 and ``q`` < 16, so one fused multiply-add gives
``dequantize_q4_1`` bit for bit): 16 lanes per group half, groups in order, one horizontal sum.
Per block of 4 output features and group of 32 inputs, 64 bytes of nibbles (byte ``i`` of a
feature: input ``i`` low, input ``i + 16`` high, ggml's own order) and ``(d, m)`` per feature as
fp32. The LM head, which a Q4_1 GGUF keeps as Q8_0 (``d * q``, a signed byte per weight: also
exact in fp32), goes through the same passes with 128 bytes and one ``d`` per block
(``layout_q8``). Up to 4 rows go through a block in one pass, more go 8 at a time over half a
block; while a block is computed the next one is prefetched (``experiments/q4_prefetch.py``:
compiled T(1) 14.05 -> 10.30 ms, T(4) 24.18 -> 14.84 on a Xeon). From a few rows on it is bound by
fp32 multiply-adds. With ``bf16`` (``--dtype packed-q4``: a weight's flag, kept with it under its key)
each weight is rounded to bf16, ties to even, as the converter rounded the checkpoint: a Q4_1 weight
is then looked up by its nibble in a 16-entry table made once per feature and group (one
multiply-add and one rounding per 32 weights), a Q8_0 one rounded where it is decoded.

int8 (``layout8``): each row's groups of 32 are rounded to int8 as ggml's Q8_1 does (``dx = amax /
127``, ``round(x / dx)``, ties to even), each group's integer dot products with the 4-bit (or
8-bit) weights are exact in int32 (VNNI: 64 multiply-adds an instruction, 4x fp32's), then scaled
in fp32: ``acc += float(sum q xq) * (d dx)`` and ``acc += m * (dx sum xq)`` per group in order.
This is llama.cpp's arithmetic for a Q4_1 model, so it is another model than the fp32 kernel's
(``experiments/q4_int8.py``: top-1 agreement with it 97% over the bench's chat prompts). Its rows
are independent too; its rounding would turn last-bit differences elsewhere into whole steps, which
``exact_parts.py`` and the fused attention rule out (``q4.py``), so it is q4's default where the CPU
has VNNI (``SPECBLOCK_Q4_KERNEL=fp32`` picks the other). One output feature per 32-bit lane, 16 a block, so no
horizontal sum; per block and group 256 bytes of nibbles and the GGUF's fp16 ``d``, ``m`` (320
bytes; the Q8_0 head: ``q + 128`` as unsigned bytes and ``d``, 544), groups prefetched ``PREFETCH8``
ahead into L1 and ``FAR8`` ahead into L2 (``experiments/int8_prefetch.py``).
Rows go 8 to a pass, and two blocks (32 features) go through a pass together: each row's inputs are
broadcast from memory, four bytes at a time, and each broadcast feeds both blocks (0.68-0.76x the
time at 8 rows on one thread, same bits: ``experiments/int8_kernel_bound.py --baseline-rev``,
``int8_kernel_pairs.md``). Compiled on the real model: T(1) 7.71 against 9.86 ms, T(8) 13.64
against 22.08 before that (``q4_int8.md``, a Xeon).

``linear_key_cat``: linears that read the same input (q/k/v, gate/up) in one call, on either
kernel, each output the same bits as its own call's; compiled graphs get it from
``compiled/fuse.py``.

Built on first use with the C++ compiler torch's extensions use (once per machine and torch
version, under ``$SPECBLOCK_HOME/extensions``, about 8 s); the instructions are chosen per
function (``target`` attributes) and the CPU is checked before use, so a build never runs where
AVX512 is missing. Where it cannot run, q4 falls back to torch's kernel and says so once; where
VNNI is missing, to the fp32 kernel (``q4.default_kernel``).
"""

from __future__ import annotations

import itertools
import os
import warnings
import weakref
from pathlib import Path

import torch

from specblock.q4file import GROUP, unpack_nibbles
from specblock.runtime import cext

NB = 4  # output features per stored block
SOURCE = cext.read_source(Path(__file__).parent / "q4_kernel.cpp")  # with q4_int8.cpp; built once per text and torch version

_STATE: dict[str, object] = {}


def cpu_supports() -> bool:
    """AVX512F, AVX512BW and FMA (the extension checks again before running)."""
    return {"avx512f", "avx512bw", "fma"} <= cext.cpu_flags()


def vnni_supports() -> bool:
    """AVX512-VNNI besides (the int8 kernel's integer multiply-adds)."""
    return cpu_supports() and "avx512_vnni" in cext.cpu_flags()


def _fake(x: torch.Tensor, qb: torch.Tensor, dm: torch.Tensor, bf16: bool = False) -> torch.Tensor:
    return x.new_empty((x.shape[0], qb.shape[0] * NB))


def _fake_amx(x: torch.Tensor, qb: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], qb.shape[0] * AMX_TILE))


def _fake8(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0] * NF))


def _fake_key(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], out_features))


def _fake_cat(x: torch.Tensor, k0: int, k1: int, k2: int, k3: int, out_features: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], out_features))


LIBRARY = "specblock_q4"


def asked_kernel() -> str | None:
    """The kernel ``SPECBLOCK_Q4_KERNEL`` names; None where it is unset or empty (the default's). The one
    place the variable is read, so that every question about it agrees on what "unset" means."""
    return os.environ.get("SPECBLOCK_Q4_KERNEL") or None


def torch_asked() -> bool:
    """``SPECBLOCK_Q4_KERNEL=bf16``: torch's int4 kernel asked for instead of ours."""
    return asked_kernel() == "bf16"


def int8_cpu() -> bool:
    """Whether q4 would run on the int8 kernel here, by the CPU's flags and ``SPECBLOCK_Q4_KERNEL``
    (unset or ``int8``) alone, nothing built: what ``--dtype auto`` asks before choosing q4
    (``q4.default_kernel`` builds and says the same where the build succeeds)."""
    return vnni_supports() and asked_kernel() in (None, "int8")


def start_building() -> None:
    """``load``'s build begun in the background where it would run: a q4 target's, or the int8
    linears of drafters beside a packed one (``drafters.int8_drafters``)."""
    if cpu_supports() and not torch_asked():
        cext.start_build(LIBRARY, SOURCE, *cext.OPENMP)  # build_or_why's flags


def load() -> bool:
    """Build (or load) the extension once per process; False, with one warning, where it cannot run."""
    if "ok" not in _STATE:
        why = None
        if torch_asked():
            why = "SPECBLOCK_Q4_KERNEL=bf16 asks for torch's kernel"
        elif not cpu_supports():
            why = "this CPU has no AVX512F/AVX512BW"
        else:  # where it cannot be built: torch's kernel, lossless only like bf16
            why = cext.build_or_why(LIBRARY, SOURCE, {
                "specblock_q4::linear": _fake, "specblock_q4::linear_key": _fake_key,
                "specblock_q4::linear_key_cat": _fake_cat, "specblock_q4::linear8": _fake8,
                "specblock_q4::linear_amx": _fake_amx})
        _STATE["ok"] = why is None
        if why is not None and "SPECBLOCK_Q4_KERNEL" not in why:
            warnings.warn(f"specblock: q4 runs torch's int4 kernel, lossless only like bf16 ({why})", stacklevel=2)
    return bool(_STATE["ok"])


def layout(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q4_1 triple as ``q4file`` stores it (``[N, K/2]`` nibbles, element ``2j`` low; fp16 ``d``,
    ``m`` ``[N, K/32]``) -> the kernel's ``qb`` uint8 ``[N/4, K/32, 4, 16]`` and ``dm`` fp32 ``[N/4, K/32, 4, 2]``."""
    n, k = qs.shape[0], qs.shape[1] * 2
    if n % NB or k % GROUP:
        raise ValueError(f"a {k} -> {n} linear does not fit the q4 kernel (inputs in groups of {GROUP}, outputs in {NB}s)")
    q = torch.stack([qs & 0xF, qs >> 4], -1).reshape(n, k // GROUP, 2, 16)  # uint8 throughout: loads stay quick
    nib = q[:, :, 0] | (q[:, :, 1] << 4)  # [N, G, 16]: input i low, input i + 16 high
    qb = nib.reshape(n // NB, NB, k // GROUP, 16).transpose(1, 2).contiguous()
    dm = torch.stack([d.float(), m.float()], -1).reshape(n // NB, NB, k // GROUP, 2).transpose(1, 2).contiguous()
    return qb, dm


AMX_TILE = 16  # output features per AMX tile


def layout_amx(qb: torch.Tensor, dm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 kernel's ``layout`` / ``layout_q8`` -> the AMX kernel's: ``[N/16, K/32, 16, QB]`` bytes
    and ``[N/16, K/32, 16, SB]`` scales, a tile's 16 features of a group side by side (one stream)."""
    n4, g = qb.shape[:2]
    if n4 * NB % AMX_TILE:
        raise ValueError(f"{n4 * NB} outputs do not fit the AMX kernel (tiles of {AMX_TILE})")
    per = AMX_TILE // NB

    def tiles(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(n4 // per, per, g, NB, t.shape[-1]).permute(0, 2, 1, 3, 4).reshape(n4 // per, g, AMX_TILE, -1).contiguous()

    return tiles(qb), tiles(dm)


def amx_cpu() -> bool:
    """The CPU flags packed-q4-amx needs: AVX512F/BW and AVX512-BF16 (on AMX tiles where the CPU has
    them, ``amx_tiles``; on VDPBF16PS dot products elsewhere), unless ``SPECBLOCK_Q4_KERNEL=bf16`` keeps
    our library from loading: what ``--dtype auto`` asks before any build (``amx_supports`` builds and
    asks Linux too)."""
    return cpu_supports() and "avx512_bf16" in cext.cpu_flags() and not torch_asked()


def amx_tiles() -> bool:
    """Whether packed-q4-amx runs on AMX tiles here (AMX-BF16 by the CPU's flags), not dot products."""
    return {"amx_bf16", "amx_tile"} <= cext.cpu_flags()


def amx_supports() -> bool:
    """packed-q4-amx's kernel here: AVX512-BF16 by the CPU's flags and our library loaded, on tiles
    where Linux gives the process leave to use them (the library asks once), else on dot products."""
    return "avx512_bf16" in cext.cpu_flags() and load() and (
        torch.ops.specblock_q4.amx_ok() or torch.ops.specblock_q4.bf16dot_ok())


def layout_q8(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 pair as ``q4file`` stores it (int8 ``q`` ``[N, K]``, fp16 ``d`` ``[N, K/32]``) -> the
    kernel's ``qb`` int8 ``[N/4, K/32, 4, 32]`` and ``dm`` fp32 ``[N/4, K/32, 4, 1]``."""
    n, k = q.shape
    if n % NB or k % GROUP:
        raise ValueError(f"a {k} -> {n} linear does not fit the q4 kernel (inputs in groups of {GROUP}, outputs in {NB}s)")
    qb = q.to(torch.int8).reshape(n // NB, NB, k // GROUP, GROUP).transpose(1, 2).contiguous()
    dm = d.float().reshape(n // NB, NB, k // GROUP, 1).transpose(1, 2).contiguous()
    return qb, dm


NF = 16  # output features per block of the int8 kernel: one per 32-bit lane
#: The int8 kernel's prefetch distances in groups of 32 inputs, as the extension starts with them
#: (``specblock_q4::set_prefetch8`` / ``set_far8`` change them for the process).
PREFETCH8, FAR8 = 8, 32


def _slots(q: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` bytes -> ``[N/16, K/32, 8, 64]``: per block of 16 features and group, slot ``t``
    holds inputs ``4t..4t+3`` of each feature in turn (what one VNNI multiply-add takes)."""
    n, k = q.shape
    return q.reshape(n // NF, NF, k // GROUP, 8, 4).permute(0, 2, 3, 1, 4).reshape(n // NF, k // GROUP, 8, 64)


def _scales(v: torch.Tensor) -> torch.Tensor:
    """fp16 ``[N, K/32]`` -> 16 fp16 values (32 bytes) per block and group ``[N/16, K/32, 32]``."""
    n, g = v.shape
    f = v.half().reshape(n // NF, NF, g).transpose(1, 2).contiguous()
    return f.view(torch.uint8).reshape(n // NF, g, 32)


def _fits8(n: int, k: int) -> None:
    if n % NF or k % GROUP:
        raise ValueError(f"a {k} -> {n} linear does not fit the int8 kernel (inputs in groups of {GROUP}, outputs in {NF}s)")


def layout8(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """A Q4_1 triple (as ``layout`` takes it) -> the int8 kernel's uint8 ``[N/16, K/32, 320]``:
    slots ``t`` and ``t + 4`` as the low and high nibbles of 64 bytes, then ``d`` and ``m`` (fp16, the GGUF's)."""
    n, k = qs.shape[0], qs.shape[1] * 2
    _fits8(n, k)
    slots = _slots(unpack_nibbles(qs).to(torch.uint8))
    nib = slots[:, :, :4] | (slots[:, :, 4:] << 4)
    return torch.cat([nib.reshape(n // NF, k // GROUP, 256), _scales(d), _scales(m)], -1).contiguous()


def layout8_q8(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """A Q8_0 pair (as ``layout_q8`` takes it) -> uint8 ``[N/16, K/32, 544]``: ``q + 128`` in slots, then ``d`` (fp16)."""
    n, k = q.shape
    _fits8(n, k)
    u = (q.to(torch.int16) + 128).to(torch.uint8)
    return torch.cat([_slots(u).reshape(n // NF, k // GROUP, 512), _scales(d)], -1).contiguous()


def linear8(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` fp32, quantized to int8 per row and group of 32, times ``layout8``/``layout8_q8``
    weights: ``[M, N]`` fp32."""
    return torch.ops.specblock_q4.linear8(x, w)


def linear_amx(x: torch.Tensor, qb: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` fp32 rounded to bf16 times ``layout_amx`` weights, each rounded to bf16, summed in
    fp32 by AMX tiles: ``[M, N]`` fp32 (``--dtype packed-q4-amx``)."""
    return torch.ops.specblock_q4.linear_amx(x, qb, dm)


def linear(x: torch.Tensor, qb: torch.Tensor, dm: torch.Tensor, bf16: bool = False) -> torch.Tensor:
    """``x [M, K]`` fp32 times Q4_1 weights (``layout``) or Q8_0 ones (``layout_q8``): ``[M, N]`` fp32.
    ``bf16``: each weight rounded to bf16 first (``--dtype packed-q4``: the checkpoint's values)."""
    return torch.ops.specblock_q4.linear(x, qb, dm, bf16)


_KEYS = itertools.count()


def register(weights: tuple[torch.Tensor, ...], owner: object, key: int | None = None, bf16: bool = False,
             amx: bool = False) -> int:
    """Keep a linear's weights (the fp32 kernel's ``(qb, dm)`` or the int8 kernel's ``(w,)``) under
    a new key until ``owner`` is collected: what a compiled graph calls ``linear_key`` with (ints
    are cheap to guard, tensors are not). ``key``: replace the weights under ``owner``'s own key.
    ``bf16``: as ``linear``'s (fp32 kernel only). ``amx``: ``layout_amx`` weights (bf16 implied)."""
    new = key is None
    key = next(_KEYS) if new else key
    qb, dm = weights if len(weights) == 2 else (weights[0], torch.empty(0))
    if bf16 and len(weights) != 2:
        raise ValueError("bf16 weights run on the fp32 kernel, not the int8 one")
    if amx:
        torch.ops.specblock_q4.put_amx(key, qb, dm)
    else:
        torch.ops.specblock_q4.put(key, qb, dm, bf16)
    if new:
        weakref.finalize(owner, _drop, key)
    return key


def _drop(key: int) -> None:
    try:
        torch.ops.specblock_q4.drop(key)
    except (AttributeError, RuntimeError):  # interpreter shutdown: the library may be gone first
        pass


def linear_key(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return torch.ops.specblock_q4.linear_key(x, key, out_features)


#: The most linears one ``linear_key_cat`` takes (its keys are plain ints: see the op).
CAT_KEYS = 4


def cat_keys(keys: list[int]) -> tuple[int, ...]:
    """``keys`` as ``linear_key_cat`` takes them: ``CAT_KEYS`` plain ints, -1 for none."""
    if not 0 < len(keys) <= CAT_KEYS:
        raise ValueError(f"a fused linear call takes 1 to {CAT_KEYS} keys, not {len(keys)}")
    return (*keys, *[-1] * (CAT_KEYS - len(keys)))


def linear_key_cat(x: torch.Tensor, keys: list[int], out_features: int) -> torch.Tensor:
    """Up to ``CAT_KEYS`` linears that read ``x`` in one call, their outputs side by side, each the
    same bits as its own call's: ``x`` quantized once (int8 kernel) and one parallel region instead
    of one each (what ``compiled/fuse.py`` puts in a compiled graph for q/k/v and gate/up)."""
    return torch.ops.specblock_q4.linear_key_cat(x, *cat_keys(keys), out_features)
