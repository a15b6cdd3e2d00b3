"""Static shapes and compiled forwards for the hot path (opt-in: ``--compile``).

A room above ``runtime``: it imports ``runtime`` and ``policies``; ``runtime`` reaches it only
through the CLI's lazy ``--compile`` hook (``runtime.cli``), never at import time.
"""

from specblock.compiled.target import BUCKETS, COMPILE_MODES, StaticTarget, bucket_of, span_of
from specblock.errors import SpecBlockError
from specblock.runtime.target import TargetModel


def prebuild(dtype: str, device: str) -> None:
    """Begin building the C++ libraries a compiled CPU target calls (the fused tree attention where
    the CPU runs it; the packed-linear kernel at packed-fp16) in the background, before the model
    loads: the CLI and the server call this first under ``--compile``. On a first start the two
    builds ran one after the other after the load, on the critical path (docs/compiled.md, stop 56).
    The norm library the load itself waits for (``exact_parts``) is queued first: behind the other
    two on the two build threads it finished last, and the load waited for it (stop 65's timeline).
    So is q4's kernel library where the target's linears run on it (q4, packed-q4, packed-q4-amx): the load
    needs it too (stop 67's timeline had it built after the other two, the load waiting 9 s)."""
    from specblock.compiled import native
    from specblock.runtime import exact_parts, packed, q4_kernel, tree_attention
    from specblock.runtime.q4 import PACKED_Q4, PACKED_Q4_AMX, Q4
    from specblock.runtime.target import resolve_device, resolve_dtype

    dev = resolve_device(device)
    if dev.type != "cpu":
        return
    dtype = resolve_dtype(dtype, dev)
    if exact_parts.wanted_for(dtype):
        exact_parts.start_building()  # what the load's end waits for; target.load asks again, no second build
    if dtype in (Q4, PACKED_Q4, PACKED_Q4_AMX):
        q4_kernel.start_building()  # where it cannot run this starts nothing; the load says why
    tree_attention.start_building()
    if dtype == packed.PACKED_FP16:
        native.start_building()


def compile_target(target: TargetModel, mode: str = "whole") -> StaticTarget:
    """The CLI's ``--compile``: the loaded target behind static shapes, compiled per bucket on
    first use (inductor on CPU, CUDA graphs on CUDA); ``mode`` ``regions`` compiles one layer step
    shared by all layers, ``whole`` the whole forward."""
    if mode not in COMPILE_MODES:
        raise SpecBlockError(f"compile mode {mode!r}: one of {', '.join(COMPILE_MODES)}")
    static = StaticTarget.wrap(target, compile=True, regions=mode == "regions")
    static.source = target.source  # helper processes may load it again to compile tree sizes (compiled/warm_helpers.py)
    return static


def compile_drafter(drafter, target: TargetModel):
    """``--compile`` for the drafter: SpecBlock's block 1 (``compiled/drafter.py``) and EAGLE-3's
    flush and depth steps (``compiled/eagle3.py``) on static buffers, Medusa's heads on their one
    shape (``compiled/medusa.py``), SpS's draft model behind a ``StaticTarget`` (``compiled/sps.py``,
    chains), compiled; other drafters (and SpS trees) are returned as they are."""
    from specblock.compiled.drafter import ROWS, StaticSpecBlockDrafter
    from specblock.compiled.eagle3 import StaticEagle3Drafter
    from specblock.compiled.medusa import StaticMedusaDrafter
    from specblock.compiled.sps import StaticSpsDrafter
    from specblock.compiled.native import use_native_kernel
    from specblock.runtime.drafters.eagle3 import Eagle3Drafter
    from specblock.runtime.drafters.medusa import MedusaDrafter
    from specblock.runtime.drafters.sps import SpsDrafter
    from specblock.runtime.drafters.specblock import SpecBlockDrafter
    from specblock.runtime.packed import PackedLinear

    if type(drafter) is SpsDrafter:
        return StaticSpsDrafter(drafter) if drafter.top_k == 1 else drafter
    if type(drafter) not in (SpecBlockDrafter, Eagle3Drafter, MedusaDrafter):
        return drafter
    if any(isinstance(m, PackedLinear) for m in drafter.net.modules()):
        use_native_kernel()  # packed linears in C++ in the graph, as the compiled target's (compiled/native.py)
    if type(drafter) is MedusaDrafter:
        return StaticMedusaDrafter(drafter)
    if type(drafter) is Eagle3Drafter:
        return StaticEagle3Drafter(drafter, target.max_context)
    return StaticSpecBlockDrafter(drafter, capacity=target.max_context + ROWS + drafter.net.cfg.K)


__all__ = ["BUCKETS", "COMPILE_MODES", "StaticTarget", "bucket_of", "compile_drafter", "compile_target", "prebuild",
           "span_of"]
