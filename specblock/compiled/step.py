"""One drafter function compiled on static shapes: what every static drafter (``drafter.py``,
``eagle3.py``, ``medusa.py``) does with its step, written once.

Built as the compiled target builds its step (``compiled/target.py``): inductor with its C++
wrapper on CPU, saved for later starts (``precompile``), CUDA graphs on CUDA. Called with a shape
key: the first call of a shape compiles (or loads) its graph, with all of dynamo's guards and a
line on stderr if it makes the user wait (``notice``); later calls of that shape skip the guards
that cannot differ (this object's own copy of the code, fixed shapes). CUDA-graph outputs are
copied out before the next replay overwrites them.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable

import torch

from specblock.compiled import precompile
from specblock.compiled.notice import notice_if_slow
from specblock.compiled.precompile import own_code, shape_tag, use_disk_cache
from specblock.compiled.target import CPU_OPTIONS, _allow_recompiles


class CompiledStep:
    """``fn`` compiled once per shape key; ``net`` and ``tag`` name its saved graphs."""

    def __init__(self, fn: Callable, net: torch.nn.Module, device: torch.device, tag: dict[str, Any]) -> None:
        use_disk_cache()
        _allow_recompiles()
        opts = dict(CPU_OPTIONS) if device.type == "cpu" else {}
        kw = {"options": opts} if opts else {"mode": "reduce-overhead"}
        self.saved, self.cuda = device.type == "cpu", device.type == "cuda"
        build = precompile.compile_saved if self.saved else torch.compile
        name = precompile.tag(net, {**opts, **tag}) if self.saved else None
        # One function per shape key, made on the key's first call, as the target's steps (a saved
        # entry is per function and loads all its graphs: ``StaticTarget.step_fns``)
        self._build = lambda key: build(own_code(fn, shape_tag(name, key if isinstance(key, tuple) else (key,))),
                                        dynamic=False, **kw)
        self.fns: dict[Hashable, Callable] = {}  # keys met: each has its graph

    @property
    def shapes(self) -> set[Hashable]:
        return set(self.fns)

    def __call__(self, key: Hashable, label: str, *args):
        fn = self.fns.get(key)
        if fn is None:  # compiles (or loads) this shape's graph
            fn = self._build(key)
            with notice_if_slow(f"compiling {label}"):
                out = precompile.first_call(fn, *args) if self.saved else fn(*args)
            self.fns[key] = fn
        else:
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):  # as the target: same shape, same code
                out = fn(*args)
        if self.cuda:  # CUDA-graph outputs are overwritten by the next replay
            out = tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone()
        return out
