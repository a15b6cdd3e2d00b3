"""The target with static shapes: a preallocated KV cache, trees padded to a few sizes, and one
compiled forward per (tree bucket, attention span).

Why: on a CPU a forward of a small model is dispatch-bound (hundreds of aten ops from Python),
and on a GPU it is launch-bound; a compiled graph of fixed shape removes both (inductor's fused
C++ kernels on CPU, CUDA graphs via ``mode="reduce-overhead"`` on CUDA). Fixed shapes need:

- tree sizes padded up to a bucket (``BUCKETS``; larger trees to a multiple of the largest);
  padded slots get token ``tokens[0]``, depth 0 and see only themselves, and no real slot ever
  sees them, so real rows' logits are those of the unpadded tree;
- attention over a span of the cache rounded up to a power of two (at least ``MIN_SPAN``), the
  rest of the span hidden by the mask, so the context grows without a new shape per token. Where
  every layer's attention is our fused op (fp32 inside: packed-fp16 and q4, on AVX512), the span is
  the whole buffer (``one_span``): the op reads a row's visible slots only and stops at the last,
  so a longer span costs a longer mask and nothing else, and one graph a tree bucket serves every
  context (a server no longer compiles mid-request when a conversation passes 256, 512, ...
  slots);
- the mask, positions and write slots built *inside* the graph from ``past`` (a 0-d tensor, so
  its value never recompiles), the padded depths and the padded ancestor mask.

Prefill runs the same step uncompiled (one call per prompt, any length). Committing a path is one
gather over all layers' static buffers (``TreeStaticCache.keep``).

What is compiled: ``regions=True`` compiles one decoder-layer step shared by all layers, plus
the tree inputs with the embedding and the final norm with the LM head (``compiled/regions.py``);
``regions=False`` (the default) the whole forward per shape. Same padding and masks either way.
Regions compile several times faster but ran T(1) 13% slower on the lab model
(``experiments/results/compiled_regions.md``), hence not the default yet. On CPU the whole-forward
graphs are saved as they are compiled, and a later process loads them instead of tracing
(``compiled/precompile.py``).
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import numpy as np
import torch
from transformers import PreTrainedModel

from specblock.buckets import BUCKETS, bucket_of
from specblock.compiled import precompile, warm_helpers
from specblock.compiled.precompile import own_code, shape_tag, use_disk_cache
from specblock.compiled.fuse import FusePackedLinears
from specblock.compiled.gqa import FUSED_NAME, use_gqa_attention
from specblock.compiled.native import pin_python_kernel, use_native_kernel
from specblock.compiled.notice import notice_if_slow
from specblock.compiled.regions import RegionFns, check_regional, embed, head, layer_step, regional_forward
from specblock.compiled.static_cache import TreeStaticCache
from specblock.errors import SpecBlockError
from specblock.policies.tree import DraftTree
from specblock.runtime.packed import PackedLinear
from specblock.runtime.q4 import keyed_q4
from specblock.runtime.target import TargetModel, TargetOutput

MIN_SPAN = 256
#: Inductor on CPU: ``cpp_wrapper`` calls the kernels from C++ instead of a Python wrapper (it won
#: clearly in interleaved trials on the lab model; ``max_autotune``'s C++ GEMM templates were faster
#: still but took minutes to compile). Not ``freezing`` (the fixed weights folded into the graph as
#: constants, the linears on prepacked oneDNN weights): it turns off the AOT-autograd cache that
#: saved graphs need (``compiled/precompile.py``), so a frozen graph's warm start re-ran AOT tracing.
#: ``compiled_speed.py --frozen-variant`` times ``FROZEN_CPU_OPTIONS`` beside the default: on the
#: real model it was worth 0-6% of T(n) at packed-fp16 and nothing at bf16 (docs/compiled.md).
#: ``cpp_wrapper_build_separate`` compiles the wrapper (-O1) apart from the kernels (-O3): a cold
#: bucket compiled in 46.5 s instead of 60.7 s, T(n) no slower (``--options-variant``, docs/compiled.md).
CPU_OPTIONS = {"cpp_wrapper": True, "cpp_wrapper_build_separate": True}
FROZEN_CPU_OPTIONS = {"freezing": True, "cpp_wrapper": True}
#: Regions: the weights are graph inputs (shared by every layer) in either case.
REGION_CPU_OPTIONS = {"cpp_wrapper": True}
COMPILE_MODES = ("regions", "whole")


def span_of(need: int, capacity: int) -> int:
    """Attention span for ``need`` slots: a power of two from ``MIN_SPAN``, capped at the capacity."""
    span = MIN_SPAN
    while span < need:
        span *= 2
    return min(span, capacity)


class StaticTarget(TargetModel):
    """``TargetModel`` with the same three moves on static buffers; ``compile=False`` runs the
    identical padded step eagerly (the tests' cheap way to check the padding); ``regions`` picks
    one compiled layer step for all layers (True) or one compiled whole forward (False); ``gqa``
    False keeps HF's ``repeat_kv`` attention in the graph (the baseline of ``compiled_speed.py``),
    ``gqa_kernel`` picks the grouped attention otherwise (``compiled/gqa.py``'s ``KERNELS``; None:
    the fused C++ op where it runs, else the math kernel);
    ``native`` False keeps packed linears' Python kernel in the graph, ``fuse`` False their (and q4's
    keyed linears') separate calls (the baselines of ``compiled_speed.py --python-kernel-baseline`` /
    ``--unfused-baseline``);
    ``saved`` False neither loads nor saves graphs for later starts (``compiled/precompile.py``);
    ``dynamic`` is ``torch.compile``'s. None was tried so that one graph would serve every bucket past
    1: each tree size still compiled its own graph (the model code specializes the sizes), at the
    same speed (``compiled_speed.py --dynamic-variant``, docs/compiled.md), so the default stays False;
    ``skip_guards`` False evaluates all of dynamo's guards on every call (see ``step_fns``);
    ``one_span`` False keeps power-of-two spans where the fused op would allow the whole buffer
    (the baseline of ``compiled_speed.py --spans-baseline``)."""

    def __init__(
        self,
        model: PreTrainedModel,
        tap_layers: tuple[int, ...] | None = None,
        compile: bool = True,
        buckets: tuple[int, ...] = BUCKETS,
        mode: str | None = None,
        options: dict | None = None,
        regions: bool = False,
        gqa: bool = True,
        gqa_kernel: str | None = None,
        native: bool = True,
        fuse: bool = True,
        saved: bool = True,
        dynamic: bool | None = False,
        skip_guards: bool = True,
        one_span: bool = True,
    ) -> None:
        super().__init__(model, tap_layers)
        self.compiled = compile
        types = getattr(self.config, "layer_types", None)
        if getattr(self.config, "sliding_window", None) and (types is None or any(t != "full_attention" for t in types)):
            # Our one 4D mask would give every layer the full context, not its window.
            raise SpecBlockError("--compile does not support sliding-window attention yet; run without --compile")
        self.buckets = tuple(sorted(buckets))
        cfg = self.config
        heads = int(cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        self.capacity = self.max_context + self.buckets[-1]  # padding never spills past the buffer
        self.static = TreeStaticCache(int(cfg.num_hidden_layers), kv_heads, head_dim, self.capacity, self.dtype, self.device)
        self.regions = regions
        eager_fns = RegionFns(self._region_inputs)
        self._eager_step = partial(self._step, fns=eager_fns) if regions else self._step
        if regions:
            check_regional(model)
            self._check_regions()
        self.compiled, self.gqa, self.native = compile, False, False
        self.fused = self.saved = False
        self.one_span = False  # compiled steps attend over the whole buffer (see the module)
        self.warmed: tuple[int, ...] = ()  # buckets ``warm`` compiled, ascending: later trees pad up to one
        self.step_fns: dict[tuple, Callable] = {}  # each shape run compiled: its compiled step
        # A shape met before runs with dynamo's differentiating guards only: the step's inputs are
        # tensors of that fixed shape plus the ints and flags of ``shape``, this copy of the code is
        # called by this target alone (``own_code``), and a new shape still goes through every
        # guard. Measured on the real model, packed-fp16, interleaved: T(1) 21.50 -> 20.91 ms, T(4)
        # 27.67 -> 27.11 (``experiments/guard_skip.py``, ``guard_skip.md``). Whole-forward CPU graphs only.
        self.skip_guards = False
        self.mode = mode if mode is not None else ("reduce-overhead" if self.device.type == "cuda" else None)
        self._build: Callable[[tuple], Callable] | None = None  # a shape's compiled step, on its first call
        self.tag: str | None = None  # the saved graphs' model tag (``precompile.tag``), where they are saved
        if compile:
            use_disk_cache()
            _allow_recompiles()
            self.gqa = gqa and use_gqa_attention(model, gqa_kernel)  # grouped heads read in place (compiled/gqa.py)
            self.one_span = (one_span and self.gqa and not regions and self.dtype == torch.float32
                             and model.config._attn_implementation == FUSED_NAME)
            # packed linears in C++ (compiled/native.py); a packed-q4 target has none to build it for
            has_packed = any(isinstance(m, PackedLinear) for m in model.modules())
            self.native = has_packed and native and use_native_kernel()
            if has_packed and not native:
                pin_python_kernel(model)
            self._install_output_hooks()
            if self.mode is not None:
                kw = {"mode": self.mode}
            else:
                opts = dict(options if options is not None else REGION_CPU_OPTIONS if regions else CPU_OPTIONS)
                if fuse and (self.native or keyed_q4(model)):  # q/k/v and gate/up as one call each (compiled/fuse.py)
                    opts.setdefault("post_grad_custom_post_pass", FusePackedLinears())
                    self.fused = True
                kw = {"options": opts}
            # CPU, whole forward, unfrozen: graphs saved for later starts (compiled/precompile.py). Not
            # CUDA graphs; not regions (torch 2.13 fails to save their guards and then asserts).
            self.saved = saved and not regions and self.mode is None and not kw["options"].get("freezing")
            self.skip_guards = skip_guards and not regions and self.mode is None
            attention = model.config._attn_implementation  # not in the config's JSON, and it changes the graph
            name = precompile.tag(model, {**kw["options"], "dynamic": dynamic, "attention": attention}) if self.saved else None
            self.tag = name
            build = precompile.compile_saved if self.saved else torch.compile
            if regions:
                fns = RegionFns(*(torch.compile(own_code(f), dynamic=dynamic, **kw)
                                  for f in (self._region_inputs, layer_step, head)))
                regional = partial(self._step, fns=fns)
                self._build = lambda shape: regional  # one set of functions for every shape
            else:
                # A function of its own per shape. Why: a saved entry is per function, and loading one
                # rebuilds the guards of every graph in it (about 0.55 s each on the real model, ~9k
                # guards a graph); with one function for all shapes, a later start loaded every bucket
                # and span this machine had ever met (22 graphs, 12 s of the CLI's 17-19 s start) to
                # run the two or three it needed.
                self._build = lambda shape: build(own_code(self._step, shape_tag(name, shape)), dynamic=dynamic, **kw)

    @classmethod
    def wrap(cls, target: TargetModel, **kw) -> "StaticTarget":
        """The same model and taps behind static shapes (the CLI's ``--compile`` hook)."""
        return cls(target.model, target.tap_layers, **kw)

    # ------------------------------------------------------------------ the step
    def _step(
        self, ids: torch.Tensor, depth: torch.Tensor, anc: torch.Tensor, past: torch.Tensor, span: int,
        want: bool, last_only: bool, fns: RegionFns | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One padded forward: ``ids``/``depth`` ``[B]``, ``anc`` ``[B, B]`` bool, ``past`` 0-d;
        ``fns``: the (compiled or eager) pieces of the regional mode, None: the whole model."""
        if fns is not None:
            st = self.static
            logits, hs = regional_forward(self.model, fns, st.keys, st.values, ids, depth, anc, past, span, want, last_only)
        else:
            mask, slots, positions = self._tree_inputs(ids, depth, anc, past, span)
            self.static.begin(slots, span)
            out = self.model(
                input_ids=ids[None],
                attention_mask=mask,
                position_ids=positions,
                past_key_values=self.static,
                use_cache=True,
                output_hidden_states=want,
                logits_to_keep=1 if last_only else 0,
            )
            logits, hs = out.logits[0], out.hidden_states
        if not want:
            return logits, None, None
        return logits, hs[-1][0], torch.cat([hs[i][0] for i in self.tap_layers], dim=-1)

    def _tree_inputs(self, ids: torch.Tensor, depth: torch.Tensor, anc: torch.Tensor, past: torch.Tensor, span: int):
        """The padded tree's mask ``[1, 1, B, span]``, cache write slots ``[B]`` and positions ``[1, B]``."""
        b = ids.shape[0]
        slots = past + torch.arange(b, device=ids.device)
        cols = torch.arange(span, device=ids.device)
        zero = torch.zeros((), dtype=self.dtype, device=ids.device)
        hidden = torch.full_like(zero, self._min)
        # The committed slots, then each row's tree block written at the tree's slots: no gather over
        # the span (a compiled step's span may be the whole buffer, ``one_span``)
        mask = torch.where((cols < past).expand(b, span), zero, hidden)  # a tensor of its own, not a view
        mask = mask.index_copy(1, slots, torch.where(anc, zero, hidden))
        return mask[None, None], slots, (past + depth)[None]

    def _region_inputs(self, ids: torch.Tensor, depth: torch.Tensor, anc: torch.Tensor, past: torch.Tensor, span: int):
        """The regional mode's first piece: the tree inputs, then embeddings and rotary tables."""
        mask, slots, positions = self._tree_inputs(ids, depth, anc, past, span)
        return (mask, slots, positions, *embed(self.model, ids, positions))

    def _shape(self, rows: int, past: int, compiled: bool, last_only: bool) -> tuple:
        """The key of a step over ``rows`` padded rows after ``past`` slots: rows, attention span,
        features wanted, last row only (one compiled function and saved entry each)."""
        span = self.capacity if compiled and self.one_span else span_of(past + rows, self.capacity)
        return (rows, span, self.want_features, last_only)

    def _run(self, ids: np.ndarray, depth: np.ndarray, anc: np.ndarray, n: int, compiled: bool, last_only: bool):
        dev = self.device
        past = torch.tensor(self.past_len, device=dev)
        shape = self._shape(len(ids), self.past_len, compiled, last_only)
        span = shape[1]
        args = (torch.as_tensor(ids, device=dev), torch.as_tensor(depth, device=dev), torch.as_tensor(anc, device=dev),
                past, span, self.want_features, last_only)
        fn = self.step_fns.get(shape) if compiled else self._eager_step
        if compiled and fn is None:  # this shape's first call compiles (or loads) its graph, with all of dynamo's guards
            fn = self._build(shape)
            with notice_if_slow(f"compiling the target's step for {len(ids)}-node trees over {span} slots"):
                logits, top, taps = precompile.first_call(fn, *args) if self.saved else fn(*args)
            self.step_fns[shape] = fn
        elif compiled and self.skip_guards:
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                logits, top, taps = fn(*args)
        else:
            logits, top, taps = fn(*args)
        if compiled and self.mode == "reduce-overhead":  # CUDA-graph outputs are overwritten by the next replay
            logits, top, taps = (None if t is None else t.clone() for t in (logits, top, taps))
        rows = slice(0, logits.shape[0] if last_only else n)
        if top is None:
            return TargetOutput(logits[rows])
        return TargetOutput(logits[rows], top=top[:n], taps=taps[:n])

    @torch.no_grad()
    def _check_regions(self, n: int = 4) -> None:
        """Regions rebuild HF's decoder forward from its parts; a family that does more outside its
        layers (an embedding scale, a logit cap) would differ silently, so compare one small eager
        forward of each way (the same kernels: equal up to rounding) before anything is compiled."""
        dev = self.device
        ids = torch.arange(n, device=dev) % self.vocab_size
        args = (ids, torch.arange(n, device=dev), torch.ones(n, n, dtype=torch.bool, device=dev).tril(),
                torch.tensor(0, device=dev), span_of(n, self.capacity), False, False)
        whole, parts = self._step(*args)[0].float(), self._eager_step(*args)[0].float()
        if (whole - parts).abs().max() > 1e-3 * whole.abs().max() + 1e-5:
            raise SpecBlockError(f"{type(self.model).__name__}: the regional forward differs from the model's own; "
                                 "use the whole-model compile mode (--compile-mode whole)")

    @torch.no_grad()
    def _install_output_hooks(self) -> None:
        """One small eager forward with hidden states, before anything is compiled. Why:
        transformers installs its hidden-state capture hooks lazily on the first forward that asks
        for them, under a ``threading.Lock`` that dynamo cannot enter; traced then, a compiled step
        with features split into 4 graphs (3 breaks) instead of 1. Nothing it writes is kept: the
        static slots it fills are overwritten by the next prefill."""
        dev = self.device
        one = torch.zeros(1, dtype=torch.long, device=dev)
        self._eager_step(one, one, torch.ones(1, 1, dtype=torch.bool, device=dev), torch.tensor(0, device=dev),
                         span_of(1, self.capacity), True, True)

    # ------------------------------------------------------------------ the three moves
    def reset(self) -> None:
        self.cache = None
        self.past_len = 0

    @torch.no_grad()
    def prefill(self, ids: np.ndarray) -> TargetOutput | None:
        """Uncompiled (any length, once per prompt); fills the static buffers from slot 0."""
        self.reset()
        n = len(ids)
        if n == 0:
            return None
        if n > self.max_context:
            raise SpecBlockError(f"prompt of {n} tokens exceeds the model's context {self.max_context}")
        anc = np.tril(np.ones((n, n), dtype=bool))
        out = self._run(np.asarray(ids, dtype=np.int64), np.arange(n), anc, n, compiled=False, last_only=True)
        self.past_len = n
        return out

    @torch.no_grad()
    def tree_forward(self, tree: DraftTree) -> TargetOutput:
        n = tree.size
        if self.past_len + tree.max_depth >= self.max_context:
            raise SpecBlockError("tree reaches past the model's context; the engine should have cut it")
        b = self.bucket(n)
        ids = np.full(b, int(tree.tokens[0]), dtype=np.int64)
        ids[:n] = tree.tokens
        depth = np.zeros(b, dtype=np.int64)
        depth[:n] = tree.depth
        anc = np.eye(b, dtype=bool)
        anc[:n, :n] = tree.ancestor_mask
        return self._run(ids, depth, anc, n, compiled=self.compiled, last_only=False)

    def bucket(self, n: int) -> int:
        """The padded size of an ``n``-node tree: its bucket, or once ``warm`` ran, the smallest
        bucket warmed that holds it (padding is free of results; a compile mid-request is not)."""
        if self.warmed and n <= self.warmed[-1]:
            return bucket_of(n, self.warmed)
        return bucket_of(n, self.buckets)

    @torch.no_grad()
    def warm(self, max_nodes: int, sizes: tuple[int, ...] | None = None, helpers: bool = True,
             then: Callable[[], object] | None = None) -> list[int]:
        """Compile (or load) the step of every bucket a tree of up to ``max_nodes`` nodes can meet
        (only those of ``sizes``, where the drafter names them: ``Drafter.tree_sizes``), at the first
        span (with ``one_span``, the only one), now rather than in the middle of a request: what a
        server does before it listens. Later trees pad up to a warmed bucket (``bucket``); several
        engines on one target warm the union. Buckets with no saved graph compile partly in helper
        processes where cores are free (``helpers``; ``compiled/warm_helpers.py``); ``then`` (the
        drafter's own warm-up, which never touches this target) runs once this process's share is
        done, while helpers may still compile. Runs with the current ``want_features`` and taps (set
        them as the engine will); leaves the cache empty. Returns the buckets warmed."""
        if not self.compiled:
            if then is not None:
                then()
            return []
        top = bucket_of(max(1, max_nodes), self.buckets)
        wanted = {bucket_of(s, self.buckets) for s in sizes if 1 <= s <= max_nodes} if sizes else set()
        warmed = sorted(wanted) or [b for b in self.buckets if b <= top]
        self.warmed = tuple(sorted(set(self.warmed) | set(warmed)))
        cold = [b for b in warmed if self._cold(b)] if helpers and warm_helpers.can_help(self) else []
        mine, started = warm_helpers.start(self, cold)
        for b in [b for b in warmed if b not in cold] + mine:  # loads first: the helpers are still starting
            self._warm_bucket(b)
        if then is not None:
            then()
        for helper in started:
            theirs = ", ".join(map(str, helper.buckets))
            with notice_if_slow(f"waiting for a helper process compiling the target's step for {theirs}-node trees"):
                helper.wait()
            for b in helper.buckets:
                self._warm_bucket(b)  # loads what the helper saved (or compiles, where it failed)
        self.reset()
        return warmed

    def _warm_bucket(self, b: int) -> None:
        self.prefill(np.zeros(1, dtype=np.int64))
        self.tree_forward(DraftTree.from_parents(np.zeros(b, dtype=np.int64), np.arange(-1, b - 1)))

    def _cold(self, b: int) -> bool:
        """Whether bucket ``b``'s step as ``_warm_bucket`` runs it (after a one-token prefill) has
        neither a graph in this process nor a saved one to load."""
        shape = self._shape(b, 1, True, False)
        return shape not in self.step_fns and not precompile.entry_path(own_code(self._step, shape_tag(self.tag, shape))).exists()

    @torch.no_grad()
    def commit(self, path: np.ndarray) -> None:
        """Keep the past plus ``path``; slots past the new end are stale and masked from then on."""
        keep = len(path)
        path = np.asarray(path, dtype=np.int64)
        moved = np.nonzero(path != np.arange(keep))[0]
        if moved.size:
            first = self.past_len + int(moved[0])
            self.static.keep(first, torch.as_tensor(path[moved[0]:] + self.past_len, device=self.device))
        self.past_len += keep


def _allow_recompiles(limit: int = 64) -> None:
    """Regions (one set of functions for every shape) compile a graph per (bucket, span, features)
    pair: dynamo's default limit of 8 would fall back to eager silently after the eighth. (The
    whole-forward step has a function per shape, one graph each.)"""
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name) and getattr(cfg, name) < limit:
            setattr(cfg, name, limit)
