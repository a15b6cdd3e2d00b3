"""The CPU dtype ``q4``: a model's own Q4_1 weights (from its GGUF), read as 4 bits.

Why: on this CPU a compiled forward of the real model is bound by reading its weights (T(1) within
1.3-1.8x of the bandwidth floor at packed-fp16), and the real model *is* a 4-bit model: it comes as
a Q4_1 GGUF, and the bf16 checkpoint holds those 4-bit values dequantized. Read as 4 bits, the
decoder's linears are a quarter of their fp16 bytes.

Three kernels (``Int4Linear.kernel``; ``SPECBLOCK_Q4_KERNEL`` picks one):

- ``int8`` (the default where the CPU has AVX512-VNNI): ours, ``runtime/q4_kernel.py``.
  Activations rounded to int8 per row and group of 32, exact integer dot products, fp32 scaling:
  llama.cpp's own arithmetic for this file, and the fastest (compiled T(1) 1.28x, T(8) 1.62x the
  fp32 kernel's: ``experiments/q4_int8.py``). Its rounding turns any last-bit difference before a
  linear into whole int8 steps (logit moves of a few tenths), so every other part of a row's
  forward is made the same bits in any tree, eager or compiled: the fused attention
  (``runtime/tree_attention.py``; an eager prompt included), and the RMSNorm and rotary of
  ``runtime/exact_parts.py``, which inductor would otherwise change. So it is **lossless like
  fp32** too: every method equals plain decoding token for token, eager and compiled, and compiled
  decoding equals eager decoding (``tests/test_exact_parts.py``, ``tests/test_q4.py``). Drafters
  beside a q4 target on it, and beside an eager packed-fp16 one, run their linears on it, from their
  own weights rounded to Q8_0 (``use_int8_linears``, ``drafters.pack_for`` and ``wants_int8``).
- ``fp32`` (where AVX512 is there but VNNI is not): ours too. fp32 activations and sums, the
  exact Q4_1 weights ``d * q + m``, every output computed by the same operations whatever the rows
  of the call: lossless like fp32 (``tests/test_q4.py``). It is another rounding of the same
  model than int8's (top-1 agreement 97% over the bench's chat prompts, ``experiments/q4_int8.py``).
- ``bf16``: torch's ``_weight_int4pack_mm_for_cpu`` (where ours cannot run, or with
  ``SPECBLOCK_Q4_KERNEL=bf16``). It computes ``(q - 8) * scale + zero`` with bf16 ``scale = d``
  and ``zero = m + 8 d``, rounds its input to bf16 and returns bf16. Its rows are independent
  too, but the fp32 parts around it (attention, norms) differ by about 1e-5 between tree sizes and
  bf16 rounding turns that into logit moves of a few tenths (``experiments/q4_rows.py``): lossless
  only like bf16, so speculative methods part from plain decoding at near-ties.

Either way every method, plain decoding included, runs the same q4 model and is compared with that
model's own greedy decoding. The rest of the model (norms, attention, residuals) computes in fp32,
as at packed-fp16. The LM head, which the GGUF keeps as Q8_0, runs from those 8-bit values in the
same kernel (``Int8Linear``: about half an fp16 head's bytes; with our kernels only); with a tied
embedding, the embedding rows take the same exact values, so the q4 model is the GGUF's model. Any
other linear the file does not hold is packed fp16.

Where the weights come from: ``models/convert.py`` writes ``q4_1.safetensors`` (``specblock/q4file.py``)
beside the converted checkpoint when it builds a named model from its GGUF.

``packed-q4`` (``PACKED_Q4``) reads the same file for another model: the bf16 checkpoint itself. The
converter rounded each ``d * q + m`` (each ``d * q`` of the head) to bf16, so the fp32 kernel, told
to (``bf16``), rounds each weight the same way after decoding it and multiplies by exactly the
checkpoint's values, with fp32 sums: the float32 model's arithmetic up to the order of its sums,
at q4's bytes. A checkpoint that is not that rounding (any model not converted from its GGUF, or a
bf16 release) is refused at load, where each linear's first rows are compared.

``packed-q4-amx`` (``PACKED_Q4_AMX``) multiplies by the same checkpoint values (the same check at
load) but rounds the activations to bf16 and sums in fp32 on AMX tiles (``q4_amx.cpp``): the
arithmetic of a bf16 matmul (HF's bfloat16 linears do the same), so another model than packed-q4's,
compared with its own greedy decoding. Why: the fp32 kernels pay each row of a call in
multiply-adds, so a tree of 8 cost about twice one token (``compiled_speed_packed_q4_s67.md``); a tile
multiply takes up to 16 rows at the cost of one, and decoding the weights is paid once per call
(``experiments/results/compiled_speed_amx_s68.md``). On a CPU with AVX512-BF16 but no tiles (AMD Zen 4
and 5) the same products run on VDPBF16PS, one instruction per 32 multiply-adds where the fp32 kernel
takes two FMAs, each weight decoded once per pass of up to 8 rows (stop 69); its sums run in
another order than the tiles', so there it is that kernel's own model, held to its own greedy decoding.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from specblock.errors import SpecBlockError
from specblock.q4file import GROUP, Q4_FILE, dequantize_q4_1, dequantize_q8_0, quantize_q4_1, quantize_q8_0, unpack_nibbles
from specblock.runtime import q4_kernel

Q4 = "q4"
#: The bf16 checkpoint's own weights read from the 4-bit codes they were dequantized from (see
#: ``use_q4_linears``'s ``bf16``): the fp32 kernel, each weight rounded to bf16 as the converter did.
PACKED_Q4 = "packed-q4"
#: The same weights times bf16 activations on AMX tiles (``use_q4_linears``'s ``kernel="amx"``).
PACKED_Q4_AMX = "packed-q4-amx"
KERNELS = ("int8", "fp32", "bf16", "amx")
OURS = ("int8", "fp32", "amx")  # the kernels of ``runtime/q4_kernel.py``


def default_kernel() -> str:
    """``SPECBLOCK_Q4_KERNEL`` if set; else ours: int8 where the CPU has AVX512-VNNI, fp32 where
    it has AVX512; else torch's (``q4_kernel.load`` warns once why)."""
    asked = q4_kernel.asked_kernel()
    if asked:
        q4_kernels = [k for k in KERNELS if k != "amx"]  # amx runs packed-q4-amx's bf16 weights only: a dtype of its own
        if asked not in q4_kernels:
            hint = "; for AMX use --dtype packed-q4-amx" if asked == "amx" else ""
            raise SpecBlockError(f"SPECBLOCK_Q4_KERNEL={asked} is no q4 kernel; choose one of {', '.join(q4_kernels)}{hint}")
        if asked in OURS and not q4_kernel.load():
            raise SpecBlockError(f"SPECBLOCK_Q4_KERNEL={asked}: our kernels cannot run here (see the warning above); use bf16")
        if asked == "int8" and not q4_kernel.vnni_supports():
            raise SpecBlockError("SPECBLOCK_Q4_KERNEL=int8 needs AVX512-VNNI, which this CPU lacks; use fp32 or bf16")
        return asked
    if not q4_kernel.load():
        return "bf16"
    return "int8" if q4_kernel.vnni_supports() else "fp32"


def available() -> bool:
    """torch's int4 kernel, the fallback every x86 torch has (ours needs AVX512 besides)."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


def fits(out_features: int, in_features: int) -> bool:
    """The kernel's shape rules: whole groups along the input, rows in multiples of 16."""
    return in_features % GROUP == 0 and out_features % 16 == 0


def keyed_q4(model: nn.Module) -> bool:
    """Whether ``model`` has linears on our q4 kernels (which a compiled graph calls by key)."""
    return any(isinstance(m, _OursLinear) for m in model.modules())


class _OursLinear(nn.Module):
    """What a linear on our kernel shares: its weights (``_q4``: ``qb``, ``dm``) kept under a key
    for compiled graphs, the forward, copies and the bytes a forward reads. ``kernel`` is "fp32"
    (ours) unless a subclass runs another."""

    kernel = "fp32"
    bf16 = False  # weights rounded to bf16 in the kernel (--dtype packed-q4; fp32 kernel only)
    out_features: int
    _q4: tuple[torch.Tensor, torch.Tensor]

    def _ours(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float()
        if torch.compiler.is_compiling():  # by key: 2 x 211 weight tensors as graph inputs cost 1.4 ms of guards a call
            y = q4_kernel.linear_key(x2, self._key, self.out_features)
        elif self.kernel == "int8":
            y = q4_kernel.linear8(x2, *self._q4)
        elif self.kernel == "amx":
            y = q4_kernel.linear_amx(x2, *self._q4)
        else:
            y = q4_kernel.linear(x2, *self._q4, self.bf16)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def _register(self) -> None:
        self._key = q4_kernel.register(self._q4, self, bf16=self.bf16, amx=self.kernel == "amx")

    def __setstate__(self, state: dict) -> None:
        """A copy (deepcopy, pickle) gets a key of its own, as ``PackedLinear``'s does; one without
        the weights (dynamo's saved guards leave tensors out) registers nothing."""
        super().__setstate__(state)
        if self.kernel in OURS and isinstance(getattr(self, "_q4", None), tuple) \
                and all(isinstance(t, torch.Tensor) for t in self._q4):
            self._register()

    def nbytes(self) -> int:
        """Bytes a forward reads: the kernel's own weights (quantized values, scales and offsets)."""
        return sum(t.numel() * t.element_size() for t in self._q4)


class Int4Linear(_OursLinear):
    """An ``nn.Linear`` whose forward runs an int4 kernel on Q4_1 weights (``kernel``: see the
    module docstring).

    ``weight`` (the checkpoint's, fp32, frozen) stays for code that reads weights; the forward
    reads only the kernel's own weights (``_q4``, kept by key for compiled graphs; or the
    ``qweight``/``scale_zero`` buffers of torch's kernel)."""

    def __init__(self, lin: nn.Linear, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor, kernel: str | None = None,
                 bf16: bool = False) -> None:
        super().__init__()
        n, k = lin.out_features, lin.in_features
        if lin.bias is not None:
            raise SpecBlockError(f"--dtype {Q4} has no bias term; this model's linears have biases: use packed-fp16")
        if tuple(qs.shape) != (n, k // 2) or tuple(d.shape) != (n, k // GROUP) or tuple(m.shape) != (n, k // GROUP):
            raise SpecBlockError(f"Q4_1 weights of shape {tuple(qs.shape)} do not fit a {k} -> {n} linear")
        if not fits(n, k):
            raise SpecBlockError(f"a {k} -> {n} linear does not fit the int4 kernels (inputs in groups of 32, rows in 16s)")
        self.in_features, self.out_features = k, n
        self.weight = lin.weight
        self.kernel = kernel or default_kernel()
        if self.kernel not in KERNELS:
            raise SpecBlockError(f"unknown q4 kernel {self.kernel!r}; choose one of {', '.join(KERNELS)}")
        if bf16 != (self.kernel == "amx") and self.kernel != "fp32":
            raise SpecBlockError(f"bf16-rounded Q4_1 weights run on the fp32 kernel or the amx one, which takes only those "
                                 f"(kernel {self.kernel!r}, bf16={bf16})")
        self.bf16 = bf16
        if self.kernel in OURS:
            if not q4_kernel.load() or (self.kernel == "int8" and not q4_kernel.vnni_supports()) \
                    or (self.kernel == "amx" and not q4_kernel.amx_supports()):
                raise SpecBlockError(f"the {self.kernel} q4 kernel cannot run here; use kernel='bf16'")
            # not buffers, see _ours: (qb, dm) for fp32 and amx, (w,) for int8
            self._q4 = (q4_kernel.layout8(qs, d, m),) if self.kernel == "int8" else q4_kernel.layout(qs, d, m)
            if self.kernel == "amx":
                self._q4 = q4_kernel.layout_amx(*self._q4)
            self._register()
            return
        self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_nibbles(qs), 1),
                             persistent=False)
        d32, m32 = d.float(), m.float()
        self.register_buffer("scale_zero", torch.stack([d32, m32 + 8 * d32], -1).transpose(0, 1).contiguous().bfloat16(),
                             persistent=False)  # [K/32, N, 2], the kernel's layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel in OURS:
            return self._ours(x)
        shape = x.shape
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, shape[-1]).to(torch.bfloat16), self.qweight, GROUP,
                                                       self.scale_zero)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def nbytes(self) -> int:
        if self.kernel in OURS:
            return super().nbytes()
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scale_zero))

    def extra_repr(self) -> str:
        rounded = ", rounded to bf16" if self.bf16 else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 q4_1{rounded}, {self.kernel} kernel"


class Int8Linear(_OursLinear):
    """An ``nn.Linear`` on Q8_0 weights (``d * q``) in our kernels (``kernel``: "int8" or "fp32"):
    the GGUF's LM head. ``weight`` stays for code that reads weights (drafters copy the target's
    head), holding the same exact values the kernel multiplies by."""

    def __init__(self, lin: nn.Linear, q: torch.Tensor, d: torch.Tensor, kernel: str = "fp32", bf16: bool = False) -> None:
        super().__init__()
        n, k = lin.out_features, lin.in_features
        if lin.bias is not None:
            raise SpecBlockError(f"--dtype {Q4} has no bias term; this model's head has one: use packed-fp16")
        if tuple(q.shape) != (n, k) or tuple(d.shape) != (n, k // GROUP) or not fits(n, k):
            raise SpecBlockError(f"Q8_0 weights of shape {tuple(q.shape)} do not fit a {k} -> {n} linear")
        self.in_features, self.out_features = k, n
        if kernel not in OURS:
            raise SpecBlockError(f"a Q8_0 head runs on our kernels ({', '.join(OURS)}), not {kernel!r}")
        if bf16 != (kernel == "amx") and kernel != "fp32":
            raise SpecBlockError(f"bf16-rounded Q8_0 weights run on the fp32 kernel or the amx one, which takes only those "
                                 f"(kernel {kernel!r}, bf16={bf16})")
        self.kernel, self.bf16 = kernel, bf16
        self.weight = lin.weight
        with torch.no_grad():  # the values the kernel multiplies by (and a tied embedding with them)
            self.weight.copy_(self._values(q, d))
        self._q4 = self._layout(q, d)
        self._register()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._ours(x)

    def repack(self) -> None:
        """Round ``weight`` to Q8_0 again after it changed (an adapting drafter's update) and keep
        the new values under the same key, so compiled graphs that name it read them too."""
        q, d = quantize_q8_0(self.weight)
        with torch.no_grad():
            self.weight.copy_(self._values(q, d))
        self._q4 = self._layout(q, d)
        q4_kernel.register(self._q4, self, self._key, bf16=self.bf16, amx=self.kernel == "amx")

    def _values(self, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """``d * q`` (exact in fp32), rounded to bf16 where the kernel rounds it."""
        w = dequantize_q8_0(q, d)
        return w.bfloat16().float() if self.bf16 else w

    def _layout(self, q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The kernel's weights: the fp32 kernel's ``(qb, dm)`` (the amx kernel's from them) or the int8 kernel's ``(w,)``."""
        if self.kernel == "int8":
            return (q4_kernel.layout8_q8(q, d),)
        qb_dm = q4_kernel.layout_q8(q, d)
        return q4_kernel.layout_amx(*qb_dm) if self.kernel == "amx" else qb_dm

    def extra_repr(self) -> str:
        rounded = ", rounded to bf16" if self.bf16 else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 q8_0{rounded}, {self.kernel} kernel"


def rounds_activations(model: nn.Module) -> bool:
    """Whether ``model``'s q4 linears round their inputs (int8, or bf16 on AMX): then a last-bit
    difference before a linear can become a whole step, so every other part of a row's forward must
    be the same bits in any tree (``exact_parts.py``)."""
    return any(isinstance(m, Int4Linear) and m.kernel in ("int8", "amx") for m in model.modules())


def use_int8_linears(model: nn.Module, bits: int = 8) -> int:
    """Replace each bias-free ``nn.Linear`` of an fp32 CPU model that fits the kernel by an
    ``Int8Linear`` on its own weights rounded to Q8_0 (the int8 kernel); returns how many.

    For drafters beside a packed target (``drafters.pack_for``): a drafter's forward is a dozen linears over a
    few rows, where packed fp16's fbgemm call costs several times the int8 kernel's
    (``experiments/drafter_linears.py``). Only the drafts move (Q8_0 rounding: about 0.4% of a
    weight group's largest value); verification, and so the output, is the target's. Each module
    gets its own copy of the weight: a drafter's linear may share storage with the target's
    tensors, which the rounding must not touch. ``bits=4``: Q4_1 instead (half the bytes, coarser)."""
    if bits not in (4, 8):
        raise SpecBlockError(f"drafter linears take 4 or 8 bits, not {bits}")
    if not (q4_kernel.load() and q4_kernel.vnni_supports()):
        raise SpecBlockError("int8 linears need our q4 kernels and AVX512-VNNI; pack the drafter instead")
    found = [(mod, name, child) for mod in list(model.modules()) for name, child in mod.named_children()
             if type(child) is nn.Linear and child.bias is None and fits(child.out_features, child.in_features)
             and child.weight.dtype == torch.float32 and child.weight.device.type == "cpu"]
    for mod, name, child in found:
        lin = nn.Linear(child.in_features, child.out_features, bias=False, device="meta")
        lin.weight = nn.Parameter(child.weight.detach().clone(), requires_grad=False)
        setattr(mod, name, Int8Linear(lin, *quantize_q8_0(lin.weight), kernel="int8") if bits == 8
                else Int4Linear(lin, *quantize_q4_1(lin.weight), kernel="int8"))
    return len(found)


def use_q4_linears(model: nn.Module, path: Path, kernel: str | None = None, bf16: bool = False,
                   check: bool = False) -> int:
    """Replace each ``nn.Linear`` of an fp32 CPU model that ``path/q4_1.safetensors`` holds; returns
    how many. ``kernel`` None: :func:`default_kernel`.

    ``check`` (``--dtype auto``'s q4): the codes are checked against the checkpoint as ``bf16``'s are,
    and the int8 kernel is required, so that auto serves a model's own Q4_1 weights on the kernel it
    was measured on, or refuses before any linear is replaced (auto then takes packed fp16). An
    explicit ``--dtype q4`` serves whatever codes the file holds, on ``default_kernel``'s kernel.

    ``bf16`` (``--dtype packed-q4``): the model keeps its checkpoint's weights, bit for bit. Where the
    checkpoint is the GGUF's dequantization rounded to bf16 (``models/convert.py``), each weight is
    ``bf16(d * q + m)`` (``bf16(d * q)`` for the head), so the fp32 kernel reads the 4-bit codes and
    rounds each weight as the converter did: the bytes of q4, the values of the checkpoint, fp32
    arithmetic. Each linear's first rows are checked against the checkpoint at load (a file that
    does not match is refused: use packed-fp16). ``kernel="amx"`` with ``bf16`` (``--dtype
    packed-q4-amx``): the same weights times bf16 activations on AMX tiles (AVX512-BF16 dot products
    on a CPU without them)."""
    from safetensors import safe_open

    amx = kernel == "amx"
    dtype_name = PACKED_Q4_AMX if amx else PACKED_Q4 if bf16 else Q4
    if amx and not bf16:
        raise SpecBlockError("the amx q4 kernel runs bf16-rounded weights (--dtype packed-q4-amx) only")
    if bf16:
        if kernel not in (None, "fp32", "amx"):
            raise SpecBlockError(f"--dtype {PACKED_Q4} runs on the fp32 q4 kernel, not {kernel!r}")
        kernel = kernel or "fp32"
        if q4_kernel.torch_asked():  # it keeps our library from loading in this process
            raise SpecBlockError(f"--dtype {dtype_name} runs on our {kernel} q4 kernel, and SPECBLOCK_Q4_KERNEL=bf16 asks "
                                 "for torch's (a --dtype q4 setting): unset it")
        if not q4_kernel.load():
            raise SpecBlockError(f"--dtype {dtype_name} needs our q4 kernel (AVX512F/BW, a C++ compiler); use packed-fp16")
        if amx and not q4_kernel.amx_supports():
            raise SpecBlockError(f"--dtype {PACKED_Q4_AMX} needs AMX-BF16 or AVX512-BF16 (Intel Xeon from Cooper Lake on, "
                                 f"AMD from Zen 4 on), which this CPU lacks; use {PACKED_Q4}")
    elif check:
        kernel = kernel or default_kernel()
        if kernel != "int8":
            raise SpecBlockError(f"--dtype auto's {Q4} runs on our int8 kernel (AVX512-VNNI, a C++ compiler), which "
                                 f"cannot run here; use {PACKED_Q4_AMX}")
    elif not available():
        raise SpecBlockError(f"--dtype {Q4} needs torch's CPU int4 kernel (torch >= 2.6); use packed-fp16")
    f = Path(path) / Q4_FILE
    if not f.is_file():
        raise SpecBlockError(f"{path} has no {Q4_FILE} (--dtype {dtype_name} reads a model's own Q4_1 GGUF weights; "
                             "`python -m specblock.runtime models --build NAME` writes it for a named model); use packed-fp16")
    p = next(model.parameters())
    if p.device.type != "cpu" or p.dtype != torch.float32:
        raise SpecBlockError(f"--dtype {dtype_name} runs on an fp32 CPU model (loaded as {p.dtype} on {p.device.type}); use bfloat16 on CUDA")
    kernel = kernel or default_kernel()
    with safe_open(str(f), framework="pt") as st:
        names = {k.rsplit(".", 1)[0] for k in st.keys() if k.endswith(".qs")}
        q8 = {k.rsplit(".", 1)[0] for k in st.keys() if k.endswith(".q8")} if kernel in OURS else set()
        mods = dict(model.named_modules())
        unknown = sorted(n for n in names | q8 if not isinstance(mods.get(n), nn.Linear))
        if unknown:
            raise SpecBlockError(f"{f} holds weights for {unknown[0]}, which is no linear of this model "
                                 f"({len(unknown)} such); rebuild the model or use packed-fp16")
        # Every check before any replacement: a refused file leaves the float32 model as it was (so
        # --dtype auto can take it as packed fp16 instead).
        q4s = {n: (st.get_tensor(f"{n}.qs"), st.get_tensor(f"{n}.d"), st.get_tensor(f"{n}.m")) for n in sorted(names)}
        q8s = {n: (st.get_tensor(f"{n}.q8"), st.get_tensor(f"{n}.d8")) for n in sorted(q8)}  # torch's int4 kernel has no Q8_0
    if bf16 or check:
        for name, (qs, d, m) in q4s.items():
            _check_rounding(name, dequantize_q4_1(qs[:CHECK_ROWS], d[:CHECK_ROWS], m[:CHECK_ROWS]), mods[name].weight, f)
        for name, (q, d) in q8s.items():
            _check_rounding(name, dequantize_q8_0(q[:CHECK_ROWS], d[:CHECK_ROWS]), mods[name].weight, f)
    for name, (qs, d, m) in q4s.items():
        owner, attr, lin = _frozen_linear(model, mods, name)
        setattr(owner, attr, Int4Linear(lin, qs, d, m, kernel, bf16=bf16))
    for name, (q, d) in q8s.items():  # the head stays packed fp16 where these are none
        owner, attr, lin = _frozen_linear(model, mods, name)
        setattr(owner, attr, Int8Linear(lin, q, d, kernel, bf16=bf16))
    return len(names) + len(q8)


def _frozen_linear(model: nn.Module, mods: dict[str, nn.Module], name: str) -> tuple[nn.Module, str, nn.Linear]:
    """The linear ``name`` (its weight frozen), its parent and its attribute there, to replace it."""
    parent, _, attr = name.rpartition(".")
    owner = mods[parent] if parent else model
    lin = getattr(owner, attr)
    lin.weight.requires_grad_(False)
    return owner, attr, lin


#: Rows of each linear ``packed-q4`` checks against the checkpoint at load (a wrong file differs from
#: its first rows on; every row would dequantize the whole model at each load).
#: ``tests/test_real_model.py`` checks every weight of the real model's file.
CHECK_ROWS = 16


def _check_rounding(name: str, values: torch.Tensor, weight: torch.Tensor, f: Path) -> None:
    if not torch.equal(values.bfloat16().float(), weight[:values.shape[0]]):
        raise SpecBlockError(f"{f}: {name}'s 4-bit weights rounded to bf16 are not this checkpoint's "
                             f"(--dtype {PACKED_Q4}, {PACKED_Q4_AMX} and auto's {Q4} need the checkpoint a Q4_1 GGUF was converted to); use packed-fp16")
