"""The CPU target's attention as one C++ op: ``specblock_attention::tree_attention``, for compiled
graphs (``compiled/gqa.py``) and eager fp32 forwards (``runtime/grouped_rows.py``).

Why: at a tree's few query rows attention is tiny (the real model: 9 heads x 64 dims over a
256-slot span, about 0.3 M multiply-adds a row and layer), yet the graph of ``compiled/gqa.py``'s
math kernel spends it in three calls a layer (two BLAS matmuls and inductor's fused mask and
softmax): about 2.3 ms of a one-token forward and 4.2 ms of an 8-token one in inductor's kernel
profile of compiled q4 (``experiments/compiled_profile.py``; docs/compiled.md), mostly per-call cost.
Measured against it, the op saves about 1 ms a compiled forward (``attention_kernels_fused*.md``). One op a layer does the
same work in a single parallel pass. A key/value head's queries (its query heads x the tree's rows)
go in a few groups, two tasks a thread; each group walks the span 64 slots at a time, so a block of
keys (then of values) is read from L2 once and from L1 by every query of the group. Per query:
scores against the visible slots (the additive mask's 0; its finfo.min slots are skipped, as
softmax weighs them exactly 0), 16 slots' dot products summed at once by one shuffle network, a
16-lane exp (Cephes' expf, about 1 ulp), the weighted sum of values, one division. 64-wide heads
(the real model's) get their loops unrolled at compile time. Against the row-by-row op it replaced
(one task per query head and row, a horizontal sum per slot): the same bits, 0.62-0.66x the time at
4-8 rows and 0.85x at one (``python experiments/attention_op.py --baseline-rev 3d5610a``,
``attention_op.md``).
A prompt's thousands of queries go in chunks whose scratch stays in L2, and each row stops at its
last visible slot (a causal row sees up to itself): a 1,500-token prompt's attention took a quarter
of the time it did without (``attention_op.py --prompts``, ``attention_op_chunks.md``). That last
slot is found once per mask row (a row's query heads share it), skipping hidden slots 64 at a time,
so a span far longer than the context costs next to nothing: compiled steps attend over the whole
cache buffer (``StaticTarget.one_span``), one graph for every context.

Each row is computed by the same operations whatever the call's other rows, in fp32, and its
visible weights are summed, and its values weighted, in slot order over the visible slots alone:
so a row's bits do not depend on which slots its keys sit in, only on their order (the committed
tokens, then a node's ancestors, parents before children). With row-independent linears (q4) a
tree's logits are then its tokens' own, bit for bit (``tests/test_q4.py``; the matmuls differed in
their last bits). ``tests/test_tree_attention.py`` checks the op against HF's attention. fp32 models
only (packed-fp16 and q4 are fp32 inside); bf16 keeps the math kernel (compiled) or SDPA (eager).

Built on first use like q4's kernel (``runtime/cext.py``, AVX512 instructions chosen per function,
the CPU checked before use); where it cannot run, the math kernel and SDPA stay, with one warning.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from specblock.runtime import cext

SOURCE = (Path(__file__).parent / "tree_attention.cpp").read_text()
LIBRARY = "specblock_attention"
_STATE: dict[str, bool] = {}


def cpu_supports() -> bool:
    return {"avx512f", "avx512dq", "fma"} <= cext.cpu_flags()


def load() -> bool:
    """Build (or load) the op once per process; False, with one warning, where it cannot run."""
    if "ok" not in _STATE:
        why = None
        if not cpu_supports():
            why = "this CPU has no AVX512F/DQ"
        else:  # where it cannot be built: the math kernel, same results
            why = cext.build_or_why(LIBRARY, SOURCE, {"specblock_attention::tree_attention": _fake})
        _STATE["ok"] = why is None
        if why is not None:
            warnings.warn(f"specblock: compiled graphs keep the matmul attention, not the fused one ({why})", stacklevel=2)
    return _STATE["ok"]


def start_building() -> None:
    """``load``'s build begun in the background where it would run (``compiled.prebuild``)."""
    if cpu_supports():
        cext.start_build(LIBRARY, SOURCE, *cext.OPENMP)  # build_or_why's flags


def _fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    return q.new_empty((q.shape[0], q.shape[2], q.shape[1], q.shape[3]))


def applies(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """fp32 throughout, one batch row, an additive fp32 mask of one head, head dims up to 256. (That
    the op is built, ``use_gqa_attention`` checks before it switches a model to it: a traced check of
    ``_STATE`` would be a guard that dynamo's saved graphs cannot keep.)"""
    return (mask is not None and query.shape[0] == 1 and query.dtype == key.dtype == mask.dtype == torch.float32
            and mask.dim() == 4 and mask.shape[1] == 1 and query.shape[-1] <= 256
            and query.device.type == "cpu")


def tree_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                   scale: float | None = None) -> torch.Tensor:
    """``query [1, H, n, d]``, ``key``/``value [1, H_kv, span, d]``, ``mask [1, 1, n, span]`` -> ``[1, n, H, d]``;
    ``scale`` None: ``d ** -0.5``, as HF's attention takes it."""
    return torch.ops.specblock_attention.tree_attention(query, key, value, mask,
                                                        query.shape[-1] ** -0.5 if scale is None else scale)
