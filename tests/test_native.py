"""The C++ kernel of compiled packed linears (``specblock/compiled/native.py``): the same numbers as
the Python kernel, a weight table that follows the modules, a fallback when it cannot be built, and
the opt-in fp16 kernel (rows independent, within fp32 rounding of fbgemm's, fbgemm past its reach)."""

import gc
import warnings

import pytest
import torch

from specblock.compiled import native
from specblock.runtime import packed, q4_kernel

pytestmark = pytest.mark.skipif(not packed.available(), reason="torch has no fbgemm on this machine")


@pytest.fixture(scope="module")
def built():
    assert native.use_native_kernel(), "the extension did not build"
    return torch.ops.specblock_native


@pytest.mark.parametrize("shape", [(1, 40), (5, 40), (2, 3, 40)])
def test_cpp_kernel_equals_python_kernel(built, shape):
    torch.manual_seed(0)
    lin = packed.PackedLinear(torch.nn.Linear(40, 24).requires_grad_(False))
    x = torch.randn(*shape)
    got = built.packed_linear(x, lin._key, 24)
    assert got.shape == (*shape[:-1], 24)
    assert torch.equal(got, packed.packed_linear(x, lin._key, 24))
    assert torch.equal(got, lin(x))  # the eager forward: fbgemm's op directly


def test_weight_table_follows_the_modules(built):
    gc.collect()
    before = int(built.size()[0])
    lin = packed.PackedLinear(torch.nn.Linear(8, 4))
    key = lin._key
    assert int(built.size()[0]) == before + 1
    del lin
    gc.collect()
    assert int(built.size()[0]) == before
    with pytest.raises(RuntimeError, match=f"no packed weight under key {key}"):
        built.packed_linear(torch.randn(1, 8), key, 4)


def test_put_refuses_what_is_not_a_packed_weight(built):
    with pytest.raises(RuntimeError, match="expected a packed linear weight"):
        built.put(10**9, 3)


def test_traced_modules_call_the_cpp_kernel_unless_pinned(built):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 8)).requires_grad_(False)
    packed.pack_linears(model)
    graphs = []

    def backend(gm, example):
        graphs.append({n.target for n in gm.graph.nodes if n.op == "call_function"})
        return gm

    x = torch.randn(2, 16)
    want = model(x)
    assert torch.equal(torch.compile(model, backend=backend, fullgraph=True)(x), want)
    assert torch.ops.specblock_native.packed_linear.default in graphs[-1] or \
        torch.ops.specblock_native.packed_linear in graphs[-1]
    native.pin_python_kernel(model)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(model, backend=backend, fullgraph=True)(x), want)
    assert not any("specblock_native" in str(t) for t in graphs[-1])
    assert any("specblock.packed_linear" in str(t) for t in graphs[-1])


def test_a_failed_build_warns_once_and_keeps_the_python_kernel(monkeypatch):
    def broken() -> None:
        raise RuntimeError("Error building extension 'x'\nc++: not found")

    monkeypatch.setattr(native, "_STATE", {})
    monkeypatch.setattr(native, "_build", broken)
    monkeypatch.setattr(packed.PackedLinear, "compiled_op", packed.packed_linear)
    with pytest.warns(UserWarning, match="could not be built .*c\\+\\+: not found.*Python kernel"):
        assert native.use_native_kernel() is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.use_native_kernel() is False  # decided once per process, said once
    assert packed.PackedLinear.compiled_op is packed.packed_linear


@pytest.fixture
def fbgemm_kernel(built):
    native.set_fp16_kernel(False)
    yield built
    native.set_fp16_kernel(native.fp16_kernel_wanted())  # as the process had it


def test_fused_kernel_equals_its_parts_and_follows_them(fbgemm_kernel):
    built = fbgemm_kernel
    torch.manual_seed(2)
    parts = [packed.PackedLinear(torch.nn.Linear(32, w, bias=b).requires_grad_(False)) for w, b in ((16, False), (8, True), (8, False))]
    keys = [p._key for p in parts]
    x = torch.randn(3, 32)
    want = torch.cat([p(x) for p in parts], dim=-1)
    single, fused = (int(v) for v in built.size())
    got = native.packed_linear_cat(x, keys, 32)
    assert torch.equal(got, want)
    assert int(built.size()[1]) == fused + 1
    one = torch.cat([p(x[:1]) for p in parts], dim=-1)  # fbgemm rounds by row count: compare like with like
    assert torch.equal(native.packed_linear_cat(x[:1], keys, 32), one)  # built once, reused
    assert int(built.size()[1]) == fused + 1
    del parts[1]
    gc.collect()
    assert [int(v) for v in built.size()] == [single - 1, fused]  # a dropped part frees the stack too


def test_the_pass_fuses_linears_that_share_an_input(built):
    from torch._inductor.utils import run_and_get_code

    from specblock.compiled.fuse import FusePackedLinears

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.o = (torch.nn.Linear(16, w) for w in (16, 8, 16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k = self.q(x), self.k(x)
            return self.o(q * 2) + k.sum(-1, keepdim=True)

    torch.manual_seed(3)
    block = Block().requires_grad_(False)
    packed.pack_linears(block)
    x = torch.randn(4, 16)
    want = block(x)
    torch._dynamo.reset()
    fn = torch.compile(block, fullgraph=True, options={"post_grad_custom_post_pass": FusePackedLinears()})
    got, code = run_and_get_code(fn, x)
    src = "\n".join(code)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # inductor's fused sum/add round their own way
    calls = {op: src.count(f"= torch.ops.specblock_native.{op}.default(") for op in ("packed_linear_cat", "packed_linear")}
    assert calls == {"packed_linear_cat": 1, "packed_linear": 1}, src  # q and k as one call, o on its own



def test_a_build_folder_per_source_and_torch_installation():
    """Two virtual environments sharing one $SPECBLOCK_HOME each keep their own builds (the build
    command names torch's paths, so one folder for both made ninja rebuild at every switch)."""
    from specblock.runtime.cext import build_name

    a = build_name("specblock_x", "int f();", "/venv-a/torch")
    assert a == build_name("specblock_x", "int f();", "/venv-a/torch")
    assert a != build_name("specblock_x", "int f();", "/venv-b/torch")
    assert a != build_name("specblock_x", "int g();", "/venv-a/torch")
    assert build_name("specblock_x", "int f();").startswith("specblock_x_")


def test_a_library_is_loaded_once_a_process_whatever_the_home_or_flags(monkeypatch, tmp_path):
    """A second copy of a library in one process would register its ``TORCH_LIBRARY`` namespace again
    and abort: once loaded, a library is not built or loaded again, from another home, with other
    flags or from two threads at once."""
    import threading

    from specblock.runtime import cext
    from torch.utils import cpp_extension

    loads = []

    def fake_load_inline(name, **kw):
        loads.append((name, kw["build_directory"], tuple(kw["extra_cflags"])))
        threading.Event().wait(0.2)  # a build takes a while: a second thread arrives meanwhile

    monkeypatch.setattr(cpp_extension, "load_inline", fake_load_inline)
    monkeypatch.setattr(cext, "_LOADED", {})
    monkeypatch.setenv("SPECBLOCK_HOME", str(tmp_path / "a"))
    threads = [threading.Thread(target=cext._build_now, args=("specblock_z", "int f();", ["-O2"])) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    monkeypatch.setenv("SPECBLOCK_HOME", str(tmp_path / "b"))
    cext._build_now("specblock_z", "int f();", ["-O3"])
    assert len(loads) == 1 and loads[0][1].startswith(str(tmp_path / "a"))
    cext._build_now("specblock_w", "int g();", ["-O2"])  # another library still builds
    assert len(loads) == 2


def test_a_build_begun_in_the_background_is_waited_for_not_run_again(monkeypatch):
    """``cext.start_build`` runs the build in a thread; ``build`` of the same library and flags then
    waits for it (one build), raises what it raised, and another flag set builds on its own."""
    import threading

    from specblock.runtime import cext

    calls, release = [], threading.Event()

    def fake(prefix, source, cflags, ldflags=None):
        release.wait(5)
        calls.append((prefix, tuple(cflags)))
        cflags.append("-DADDED")  # torch's load_inline appends to the lists it is given
        if source == "broken":
            raise RuntimeError("no compiler")

    monkeypatch.setattr(cext, "_build_now", fake)
    monkeypatch.setattr(cext, "_STARTED", {})
    flags = ["-O2"]
    cext.start_build("specblock_x", "int f();", flags)
    cext.start_build("specblock_x", "int f();", flags)  # once
    release.set()
    cext.build("specblock_x", "int f();", flags)
    assert calls == [("specblock_x", ("-O2",))]
    assert flags == ["-O2"], "the caller's flags were changed (a later build would not find this one)"
    cext.build("specblock_x", "int f();", ["-O3"])  # other flags: built here
    assert calls[-1] == ("specblock_x", ("-O3",)) and len(calls) == 2
    cext.start_build("specblock_y", "broken", [])
    with pytest.raises(RuntimeError, match="no compiler"):
        cext.build("specblock_y", "broken", [])


FP16_KERNEL_CPU = q4_kernel.cpu_supports()  # the kernel needs what q4's does (AVX512F/BW, FMA)
needs_avx512 = pytest.mark.skipif(not FP16_KERNEL_CPU, reason="the fp16 kernel needs AVX512F/BW and FMA")


@pytest.fixture
def fp16_kernel(built):
    native.set_fp16_kernel(True)
    yield built
    native.set_fp16_kernel(native.fp16_kernel_wanted())  # as the process had it


@needs_avx512
@pytest.mark.parametrize("bias", [True, False])
def test_fp16_kernel_rows_are_their_own_and_agree_with_fbgemm(fp16_kernel, bias):
    """Up to 16 rows on the fp16 kernel: each row the same bits as its own one-row call (fbgemm's
    depend on the row count), every value within fp32 rounding of fbgemm's, bias added."""
    torch.manual_seed(2)
    lin = packed.PackedLinear(torch.nn.Linear(576, 96, bias=bias).requires_grad_(False))
    for shape in [(1, 576), (5, 576), (2, 3, 576), (16, 576)]:
        x = torch.randn(*shape)
        got = fp16_kernel.packed_linear(x, lin._key, 96)
        rows = x.reshape(-1, 576)
        alone = torch.cat([fp16_kernel.packed_linear(rows[i:i + 1], lin._key, 96) for i in range(rows.shape[0])])
        assert got.shape == (*shape[:-1], 96) and torch.equal(got.reshape(-1, 96), alone)
        native.set_fp16_kernel(False)
        want = fp16_kernel.packed_linear(x, lin._key, 96)
        native.set_fp16_kernel(True)
        assert not torch.equal(got, want) or shape[0] == 1  # a different kernel, not fbgemm's call again
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_avx512
def test_fp16_kernel_leaves_long_calls_and_other_shapes_to_fbgemm(fp16_kernel):
    """More than 16 rows (a prompt), or a weight whose inputs are not a multiple of 32: fbgemm's
    call, bit for bit."""
    torch.manual_seed(3)
    wide = packed.PackedLinear(torch.nn.Linear(64, 8).requires_grad_(False))
    odd = packed.PackedLinear(torch.nn.Linear(40, 8).requires_grad_(False))
    for lin, x in ((wide, torch.randn(17, 64)), (odd, torch.randn(3, 40))):
        got = fp16_kernel.packed_linear(x, lin._key, 8)
        assert torch.equal(got, packed.packed_linear(x, lin._key, 8))


@needs_avx512
def test_fp16_kernel_fused_call_equals_its_parts(fp16_kernel):
    torch.manual_seed(4)
    parts = [packed.PackedLinear(torch.nn.Linear(64, n).requires_grad_(False)) for n in (32, 8, 8)]
    x = torch.randn(4, 64)
    got = native.packed_linear_cat(x, [p._key for p in parts], 48)
    assert torch.equal(got, torch.cat([fp16_kernel.packed_linear(x, p._key, p.out_features) for p in parts], -1))


def test_fp16_kernel_switch_reads_its_variable(monkeypatch):
    monkeypatch.delenv(native.FP16_KERNEL_ENV, raising=False)
    assert native.fp16_kernel_wanted() == FP16_KERNEL_CPU  # the default where it runs
    monkeypatch.setenv(native.FP16_KERNEL_ENV, "fbgemm")
    assert not native.fp16_kernel_wanted()
    monkeypatch.setenv(native.FP16_KERNEL_ENV, "ours")
    assert native.fp16_kernel_wanted() == FP16_KERNEL_CPU
    monkeypatch.setenv(native.FP16_KERNEL_ENV, "fastest")
    with pytest.warns(UserWarning, match="neither 'ours' nor 'fbgemm'"):
        assert not native.fp16_kernel_wanted()


@needs_avx512
def test_fp16_kernel_follows_a_repack(fp16_kernel):
    """The kernel lays its copy out from the module's own fp32 tensors; a repack (an adapting
    drafter's update) drops that copy, and the stacked ones holding the key, so calls read the new weights."""
    torch.manual_seed(5)
    lin = packed.PackedLinear(torch.nn.Linear(64, 8).requires_grad_(False))
    other = packed.PackedLinear(torch.nn.Linear(64, 8).requires_grad_(False))
    x = torch.randn(2, 64)
    before = fp16_kernel.packed_linear(x, lin._key, 8)
    fused_before = native.packed_linear_cat(x, [lin._key, other._key], 16)
    with torch.no_grad():
        lin.weight.mul_(-2.0)
    lin.repack()
    after = fp16_kernel.packed_linear(x, lin._key, 8)
    torch.testing.assert_close(after, -2.0 * (before - lin.bias) + lin.bias, rtol=1e-5, atol=1e-5)
    assert torch.equal(native.packed_linear_cat(x, [lin._key, other._key], 16)[:, :8], after)
    assert torch.equal(native.packed_linear_cat(x, [lin._key, other._key], 16)[:, 8:], fused_before[:, 8:])
