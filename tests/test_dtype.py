"""``--dtype auto``: packed-fp16 on CPUs with fbgemm (x86), native bf16 or not; bf16 elsewhere; for a
target with its checkpoint's 4-bit codes packed-q4-amx (AMX tiles, or AVX512-BF16 without VNNI), q4 (AVX512-BF16
and VNNI without tiles: the int8 kernel) or packed-q4 (AVX512); resolved in one place, recorded as resolved."""

import json

import pytest
import torch

from specblock.errors import SpecBlockError
from specblock.runtime import target as target_mod
from specblock.runtime.bench import build_parser as bench_parser
from specblock.runtime.cli import build_parser, main
from specblock.runtime.config import RunConfig
from specblock.runtime.target import TargetModel, resolve_dtype
from tiny import save_tiny

CPU = torch.device("cpu")


@pytest.mark.parametrize("native, fbgemm, want", [(True, True, "packed-fp16"), (False, True, "packed-fp16"),
                                                  (False, False, "bfloat16"), (True, False, "bfloat16")])
def test_auto_is_packed_fp16_where_fbgemm_is(monkeypatch, native, fbgemm, want):
    monkeypatch.setattr(target_mod, "native_bf16", lambda device: native)
    monkeypatch.setattr(target_mod, "packed_available", lambda: fbgemm)
    assert resolve_dtype("auto", CPU) == want
    assert resolve_dtype("auto", "cpu") == want  # a device name resolves the same way


def test_explicit_names_pass_through(monkeypatch):
    monkeypatch.setattr(target_mod, "native_bf16", lambda device: pytest.fail("an explicit dtype asked the hardware"))
    for name in ("bfloat16", "float32", "float16", "packed-fp16"):
        assert resolve_dtype(name, CPU) == name


def test_unknown_dtype_is_one_line():
    with pytest.raises(SpecBlockError) as e:
        resolve_dtype("fp8", CPU)
    msg = str(e.value)
    assert "\n" not in msg and "'fp8'" in msg and "auto" in msg


def test_auto_is_every_default():
    assert RunConfig().dtype == "auto"
    assert build_parser().parse_args([]).dtype == "auto"
    assert bench_parser().parse_args([]).dtype == "auto"


@pytest.mark.parametrize("fbgemm, want", [(False, torch.bfloat16), (True, torch.float32)])
def test_load_resolves_auto(tmp_path, monkeypatch, fbgemm, want):
    save_tiny(tmp_path / "t", "llama", vocab=32)
    monkeypatch.setattr(target_mod, "native_bf16", lambda device: True)
    monkeypatch.setattr(target_mod, "packed_available", lambda: fbgemm)
    target = TargetModel.load(tmp_path / "t", "auto", "cpu")
    assert target.dtype == want  # packed-fp16 computes in fp32
    assert (type(target.model.lm_head).__name__ == "PackedLinear") == fbgemm


def test_bench_records_resolved_dtype(tmp_path, monkeypatch):
    save_tiny(tmp_path / "t", "llama", vocab=96, ctx=2048)
    monkeypatch.setattr(target_mod, "packed_available", lambda: False)  # auto is bf16 then
    out = tmp_path / "bench"
    assert main(["bench", "--target", str(tmp_path / "t"), "--methods", "lookup", "--domains", "code",
                 "--prompts", "1", "--max-new-tokens", "4", "--runs", "1", "--out", str(out)]) == 0
    assert json.loads(out.with_suffix(".json").read_text())["config"]["dtype"] == "bfloat16"


def test_auto_is_packed_q4_amx_q4_or_packed_q4_for_a_target_with_its_codes(tmp_path, monkeypatch):
    from specblock.runtime import q4_kernel
    from tiny import save_tiny_packed_q4

    with_codes = save_tiny_packed_q4(tmp_path / "q", layers=1)
    plain = save_tiny(tmp_path / "t", "llama", vocab=32)
    monkeypatch.setattr(target_mod, "packed_available", lambda: True)
    monkeypatch.setattr(q4_kernel, "amx_cpu", lambda: True)
    monkeypatch.setattr(q4_kernel, "amx_tiles", lambda: True)  # AMX tiles: packed-q4-amx, VNNI or not
    monkeypatch.setattr(q4_kernel, "vnni_supports", lambda: True)
    assert resolve_dtype("auto", CPU, with_codes) == "packed-q4-amx"
    assert resolve_dtype("auto", CPU, "smollm2-135m-instruct") == "packed-q4-amx"  # built from its Q4_1 GGUF, built or not
    assert resolve_dtype("auto", CPU, plain) == resolve_dtype("auto", CPU, "lab") == "packed-fp16"
    assert resolve_dtype("auto", CPU) == "packed-fp16"  # a caller that does not know the target
    assert resolve_dtype("packed-fp16", CPU, with_codes) == "packed-fp16"  # an explicit name stays
    assert RunConfig(target=str(with_codes), method="auto").method == "lookup"  # no best.json: auto's record looked up, none
    monkeypatch.setattr(q4_kernel, "amx_tiles", lambda: False)  # AVX512-BF16 and VNNI without tiles (Zen 4/5): q4
    assert resolve_dtype("auto", CPU, with_codes) == resolve_dtype("auto", CPU, "smollm2-135m-instruct") == "q4"
    assert resolve_dtype("auto", CPU, plain) == "packed-fp16"
    monkeypatch.setenv("SPECBLOCK_Q4_KERNEL", "fp32")  # q4 would not run on the int8 kernel: packed-q4-amx again
    assert resolve_dtype("auto", CPU, with_codes) == "packed-q4-amx"
    monkeypatch.setenv("SPECBLOCK_Q4_KERNEL", "int8")
    assert resolve_dtype("auto", CPU, with_codes) == "q4"
    monkeypatch.setenv("SPECBLOCK_Q4_KERNEL", "")  # empty is unset, as q4.default_kernel reads it: the int8 kernel
    assert resolve_dtype("auto", CPU, with_codes) == "q4"
    monkeypatch.delenv("SPECBLOCK_Q4_KERNEL")
    monkeypatch.setattr(q4_kernel, "vnni_supports", lambda: False)  # BF16 without VNNI or tiles: packed-q4-amx
    assert resolve_dtype("auto", CPU, with_codes) == "packed-q4-amx"
    monkeypatch.setattr(q4_kernel, "amx_cpu", lambda: False)  # a CPU with AVX512 but not BF16: packed-q4
    monkeypatch.setattr(q4_kernel, "cpu_supports", lambda: True)
    assert resolve_dtype("auto", CPU, with_codes) == resolve_dtype("auto", CPU, "smollm2-135m-instruct") == "packed-q4"
    assert resolve_dtype("auto", CPU, plain) == resolve_dtype("auto", CPU) == "packed-fp16"
    monkeypatch.setenv("SPECBLOCK_Q4_KERNEL", "bf16")  # torch's int4 kernel asked for: not ours, so not auto's
    assert resolve_dtype("auto", CPU, with_codes) == "packed-fp16"
    monkeypatch.delenv("SPECBLOCK_Q4_KERNEL")
    monkeypatch.setattr(q4_kernel, "cpu_supports", lambda: False)  # no AVX512: packed fp16
    assert resolve_dtype("auto", CPU, with_codes) == "packed-fp16"


def test_auto_falls_back_to_packed_fp16_where_the_load_refuses_the_codes(tmp_path, monkeypatch):
    """A directory with a q4 file whose checkpoint is not their rounding (or a CPU where the kernel
    cannot run): auto's choice is refused at load, before any linear is replaced, and the float32
    model is packed fp16 instead, with one warning; an explicit --dtype packed-q4-amx still refuses."""
    from specblock.runtime import q4_kernel
    from tiny import save_tiny_q4

    path = save_tiny_q4(tmp_path / "other", layers=1)
    monkeypatch.setattr(target_mod, "packed_available", lambda: True)
    monkeypatch.setattr(q4_kernel, "amx_cpu", lambda: True)
    monkeypatch.setattr(q4_kernel, "amx_tiles", lambda: True)
    assert resolve_dtype("auto", CPU, path) == "packed-q4-amx"
    with pytest.warns(UserWarning, match="auto falls back to packed-fp16"):
        target = TargetModel.load(path, "auto", "cpu")
    assert target.dtype_name == "packed-fp16"
    assert type(target.model.lm_head).__name__ == "PackedLinear"
    with pytest.raises(SpecBlockError):
        TargetModel.load(path, "packed-q4-amx", "cpu")
    monkeypatch.setattr(q4_kernel, "amx_cpu", lambda: False)  # the same on a CPU whose choice is packed-q4
    monkeypatch.setattr(q4_kernel, "cpu_supports", lambda: True)
    assert resolve_dtype("auto", CPU, path) == "packed-q4"
    with pytest.warns(UserWarning, match="auto falls back to packed-fp16"):
        assert TargetModel.load(path, "auto", "cpu").dtype_name == "packed-fp16"
    if _int8_kernel_runs():  # auto's q4 (AVX512-BF16 and VNNI, no tiles): the same check
        monkeypatch.setattr(q4_kernel, "amx_cpu", lambda: True)
        monkeypatch.setattr(q4_kernel, "amx_tiles", lambda: False)
        assert resolve_dtype("auto", CPU, path) == "q4"
        with pytest.warns(UserWarning, match="auto falls back to packed-fp16"):
            assert TargetModel.load(path, "auto", "cpu").dtype_name == "packed-fp16"
        assert TargetModel.load(path, "q4", "cpu").dtype_name == "q4"  # asked by name: the file's codes, as before


def _int8_kernel_runs() -> bool:
    from specblock.runtime import q4_kernel

    return q4_kernel.vnni_supports() and q4_kernel.load()


@pytest.mark.skipif(not _int8_kernel_runs(), reason="auto's q4 runs on the int8 kernel, which needs AVX512-VNNI")
def test_auto_q4_serves_the_checkpoints_codes_on_the_int8_kernel(tmp_path, monkeypatch):
    """Where auto is q4 (AVX512-BF16 and VNNI, no AMX tiles), a model whose codes are its
    checkpoint's is served from them on the int8 kernel; with SPECBLOCK_Q4_KERNEL=bf16 the
    load refuses them first (auto then chooses packed fp16 before loading)."""
    from specblock.runtime import q4, q4_kernel
    from specblock.runtime.q4 import use_q4_linears
    from tiny import save_tiny_packed_q4

    path = save_tiny_packed_q4(tmp_path / "q", layers=1)
    monkeypatch.setattr(target_mod, "packed_available", lambda: True)
    monkeypatch.setattr(q4_kernel, "amx_cpu", lambda: True)
    monkeypatch.setattr(q4_kernel, "amx_tiles", lambda: False)
    target = TargetModel.load(path, "auto", "cpu")
    assert target.dtype_name == "q4"
    kernels = {m.kernel for m in target.model.modules() if hasattr(m, "kernel")}
    assert kernels == {"int8"}, kernels
    plain = TargetModel.load(path, "float32", "cpu").model
    monkeypatch.setattr(q4, "default_kernel", lambda: "fp32")  # the int8 kernel cannot run: auto's q4 refuses
    with pytest.raises(SpecBlockError, match="int8 kernel"):
        use_q4_linears(plain, path, check=True)
    assert not any(hasattr(m, "kernel") for m in plain.modules())  # nothing replaced


def test_packed_q4_amx_is_asked_of_avx512_bf16_with_or_without_tiles(monkeypatch):
    """auto's flags for packed-q4-amx: AVX512-BF16 (tiles or not); tiles only tell which kernel runs."""
    from specblock.runtime import cext, q4_kernel

    base = {"avx512f", "avx512bw", "fma"}
    for flags, runs, tiles in ((base | {"avx512_bf16"}, True, False),
                               (base | {"avx512_bf16", "amx_bf16", "amx_tile"}, True, True),
                               (base, False, False), ({"avx2", "fma", "avx512_bf16"}, False, False)):
        monkeypatch.setattr(cext, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert (q4_kernel.amx_cpu(), q4_kernel.amx_tiles()) == (runs, tiles), flags
