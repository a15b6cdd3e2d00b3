"""An eager packed-fp16 forward's q/k/v projections as one GEMM, without touching modeling code.

Why: each decoder layer calls ``q_proj``, ``k_proj`` and ``v_proj`` on the same normed hidden
state, and on the real model k and v are small (576 x 192), so a call's fixed cost is much of
their time; one call over the stacked weights pays it once. 30 layers a forward: T(1) 3% less
(``experiments/eager_switch_ab.py --switch SPECBLOCK_SHARED_INPUT``, stop 62). The compiled path fuses them in its graph (``compiled/fuse.py``); this does
the same for eager forwards, which keep HF's modules and their call order.

How: the three modules stay where they are, with their own weights and keys (compiled graphs,
saved ones included, name those). Each gets a ``SharedInput`` holding one packed copy of their
stacked weights. The first call computes the stacked product for its input and remembers the
input; a sibling called with the same tensor (same object, unchanged since: its version counter)
reads its columns from it; any other input is computed afresh. So a call returns its own
linear's product whatever the order or the inputs; the memo only saves work. Once every sibling
has been served the memo lets go of both tensors, so nothing outlives its layer.

Each output element is the same dot product either way, but fbgemm may block a wider matrix
differently, so a row's last bits may differ from the three separate calls. Greedy decoding stays
lossless: every method, plain decoding included, runs the same model.

Our q4 kernels' linears (``--dtype q4`` / ``packed-q4`` / ``packed-q4-amx``; stop 69) get the same
from ``SharedKeys``: one call of the kernel over the siblings' keys (``linear_key_cat``), for q/k/v
and for gate/up. There every output is the same bits as its own call's (each output's operations do
not depend on the other weights of a call), so the model does not change at all.
"""

from __future__ import annotations

import torch
from torch import nn

from specblock.flags import env_switch
from specblock.runtime.packed import PackedLinear, prepack

#: Sibling linears that read one input in HF's attention modules (any family that names them so).
GROUPS = (("q_proj", "k_proj", "v_proj"),)
#: The same for our q4 kernels' linears, whose fused call gives each output its own call's bits.
KEY_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _Memo:
    """One product over sibling linears' stacked outputs, and the last input it ran on."""

    def __init__(self, parts: list[nn.Module]) -> None:
        self.parts = parts
        lo = 0
        for p in parts:
            p.shared, p.shared_cols = self, slice(lo, lo + p.out_features)
            lo += p.out_features
        self.forget()

    def forget(self) -> None:
        self.x: torch.Tensor | None = None  # the input of the last stacked product, while siblings are left to serve
        self.version = -1
        self.out: torch.Tensor | None = None
        self.left = 0

    def stacked(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def run(self, part: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = self.out
        if self.left and x is self.x and x._version == self.version:
            self.left -= 1
            if not self.left:  # every sibling served: hold nothing (a long prompt's would be MBs a layer)
                self.forget()
        else:
            out = self.stacked(x)
            self.x, self.version, self.out, self.left = x, x._version, out, len(self.parts) - 1
        return out[..., part.shared_cols]


class SharedInput(_Memo):
    """One packed GEMM over sibling ``PackedLinear``s' stacked weights."""

    def __init__(self, parts: list[PackedLinear]) -> None:
        super().__init__(parts)
        self.pack()

    def pack(self) -> None:
        """Stack and pack the parts' current weights (again after a part's ``repack``)."""
        parts = self.parts
        stacked = nn.Linear(parts[0].in_features, sum(p.out_features for p in parts), bias=False, device="meta")
        stacked.weight = nn.Parameter(torch.cat([p.weight.detach() for p in parts]), requires_grad=False)
        if any(p.bias is not None for p in parts):
            stacked.bias = nn.Parameter(torch.cat([p.bias.detach() if p.bias is not None else
                                                   p.weight.new_zeros(p.out_features) for p in parts]), requires_grad=False)
        self.packed = prepack(stacked)
        self.forget()

    def stacked(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)


class SharedKeys(_Memo):
    """One call of our q4 kernel over sibling linears' keys (read at each call: a copied module
    registers a key of its own). Output rows of ``x.reshape(-1, in_features)``."""

    def stacked(self, x: torch.Tensor) -> torch.Tensor:
        from specblock.runtime import q4_kernel

        x2 = x.reshape(-1, x.shape[-1]).float()
        return q4_kernel.linear_key_cat(x2, [p._key for p in self.parts], sum(p.out_features for p in self.parts))


def wanted() -> bool:
    """``SPECBLOCK_SHARED_INPUT``: ``on`` (the default) or ``off`` (the A/B baseline)."""
    return env_switch("SPECBLOCK_SHARED_INPUT")


def share_inputs(model: nn.Module) -> int:
    """Give each module's ``GROUPS`` of packed linears, and its ``KEY_GROUPS`` of our q4 kernels'
    linears, with one input width a shared product; returns how many groups."""
    from specblock.runtime.q4 import keyed_linear

    groups = 0
    for mod in model.modules():
        for names in GROUPS:
            parts = [getattr(mod, n, None) for n in names]
            if all(type(p) is PackedLinear for p in parts) and len({p.in_features for p in parts}) == 1:
                SharedInput(parts)
                groups += 1
        for names in KEY_GROUPS:
            parts = [getattr(mod, n, None) for n in names]
            if all(keyed_linear(p) for p in parts) and len({p.in_features for p in parts}) == 1 \
                    and len({p.kernel for p in parts}) == 1:
                SharedKeys(parts)
                groups += 1
    return groups
