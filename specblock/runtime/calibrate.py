"""``python -m specblock.runtime calibrate``: the latency JSON the simulator's calibrated model reads.

Measures, on this machine and in the serving dtype: one target forward of n = 1..64 tree tokens
at several contexts (KV cache already holding ``ctx`` tokens, a random tree each time), each
shipped drafter's forward at several query counts, and the per-iteration glue (tree masks,
greedy verification, KV pruning). Medians of repeated runs. Format: ``specblock.sim.latency``.

``--compile`` times the same on the compiled target and SpecBlock's compiled block 1 (``--compile``
of the CLI; later blocks run eagerly there as here), so the simulator can price the compiled path:
there a tree costs relatively more than eagerly (T(4) about 1.3x T(1) against 1.1x), which moves
every method's best budget. First use compiles each tree bucket and span of the grid (minutes).
SpecBlock's block 1 is compiled beside an eager target too where its ``serving.json`` says
``drafter_compiled`` for this target and CPU, as the CLI and the bench serve it (``--eager-drafter``:
not); its time is ``first_ms``, which the simulator charges for a step's first forward.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from specblock.atomic import check_output, write_atomic
from specblock.cpu import cpu_kind, cpu_model
from specblock.errors import SpecBlockError
from specblock.flags import OneLineParser
from specblock.policies.tree import DraftTree
from specblock.models import drafters_dir
from specblock.runtime.config import validate
from specblock.runtime.drafters import drafter_compiled, serving_settings
from specblock.runtime.drafters.base import DraftRequest
from specblock.runtime.target import DTYPE_CHOICES, DTYPE_HELP, TargetModel, resolve_dtype
from specblock.runtime.verify import GreedyVerifier

#: Every size up to 8: our kernels' cost is not linear between powers of two (packed-q4-amx without
#: tiles ran 5 rows as passes of 4 + 1, each decoding the weights again: 5.61 ms of linears against
#: 4.12 at 4 and 6.62 at 8, bf16_rows_zen5_s69 / _pad_s70; each size's pass shape still differs since
#: stop 71's one-pass kernel), and served trees are mostly 2-8 nodes.
N_GRID = [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 20, 24, 32, 48, 64]
CTX_GRID = [64, 256, 512]
#: ``--compile``: the compiled target attends over a power-of-two span (``compiled.target.span_of``),
#: so its cost steps up where ``ctx + n`` passes 256 or 512. Contexts that leave room for a 64-node
#: tree inside each span measure the spans, not the steps: at 256 every tree already paid span
#: 512 (``--ctx 64,256``: T(1) 11.0 ms at 256 against 9.3 at 64). Where the fused attention op runs
#: (packed-fp16 and q4 on AVX512) the span is the whole buffer (``StaticTarget.one_span``): no steps
#: there, and the grid still spans the contexts.
CTX_GRID_COMPILED = [64, 192, 448]


def _sync(target: TargetModel) -> None:
    if target.device.type == "cuda":
        torch.cuda.synchronize(target.device)


def _random_tree(rng: np.random.Generator, n: int, vocab: int) -> DraftTree:
    parent = np.concatenate([[-1], (rng.random(n - 1) * np.arange(1, n)).astype(np.int64)])
    return DraftTree.from_parents(rng.integers(0, vocab, n), parent)


def rewind(target: TargetModel, ctx: int) -> None:
    """Back to exactly ``ctx`` cached tokens (a static cache's slots past it are just stale)."""
    if target.cache is not None:
        for layer in target.cache.layers:
            layer.keys, layer.values = layer.keys[..., :ctx, :], layer.values[..., :ctx, :]
    target.past_len = ctx


def time_target(target: TargetModel, ctx: int, n: int, reps: int, rng) -> tuple[float, float]:
    """Median ms of one tree forward of n tokens at context ctx; also the glue (mask + verify + commit)."""
    target.prefill(rng.integers(0, target.vocab_size, ctx))
    verifier = GreedyVerifier()
    target.tree_forward(_random_tree(rng, n, target.vocab_size))  # untimed: a compiled target's first call of a shape compiles
    rewind(target, ctx)
    fwd, glue = [], []
    for _ in range(reps):
        tree = _random_tree(rng, n, target.vocab_size)
        _sync(target)
        t0 = time.perf_counter()
        out = target.tree_forward(tree)
        _sync(target)
        t1 = time.perf_counter()
        verdict = verifier.verify(tree, out.logits)
        target.commit(verdict.path[:1])  # keep the root only: the context stays at ctx + 1
        _sync(target)
        t2 = time.perf_counter()
        rewind(target, ctx)
        fwd.append(t1 - t0)
        glue.append(t2 - t1)
    return 1e3 * statistics.median(fwd), 1e3 * statistics.median(glue)


def time_specblock(target: TargetModel, path: Path, reps: int, rng, compiled: bool = False) -> dict:
    """SpecBlock block forwards at 1..4 seeds, cache at ~256 context, each right after a target
    forward as in the loop, and the host work around them in a whole ``propose`` (tree
    building, seed choice, copies to the host).

    ``n_query`` labels a later block by S*K queries (the forward runs S*(K+1) positions; ``K``
    lets the simulator convert). ``overhead_ms``: median(propose) minus its network forwards, per
    forward, over M = 1, 2 and S = 1..4 under fixed top-2 widths (so no branch is cut and every
    block runs); the simulator adds it to each drafter forward. ``first_ms``: block 1's forward
    (compiled where ``compiled``), which the simulator charges for a step's first forward.
    """
    from specblock.policies.branching import RankBucketBranching
    from specblock.runtime.drafters import build

    d = build("specblock", target, {"drafter": str(path)})  # as served: its dtype and linears beside this target
    if compiled:  # block 1 on static buffers, compiled (the CLI's hook: compiled/ sits above runtime/)
        from specblock.runtime.cli import maybe_compile_drafter

        d = maybe_compile_drafter(d, target)
    static = hasattr(d, "_new")  # the compiled drafter keeps its new positions raw, fused in its step
    target.want_features = True
    prompt = rng.integers(0, target.vocab_size, 256)
    d.prefill(prompt, target.prefill(prompt[:-1]))
    if static:
        taps, toks = d._new
        last = (taps[-1:].clone(), toks[-1:].clone())
        d._new = (taps[:-1], toks[:-1])
        d.pending = d._new[0]
    else:
        pending, pending_pos = d.pending[-1:].clone(), d.pending_pos[-1:].clone()
        d.pending, d.pending_pos = d.pending[:-1], d.pending_pos[:-1]
    d.propose(DraftRequest(tokens=prompt[:-1], budget=4, max_depth=64))  # caches the prompt but its last position
    cache, cached = d.cache, getattr(d, "cached", None)
    k, h = d.net.cfg.K, d.net.cfg.hidden_size
    req = DraftRequest(tokens=prompt, budget=64, max_depth=64)

    def steady() -> None:  # the state after an iteration that accepted nothing: one pending row
        d._root_pos = len(prompt) - 1
        if static:  # the one new position goes to the same slot each time
            d.cached, d._new, d.pending = cached, last, last[0]
        else:
            d.cache, d.pending, d.pending_pos = cache, pending, pending_pos

    past = target.past_len

    def target_turn() -> None:
        """A target tree forward before each timed call, untimed, as in the decode loop: timed
        back to back, the drafter ran with its weights hot in the CPU caches and calibrated
        about 1 ms per forward below what the loop then measured."""
        target.tree_forward(_random_tree(rng, 8, target.vocab_size))
        rewind(target, past)

    def median_ms(fn) -> float:
        times = []
        with torch.no_grad():
            target_turn()
            steady()
            fn()  # untimed: a compiled block's first call of a shape compiles
            for _ in range(reps):
                target_turn()
                steady()
                _sync(target)
                t0 = time.perf_counter()
                fn()
                _sync(target)
                times.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(times)

    first = median_ms(lambda: d._candidates(d._first_block(int(prompt[-1]))[0]))
    n_query, ms = [], []
    for s in (1, 2, 3, 4):
        g = torch.randn(s, h, device=target.device, dtype=d.dtype)
        pos = torch.full((s,), 256, device=target.device)
        n_query.append(s * k)
        ms.append(round(median_ms(lambda: d._candidates(d._seed_block(g, pos))), 4))
    d.policy = RankBucketBranching((2, 2, 2, 2))
    extra = []
    for m in (1, 2):
        for s in (1, 2, 3, 4):
            d.M, d.max_seeds = m, s
            steady()
            blocks = int(d.propose(req).block.max()) + 1
            net_ms = first + (ms[s - 1] if blocks > 1 else 0.0)
            extra.append(max(median_ms(lambda: d.propose(req)) - net_ms, 0.0) / blocks)
    return {"ms_per_forward": ms[0], "K": k, "n_query": n_query, "ms": ms,
            "overhead_ms": round(statistics.median(extra), 4), "first_ms": round(first, 4), "compiled": compiled}


def _ctx_list(text: str) -> list[int]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: give context lengths as positive integers, e.g. 64,256,1024")
    return [int(p) for p in parts]


def main(argv: list[str]) -> int:
    ap = OneLineParser(prog="python -m specblock.runtime calibrate", description=__doc__.splitlines()[0])
    ap.add_argument("--target", help="a model name (see `models`) or an HF model directory (default: the real chat model)")
    ap.add_argument("--out", type=Path, default=Path("specblock/sim/data/latency_cpu.json"))
    ap.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    ap.add_argument("--reps", type=int, default=15, help="timed repetitions per point (at least 1)")
    ap.add_argument("--ctx", type=_ctx_list, help="context lengths, e.g. 64,256,1024 (default: "
                    f"{','.join(map(str, CTX_GRID))}; with --compile {','.join(map(str, CTX_GRID_COMPILED))})")
    ap.add_argument("--drafter-dir", type=Path, help="drafters to time (default: those shipped for the target)")
    ap.add_argument("--compile", action="store_true",
                    help="time the compiled target and SpecBlock's compiled block (the CLI's --compile)")
    ap.add_argument("--eager-drafter", action="store_true",
                    help="time SpecBlock's block 1 eager where its serving.json names drafter_compiled or --compile "
                         "would compile it (the CLI's flag)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default), as bench's")
    args = ap.parse_args(argv)
    if args.reps < 1:
        raise SpecBlockError("--reps: give at least 1 timed repetition")
    if args.threads < 0:
        raise SpecBlockError("--threads: give 0 (torch's default) or a positive count")
    if args.threads:
        torch.set_num_threads(args.threads)
    check_output(args.out, "--out", make_parents=True)
    cfg = validate({"target": args.target, "dtype": args.dtype})
    args.dtype = resolve_dtype(args.dtype, "auto", cfg.target_dir)  # the latency JSON records what ran, never "auto"
    target = TargetModel.load(cfg.target_dir, args.dtype, "auto")
    if args.compile:
        from specblock.runtime.cli import maybe_compile

        target = maybe_compile(target, True)
    drafter_dir = args.drafter_dir or drafters_dir(cfg.target_dir)
    rng = np.random.default_rng(0)
    ctxs = [c for c in args.ctx or (CTX_GRID_COMPILED if args.compile else CTX_GRID) if c + 64 < target.max_context]
    if not ctxs:
        raise SpecBlockError(f"--ctx: every length leaves under 64 positions of the model's context "
                             f"({target.max_context}); give lengths below {target.max_context - 64}")
    ms, glue = [], []
    with tqdm(total=len(ctxs) * len(N_GRID), desc="target") as bar:
        for ctx in ctxs:
            row = []
            for n in N_GRID:
                f, g = time_target(target, ctx, n, args.reps, rng)
                row.append(round(f, 4))
                glue.append(g)
                bar.update(1)
            ms.append(row)
    drafters = {}
    if (drafter_dir / "specblock" / "config.json").is_file():
        served = serving_settings("specblock", target, {"drafter": str(drafter_dir / "specblock")})
        compiled = drafter_compiled(served, args.compile, args.eager_drafter)  # as the CLI serves it
        drafters["specblock"] = time_specblock(target, drafter_dir / "specblock", args.reps, rng, compiled)
    device = f"{target.device.type}: {torch.get_num_threads()} threads, {cpu_model()} ({cpu_kind()})"
    result = {"version": 1, "device": device, "dtype": args.dtype, "compiled": args.compile,
              "target": {"ctx": ctxs, "n": N_GRID, "ms": ms}, "drafters": drafters,
              "overhead_ms": round(statistics.median(glue), 4)}
    write_atomic(args.out, json.dumps(result, indent=1))
    print(json.dumps({"ctx": ctxs, "n": N_GRID, "ms_at_first_ctx": ms[0], "drafters": drafters,
                      "overhead_ms": result["overhead_ms"]}))
    print(f"wrote {args.out}")
    return 0
