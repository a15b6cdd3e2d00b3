"""The target: one adapter over any HF ``AutoModelForCausalLM``, no forked modeling files.

It owns the KV cache and knows three moves: prefill a prompt, run one tree forward (a float
additive 4D mask plus explicit position ids: the only way HF's sdpa/eager paths honour a tree),
and commit, which prunes the cache to the accepted path with one gather per layer.

Hidden-state taps: EAGLE-3 fuses the hidden states *entering* layers 2, L//2 and L-3. For models
shallower than 8 layers those collide (6 layers: 2, 3, 3), so there we spread them to 1, L//2,
L-1 (our choice). ``hidden_states[i]`` of HF's output is the input of layer i.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, PreTrainedModel

from specblock.errors import SpecBlockError
from specblock.policies.tree import DraftTree
from specblock.runtime import exact_parts, shared_input
from specblock.runtime.attention import attention_layout, tree_masks
from specblock.runtime.grouped_rows import use_grouped_rows
from specblock.runtime.packed import PACKED_FP16, PackedLinear, pack_linears
from specblock.runtime.packed import available as packed_available
from specblock.runtime.q4 import PACKED_Q4, PACKED_Q4_AMX, Q4, Int4Linear, Int8Linear, rounds_activations, use_q4_linears

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
#: What every ``--dtype`` flag offers; packed-fp16 (CPU: fp16 weights packed for fbgemm, fp32
#: arithmetic) loads in float32 and then packs its linears (``runtime.packed``); q4 (CPU: the
#: model's own Q4_1 GGUF weights in our kernels or torch's int4 kernel, the rest as packed-fp16; packed-q4 and
#: packed-q4-amx: the bf16 checkpoint's weights from those codes, fp32 or AMX arithmetic; ``runtime.q4``).
DTYPE_CHOICES = ("auto", "bfloat16", "float32", PACKED_FP16, PACKED_Q4, PACKED_Q4_AMX, Q4)
#: The CPU formats: loaded in float32, then their linears replaced.
CPU_FORMATS = (PACKED_FP16, PACKED_Q4, PACKED_Q4_AMX, Q4)


def default_taps(num_layers: int) -> tuple[int, int, int]:
    if num_layers >= 8:
        return (2, num_layers // 2, num_layers - 3)
    return (min(1, num_layers - 1), num_layers // 2, max(num_layers - 1, 0))


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SpecBlockError("--device cuda asked for, but torch sees no CUDA device; use --device cpu")
    return torch.device(device)


def native_bf16(device: torch.device) -> bool:
    """Whether bf16 matrix products run at full speed here: on CUDA, and on CPUs with bf16
    instructions (AVX512-BF16 / AMX). On an AVX2-only CPU oneDNN has no bf16 kernel and a
    2048x576x1536 product ran ~50x slower in bf16 than in fp32 (0.4 against 20 GFLOP/s, 1 thread)."""
    if device.type == "cuda":
        return True
    return device.type == "cpu" and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


#: The one line every ``--dtype`` help prints: what ``auto`` picks and why.
DTYPE_HELP = (f"auto (default): for models converted from a Q4_1 GGUF {PACKED_Q4_AMX} on CPUs with AMX tiles, {Q4} on CPUs "
              f"with AVX512-BF16 and VNNI but no tiles (AMD Zen 4/5), {PACKED_Q4_AMX} on other CPUs with AVX512-BF16, {PACKED_Q4} on other CPUs with AVX512; else "
              f"{PACKED_FP16} (fp16 weights packed for fbgemm, fp32 arithmetic) on x86 CPUs, "
              f"bfloat16 on CUDA and elsewhere (calibrate); {PACKED_Q4}: the bf16 checkpoint's weights read from the "
              f"4-bit codes it was converted from (CPU with AVX512, named models); {PACKED_Q4_AMX}: the same times bf16 activations on AMX tiles (flat tree cost; CPU with AMX-BF16) or AVX512-BF16 dot products; {Q4}: the model's own 4-bit GGUF weights (CPU, named models)")


def resolve_dtype(name: str, device: str | torch.device = "auto", target: str | Path | None = None) -> str:
    """The target's dtype name, ``auto`` resolved (the one place it is). Explicit names pass as is.

    ``auto`` is packed-q4-amx on a CPU with AMX tiles for a ``target`` (a model name or a directory;
    None where the caller does not know it) that comes with its checkpoint's 4-bit codes
    (``models.registry.has_q4_codes``): ``make run``'s command ran 1.54x packed fp16's tokens/s and
    trees are nearly flat (stop 68, ``dtype_ab_s68.md``, ``target_speed_amx_s68.md``). On a CPU with
    AVX512-BF16 and VNNI but no tiles (AMD Zen 4 and 5) it is q4 since stop 74: the same codes on the
    int8 kernel (llama.cpp's arithmetic for a Q4_1 model), checked against the checkpoint at load as
    packed-q4's are. There T(1) / T(4) / T(8) were 8.7 / 9.5 / 10.3 ms against packed-q4-amx's 9.7 /
    11.1 / 14.7 on dot products (``latency_smollm2_zen5_q4_s74.json``, ``..._packed_q4_amx_s74.json``),
    and ``make run``'s command ran 131.1 against 115.7 tokens/s eager (EAGLE-3 with lookup's branch at
    both) and 220.3 against 207.1 compiled, each with its measured method (``dtype_ab_zen5_q4_final_s74.md``,
    ``dtype_ab_zen5_q4_compiled_s74.md``). Stop 69
    had chosen packed-q4-amx there when q4 had no measured method yet (``auto`` ran prompt lookup at q4
    then). For such a
    target on a CPU with AVX512 but not BF16, packed-q4: the checkpoint's weights in fp32 arithmetic,
    ``make run``'s command faster than at packed fp16 (AMD Zen 5 126.6 against 115.3 tokens/s eager and
    209.0 against 152.0 compiled, ``dtype_ab_zen5_s69.md``, ``dtype_ab_zen5_compiled_s69.md``; Intel Xeon
    61.7 against 48.6, ``dtype_ab_s68.md``). Else packed-fp16 on a CPU where torch has fbgemm (x86),
    bfloat16 elsewhere (CUDA, ARM). Callers that resolve ``auto`` without a target get
    packed-fp16 there; the ones that know it (the CLI's session, the config's ``--method auto``, bench,
    calibrate) pass it, so they agree with the load.
    Measured with ``experiments/target_speed.py`` (SmolLM2-135M, 2 threads): on an AVX2 CPU without
    native bf16, bf16 trees are emulated (T(16) = 6-7 x T(1)) and packed fp16's T(1) was below
    bf16's too; on a CPU with AMX (native bf16, ``target_speed_amx.md``) bf16 trees are nearly flat,
    but packed fp16 was as fast or faster up to 8 tree tokens (T(1) 28.5 against 38.3 ms), the sizes the
    shipped drafters serve, and the shipped drafters' records are measured at packed-fp16."""
    if name == "auto":
        dev = resolve_device(device) if isinstance(device, str) else device
        if dev.type == "cpu" and target is not None and (q4 := _q4_for(target)):
            return q4
        if dev.type == "cpu" and packed_available():
            return PACKED_FP16
        return "bfloat16"
    if name not in DTYPES and name not in CPU_FORMATS:
        raise SpecBlockError(f"unknown dtype {name!r}; use one of {', '.join(DTYPE_CHOICES)}")
    return name


def _q4_for(target: str | Path) -> str | None:
    """auto's choice for a target with its checkpoint's 4-bit codes, by the CPU's flags alone (nothing
    is built here): packed-q4-amx with AMX tiles, q4 with AVX512-BF16 and VNNI but no tiles (where the
    int8 kernel would run: ``SPECBLOCK_Q4_KERNEL`` unset or int8), packed-q4-amx with AVX512-BF16
    otherwise, packed-q4 with AVX512; None without the codes or any of these."""
    from specblock.models.registry import has_q4_codes
    from specblock.runtime import q4_kernel

    if q4_kernel.amx_cpu():
        kind = Q4 if not q4_kernel.amx_tiles() and q4_kernel.int8_cpu() else PACKED_Q4_AMX
    elif q4_kernel.cpu_supports() and not q4_kernel.torch_asked():
        kind = PACKED_Q4
    else:
        return None
    return kind if has_q4_codes(target) else None


@dataclass
class TargetOutput:
    """What one target forward hands back, one row per processed position."""

    logits: torch.Tensor  # [N, V]
    top: torch.Tensor | None = None  # [N, h] final (post-norm) hidden state
    taps: torch.Tensor | None = None  # [N, len(taps) * h] low/mid/top features (EAGLE-3)

    def rows(self, idx: torch.Tensor | np.ndarray) -> "TargetOutput":
        idx = torch.as_tensor(idx, device=self.logits.device, dtype=torch.long)
        pick = lambda t: None if t is None else t.index_select(0, idx)
        return TargetOutput(self.logits.index_select(0, idx), pick(self.top), pick(self.taps))


def dtype_name_of(model: PreTrainedModel, dtype: torch.dtype) -> str:
    """The ``--dtype`` name a loaded model answers to: q4 and packed-fp16 by their linears, else the
    torch dtype's own name (``float32``, ``bfloat16``)."""
    ours = [m for m in model.modules() if isinstance(m, (Int4Linear, Int8Linear))]
    if ours:
        if all(m.kernel == "amx" for m in ours):
            return PACKED_Q4_AMX
        return PACKED_Q4 if all(m.bf16 for m in ours) else Q4
    kinds = {type(m) for m in model.modules()}
    if PackedLinear in kinds:
        return PACKED_FP16
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class LoadSource:
    """How a target was loaded (``TargetModel.load``'s arguments): what another process needs to
    load the same model (``compiled/warm_helpers.py`` compiles tree sizes there)."""

    path: str
    dtype: str
    device: str
    attn: str
    trust_remote_code: bool


class TargetModel:
    """A causal LM plus its KV cache, driven one tree at a time (batch size 1)."""

    def __init__(self, model: PreTrainedModel, tap_layers: tuple[int, ...] | None = None) -> None:
        impl = getattr(model.config, "_attn_implementation", "sdpa") or "sdpa"
        if impl.startswith("flash"):
            raise SpecBlockError(
                f"attention '{impl}' ignores tree masks; load the target with attn_implementation='sdpa' or 'eager'"
            )
        self.layout = attention_layout(model)  # full and/or sliding-window layers (runtime/attention.py)
        # CPU SDPA with grouped key/value heads: a tree's rows fold onto the key/value heads instead
        # of copying the keys per query head (runtime/grouped_rows.py; the same logits)
        self.grouped_rows = use_grouped_rows(model)
        self.model = model.eval()
        self.config = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        # --dtype's name for what the model holds (serving.json's per-dtype settings key on it)
        self.dtype_name = dtype_name_of(model, self.dtype)
        # --dtype packed-fp16, packed-q4, packed-q4-amx or q4 (compact weights): drafters are packed beside it
        self.packed = self.dtype_name in CPU_FORMATS
        self.compiled = False  # a compiled target (specblock/compiled) says True
        # Trained drafters run in this dtype: the target's where bf16 is native, else fp32 (their
        # weights are small, and on an AVX2 CPU a bf16 linear ran 1.7x slower than fp32 at 1 row
        # and 3.5-6x at 8-256 rows). Verification by the target keeps the output lossless either way.
        # Beside a bf16 CPU target, drafters.build loads them in fp32 for the int8 kernel where it runs.
        self.drafter_dtype = self.dtype if self.dtype != torch.bfloat16 or native_bf16(self.device) else torch.float32
        n_layers = int(self.config.num_hidden_layers)
        self.tap_layers = tuple(tap_layers) if tap_layers is not None else default_taps(n_layers)
        if any(not 0 <= t <= n_layers for t in self.tap_layers):
            raise SpecBlockError(f"tap layers {self.tap_layers} outside 0..{n_layers}")
        self.want_features = False  # set by the engine when the drafter reads taps/top states
        self.max_context = int(getattr(self.config, "max_position_embeddings", 1 << 30))
        self.vocab_size = int(self.config.vocab_size)
        self.hidden_size = int(self.config.hidden_size)
        self.cache: DynamicCache | None = None
        self.past_len = 0
        self._min = torch.finfo(self.dtype).min
        self.source: LoadSource | None = None  # set by ``load``; None for a model built in memory

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(
        cls,
        path: str | Path,
        dtype: str = "auto",
        device: str = "auto",
        attn: str = "sdpa",
        trust_remote_code: bool = False,
        tap_layers: tuple[int, ...] | None = None,
    ) -> "TargetModel":
        model = load_causal_lm(path, dtype, device, attn, trust_remote_code)
        target = cls(model, tap_layers)
        target.source = LoadSource(str(Path(path).resolve()), dtype, device, attn, trust_remote_code)
        return target

    # ------------------------------------------------------------------ forwards
    def reset(self) -> None:
        self.cache = self.layout.new_cache(self.config)
        self.past_len = 0

    @torch.no_grad()
    def prefill(self, ids: np.ndarray) -> TargetOutput | None:
        """Process committed tokens (all but the pending root). Returns per-position features
        when a drafter wants them; logits only for the last position."""
        self.reset()
        if len(ids) == 0:
            return None
        x = torch.as_tensor(np.asarray(ids), device=self.device, dtype=torch.long)[None]
        with exact_parts.rotary_op(self.model):  # HF's rotary application as one op, where prepared
            out = self.model(
                input_ids=x,
                past_key_values=self.cache,
                use_cache=True,
                output_hidden_states=self.want_features,
                logits_to_keep=1,
            )
        self.past_len = int(x.shape[1])
        return self._output(out)

    def tree_inputs(self, tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | dict | None]:
        """Token ids, position ids and the float additive 4D mask(s) for one tree forward (one per
        layer type when full and sliding-window layers mix)."""
        if self.past_len + tree.max_depth >= self.max_context:
            raise SpecBlockError("tree reaches past the model's context; the engine should have cut it")
        x = torch.as_tensor(tree.tokens, device=self.device)[None]
        pos = torch.as_tensor(tree.position_ids(self.past_len), device=self.device)[None]
        mask = None
        if tree.size > 1:  # a lone root is a plain next token: the model builds its own (windowed) mask
            mask = tree_masks(self.layout, tree, self.past_len, self.dtype, self.device)
        return x, pos, mask

    @torch.no_grad()
    def tree_forward(self, tree: DraftTree) -> TargetOutput:
        """One forward over every node of ``tree``; the root sits at position ``past_len``."""
        x, pos, mask = self.tree_inputs(tree)
        with exact_parts.rotary_op(self.model):
            out = self.model(
                input_ids=x,
                attention_mask=mask,
                position_ids=pos,
                past_key_values=self.cache,
                use_cache=True,
                output_hidden_states=self.want_features,
            )
        return self._output(out)

    def _output(self, out) -> TargetOutput:
        logits = out.logits[0]
        if not self.want_features:
            return TargetOutput(logits)
        hs = out.hidden_states
        taps = torch.cat([hs[i][0] for i in self.tap_layers], dim=-1)
        return TargetOutput(logits, top=hs[-1][0], taps=taps)

    @torch.no_grad()
    def commit(self, path: np.ndarray) -> None:
        """Keep the past plus the tree nodes on ``path`` (root first), drop the rest.

        The cache holds ``past_len + N`` entries after a tree forward. Path entries already in
        place (the prefix where ``path[i] == i``: the root, and the whole path of any chain) stay;
        the rest move to the front of the tree region with one gather per layer; then the tail is
        cut off.
        """
        assert self.cache is not None
        keep = len(path)
        path = np.asarray(path, dtype=np.int64)
        moved = np.nonzero(path != np.arange(keep))[0]
        end = self.past_len + keep
        if moved.size:
            first = self.past_len + int(moved[0])
            src = torch.as_tensor(path[moved[0]:] + self.past_len, device=self.device)
            for layer in self.cache.layers:
                layer.keys[..., first:end, :] = layer.keys.index_select(-2, src)
                layer.values[..., first:end, :] = layer.values.index_select(-2, src)
        for layer in self.cache.layers:
            layer.keys = layer.keys[..., :end, :]
            layer.values = layer.values[..., :end, :]
        self.past_len = end


def load_causal_lm(
    path: str | Path, dtype: str, device: str, attn: str, trust_remote_code: bool
) -> PreTrainedModel:
    """Load a local HF causal LM safely: safetensors only, no remote code unless asked."""
    path = Path(path)
    if not path.is_dir():
        raise SpecBlockError(f"no model directory at {path}; pass --target DIR holding config.json and *.safetensors")
    if not (path / "config.json").is_file():
        raise SpecBlockError(f"{path} has no config.json; is it a HuggingFace model directory?")
    if not any(path.glob("*.safetensors")):
        raise SpecBlockError(f"{path} has no *.safetensors weights (pickled checkpoints are refused); convert them first")
    asked, dtype = dtype, resolve_dtype(dtype, device, path)
    packed = dtype in CPU_FORMATS
    if packed and resolve_device(device).type != "cpu":
        raise SpecBlockError(f"--dtype {dtype} is a CPU format; on {resolve_device(device).type} use bfloat16")
    if attn not in ("sdpa", "eager"):
        raise SpecBlockError(f"attention {attn!r} cannot run tree masks; use sdpa or eager")
    parts = exact_parts.wanted_for(dtype)
    if parts:  # the norm op builds beside the load (exact_parts.py)
        exact_parts.start_building()
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - bad JSON, unknown model_type, sizes that do not fit, remote code
        raise SpecBlockError(f"cannot read {path}/config.json: {_first_line(e)}") from None
    archs = getattr(config, "architectures", None) or []
    if archs and not any(a.endswith("ForCausalLM") for a in archs):
        raise SpecBlockError(f"{path} holds a {archs[0]}, not a causal LM (…ForCausalLM)")
    read_generation_eos(path)  # a corrupt generation_config.json is refused before the weights load
    try:
        # Mismatched shapes are let through here only to be named below, with the missing and
        # unexpected weights that transformers would otherwise just log and initialise randomly.
        model, info = AutoModelForCausalLM.from_pretrained(
            path,
            config=config,
            dtype=torch.float32 if packed else DTYPES[dtype],
            attn_implementation=attn,
            use_safetensors=True,
            trust_remote_code=trust_remote_code,
            output_loading_info=True,
            ignore_mismatched_sizes=True,
        )
    except Exception as e:  # noqa: BLE001 - truncated or empty safetensors, unsupported architecture, ...
        if attn == "sdpa" and "scaled_dot_product_attention" in str(e):  # e.g. Gemma 2, gpt-oss
            raise SpecBlockError(f"{path}: transformers has no sdpa attention for {', '.join(archs) or 'this model'}; "
                                 "pass --attn eager") from None
        raise SpecBlockError(f"cannot load {path} as a causal LM: {_first_line(e)}") from None
    _check_loading(path, info)
    model = model.to(resolve_device(device))
    if dtype in (Q4, PACKED_Q4, PACKED_Q4_AMX):  # before packing: what the file does not hold is packed below
        try:
            use_q4_linears(model, path, kernel="amx" if dtype == PACKED_Q4_AMX else None, bf16=dtype != Q4,
                           check=asked == "auto")  # auto's q4 serves the codes only where they are the checkpoint's
        except SpecBlockError as e:
            if asked != "auto":
                raise
            # auto's choice: the file's first rows are checked before any linear is replaced, so the
            # model is still the plain float32 one, and packed fp16 takes it as is
            warnings.warn(f"specblock: --dtype auto falls back to {PACKED_FP16}: {e}", stacklevel=2)
            dtype = PACKED_FP16
    if rounds_activations(model):  # int8 / bf16 rounding turns inductor's last bits into steps: exact_parts.py
        exact_parts.use_exact_parts(model)
    elif parts and dtype != Q4:  # for speed: 6-11% off an eager forward (exact_parts.py, stop 62); q4 on fp32 keeps HF's
        exact_parts.use_exact_parts(model, prompts=False)
    if packed:
        pack_linears(model)
    if dtype == PACKED_FP16 and shared_input.wanted():  # q/k/v as one GEMM in eager forwards
        shared_input.share_inputs(model)
    return model


def _first_line(e: Exception) -> str:
    lines = [x.strip() for x in str(e).splitlines() if x.strip()] or [""]
    text = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]  # "validation error for ...:" says nothing alone
    return f"{type(e).__name__}: {text}"[:300]


def _check_loading(path: Path, info: dict) -> None:
    """Refuse a model whose weights do not fit its config: silently random tensors decode garbage
    with status 0 (issue 15: 30 layers of weights under a 32-layer config)."""
    from specblock.runtime.drafters.netio import name_keys

    problems = []
    if info.get("missing_keys"):
        problems.append(f"missing {name_keys(info['missing_keys'])}")
    if info.get("unexpected_keys"):
        problems.append(f"unexpected {name_keys(info['unexpected_keys'])}")
    if info.get("mismatched_keys"):
        k, got, want = sorted(info["mismatched_keys"])[0]
        more = len(info["mismatched_keys"]) - 1
        problems.append(f"{k} has shape {tuple(got)} but config.json says {tuple(want)}{f' ({more} more)' if more else ''}")
    if problems:
        raise SpecBlockError(f"the weights in {path} do not fit its config.json ({'; '.join(problems)}); "
                             "fix config.json or use the matching weights")


def read_generation_eos(path: str | Path) -> set[int]:
    """EOS ids from generation_config.json (falls back to config.json)."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        f = Path(path) / name
        if f.is_file():
            try:
                raw = json.loads(f.read_bytes())
                eos = raw.get("eos_token_id")
                eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
                if not all(isinstance(i, int) and not isinstance(i, bool) for i in eos):
                    raise ValueError(f"eos_token_id {raw.get('eos_token_id')!r} is not a token id or a list of them")
            except (ValueError, UnicodeDecodeError, AttributeError) as e:
                raise SpecBlockError(f"{f} is not a valid model config ({_first_line(e)}); fix or delete it") from None
            if eos:
                ids.update(eos)
                break
    return ids
