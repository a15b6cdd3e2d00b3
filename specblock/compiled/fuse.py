"""Packed linears that read the same input, fused into one GEMM inside compiled graphs.

Why: in each decoder layer q/k/v read the same normed hidden state, and so do gate/up. One
fbgemm call over the stacked rows reads the input once and pays one call's overhead instead of
three (or two): the real model's one-token graph drops from 211 linear calls to 121. Done as an
inductor pass over the traced graph, so no modeling file is touched and any family whose linears
share an input gets it; eager forwards keep the separate modules.

The stacked weight is built by the kernel itself on first use (``packed_linear_cat`` in
``native.py``), from the parts' keys, so a graph loaded from the disk cache in a new process,
where this pass does not run, finds it too.
"""

from __future__ import annotations

import torch
from torch._guards import detect_fake_mode
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from specblock.compiled import native


class FusePackedLinears(CustomGraphPass):
    """Replaces the C++ packed linears that share an input node by one ``packed_linear_cat`` and
    slices of its output (views, so no copy)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        single = torch.ops.specblock_native.packed_linear.default  # built: the target adds this pass only then
        groups: dict[torch.fx.Node, list[torch.fx.Node]] = {}
        for node in graph.nodes:
            if node.op == "call_function" and node.target is single:
                groups.setdefault(node.args[0], []).append(node)
        for x, parts in groups.items():
            if len(parts) > 1:
                fuse_group(graph, x, parts)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__, native.__file__))


def fuse_group(graph: torch.fx.Graph, x: torch.fx.Node, parts: list[torch.fx.Node]) -> None:
    keys = [int(p.args[1]) for p in parts]
    widths = [int(p.args[2]) for p in parts]
    fused_op = torch.ops.specblock_native.packed_linear_cat.default
    fake_x = x.meta.get("val")
    mode = detect_fake_mode([fake_x]) if fake_x is not None else None
    with graph.inserting_before(parts[0]):
        out = graph.call_function(fused_op, (x, keys, sum(widths)))
        starts = [sum(widths[:i]) for i in range(len(parts))]
        pieces = [graph.call_function(torch.ops.aten.slice.Tensor, (out, -1, a, a + w)) for a, w in zip(starts, widths)]
    if mode is not None:  # the shapes and strides later passes read
        with mode:
            out.meta["val"] = fused_op(fake_x, keys, sum(widths))
            for piece, a, w in zip(pieces, starts, widths):
                piece.meta["val"] = out.meta["val"][..., a:a + w]
    for part, piece in zip(parts, pieces):
        part.replace_all_uses_with(piece)
        graph.erase_node(part)  # only after the inserts: one inserted before an erased node is lost
