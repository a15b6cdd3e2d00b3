"""Linears that read the same input, fused into one call inside compiled graphs: packed-fp16's
C++ linears and q4's keyed ones.

Why: in each decoder layer q/k/v read the same normed hidden state, and so do gate/up. One call
over all their weights reads (for q4's int8 kernel: quantizes) the input once and pays one call's
overhead and one parallel region instead of three (or two): the real model's one-token graph drops
from 211 linear calls to 121. Done as an inductor pass over the traced graph, so no modeling file
is touched and any family whose linears share an input gets it; eager forwards keep the separate
modules.

The fused ops take the parts' keys, so a graph loaded from the disk cache in a new process, where
this pass does not run, finds their weights too: packed-fp16's stacks them on first use
(``packed_linear_cat`` in ``native.py``), q4's runs each part's own weights (``linear_key_cat``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch._guards import detect_fake_mode
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from specblock.compiled import native
from specblock.runtime import q4_kernel


@dataclass(frozen=True)
class Fused:
    """A keyed linear op's fused form: the op, how it takes the parts' keys and the total width,
    and the most parts one call takes (None: any)."""

    op: object
    args: Callable[..., tuple]  # (x: node or fake tensor, keys, total width) -> the op's arguments
    most: int | None = None


def _plain_keys(x, keys: list[int], n: int) -> tuple:
    """Both fused ops' arguments: up to ``CAT_KEYS`` keys as plain ints, -1 for none (an ``int[]``
    made inductor's C++ wrapper call the op boxed, and compile slower: docs/compiled.md)."""
    return (x, *q4_kernel.cat_keys(keys), n)


def _fusible() -> dict:
    """Each keyed linear op ``(x, key, out_features)`` this process has built, and its fused form."""
    ops = {}
    for lib_name, single, fused in (("specblock_native", "packed_linear", "packed_linear_cat"),  # packed-fp16's
                                    ("specblock_q4", "linear_key", "linear_key_cat")):  # q4's
        try:
            lib = getattr(torch.ops, lib_name)
            ops[getattr(lib, single).default] = Fused(getattr(lib, fused).default, _plain_keys, q4_kernel.CAT_KEYS)
        except (AttributeError, RuntimeError):  # not built in this process
            pass
    return ops


class FusePackedLinears(CustomGraphPass):
    """Replaces the keyed linears of one op that share an input node by one call of its fused op
    and slices of its output (views, so no copy)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        fused = _fusible()
        groups: dict[tuple, list[torch.fx.Node]] = {}
        for node in graph.nodes:
            if node.op == "call_function" and node.target in fused:
                groups.setdefault((node.target, same_input(node.args[0])), []).append(node)
        for (op, _), parts in groups.items():
            most = fused[op].most or len(parts)
            for i in range(0, len(parts), most):
                if len(parts[i:i + most]) > 1:
                    fuse_group(graph, parts[i].args[0], parts[i:i + most], fused[op])

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__, native.__file__, q4_kernel.__file__))


_VIEWS = (torch.ops.aten.reshape.default, torch.ops.aten.view.default)


def same_input(x: torch.fx.Node) -> tuple:
    """What makes two linears' inputs the same: the node, or for a view (q4's linears each flatten
    their input, and the graph keeps one reshape node apiece) the viewed node and the shape."""
    if x.op == "call_function" and x.target in _VIEWS:
        key = (x.args[0], tuple(x.args[1]))
        try:
            hash(key)  # a symbolic size (dynamic shapes) may not hash: then the node alone
            return key
        except TypeError:
            pass
    return (x,)


def fuse_group(graph: torch.fx.Graph, x: torch.fx.Node, parts: list[torch.fx.Node], fused: Fused) -> None:
    keys = [int(p.args[1]) for p in parts]
    widths = [int(p.args[2]) for p in parts]
    fake_x = x.meta.get("val")
    mode = detect_fake_mode([fake_x]) if fake_x is not None else None
    with graph.inserting_before(parts[0]):
        out = graph.call_function(fused.op, fused.args(x, keys, sum(widths)))
        starts = [sum(widths[:i]) for i in range(len(parts))]
        pieces = [graph.call_function(torch.ops.aten.slice.Tensor, (out, -1, a, a + w)) for a, w in zip(starts, widths)]
    if mode is not None:  # the shapes and strides later passes read
        with mode:
            out.meta["val"] = fused.op(*fused.args(fake_x, keys, sum(widths)))
            for piece, a, w in zip(pieces, starts, widths):
                piece.meta["val"] = out.meta["val"][..., a:a + w]
    for part, piece in zip(parts, pieces):
        part.replace_all_uses_with(piece)
        graph.erase_node(part)  # only after the inserts: one inserted before an erased node is lost
