"""What a decode iteration costs, in dispatched torch ops and in milliseconds, per method.

Why: on this CPU the shipped target's forward is ~6 ms whatever the tree size up to ~16 tokens,
and a 2-layer drafter's forward is ~4 ms, far more than its FLOPs (a few percent of the target's)
would predict. At these sizes a kernel costs about the same whatever its shape, so time follows
the number of ops dispatched, not FLOPs. This script measures both per phase of the decode loop
(propose = drafting, verify = the target's tree forward plus verification, accept = commit and the
drafter's update), so "the drafter is too slow" is a measured statement with its cause.

Op counts are exact and do not depend on load (a ``TorchDispatchMode`` counts every aten op that
reaches the dispatcher); milliseconds are medians from separate, uncounted runs and need a quiet
machine (``uptime`` load under 0.5).

    python experiments/drafter_cost.py [--methods ar,lookup,specblock,eagle3,...] [--prompts 2]
        [--target lab|smollm2-135m-instruct|DIR] [--dtype bfloat16|packed-fp16|...] [--budget N|serving]
        [--set METHOD:KEY=VALUE ...]

``--budget serving`` runs each drafter at its ``serving.json`` settings (budget, M, widths), as the
CLI and the bench do when no flag is given; ``--set`` overrides them per method as in the bench
(``--methods specblock,specblock@m2 --set specblock@m2:M=2``). Engines are built by the bench's own
``build_engine``, so every bench method name works here: ``METHOD+lookup`` (prompt lookup's branch),
``--set METHOD:compiled=true`` (the compiled target) and ``--set METHOD:drafter_compiled=...``.
A method on the compiled target gets no op count (``-``): its graphs dispatch no aten ops one by
one, and a dispatch mode around them would only make dynamo trace again. Prompts go through the
chat template, as the bench's do.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specblock.errors import SpecBlockError  # noqa: E402
from specblock.prompts import load_prompts  # noqa: E402
from specblock.runtime import chat  # noqa: E402
from specblock.runtime.bench import Targets, build_engine  # noqa: E402
from specblock.runtime.bench_config import method_options  # noqa: E402
from specblock.runtime.cli import load_tokenizer  # noqa: E402
from specblock.models import resolve_target  # noqa: E402
from specblock.compiled import drafter as static_drafter  # noqa: E402
from specblock.runtime import drafters  # noqa: E402
from specblock.runtime.drafters.layers import RMSNorm  # noqa: E402
from specblock.runtime.q4 import Int8Linear, default_kernel as q4_kernel  # noqa: E402
from specblock.runtime.target import TargetModel  # noqa: E402


class OpCounter(TorchDispatchMode):
    """Counts aten ops; ``phase`` names where they are charged."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = defaultdict(int)
        self.phase = "other"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[self.phase] += 1
        return func(*args, **(kwargs or {}))


def _charge(counter: OpCounter, obj, name: str, phase: str) -> None:
    fn = getattr(obj, name)

    def wrapped(*a, **k):
        prev, counter.phase = counter.phase, phase
        try:
            return fn(*a, **k)
        finally:
            counter.phase = prev

    setattr(obj, name, wrapped)


def measure(method: str, targets: Targets, prompts: list[list[int]], tokens: int, reps: int, args) -> dict:
    """``args``: what the bench's ``build_engine`` reads (``set``, ``budget``, ``compile``, ``drafter_dir``)."""
    eng = build_engine(method, targets, args, frozenset())
    budget_n = eng.budget
    eng.generate(prompts[0][-16:], 8)  # warm-up
    times = defaultdict(list)
    for _ in range(reps):
        it = draft = verify = glue = 0.0
        taus = []
        for ids in prompts:
            st = eng.generate(ids, tokens).stats
            it += st.iterations
            taus.append(st.tau)
            draft, verify, glue = draft + st.draft_s, verify + st.verify_s, glue + st.commit_s
        times["propose"].append(1e3 * draft / it)
        times["verify"].append(1e3 * verify / it)
        times["accept"].append(1e3 * glue / it)
    inner = getattr(eng.drafter, "inner", eng.drafter)
    net = getattr(inner, "net", None) or getattr(inner, "model", None)
    int8 = sum(isinstance(m, Int8Linear) for m in net.modules()) if isinstance(net, torch.nn.Module) else 0
    norm_ops = sum(isinstance(m, RMSNorm) and m.op for m in net.modules()) if isinstance(net, torch.nn.Module) else 0
    row = {"method": method, "budget": budget_n, "tau": round(statistics.mean(taus), 3), "int8_linears": int8,
           "norm_ops": norm_ops, "fused_attention": bool(getattr(inner, "fused_attention", False))}
    compiled = eng.target is targets._compiled or getattr(inner, "compiled", False)
    if compiled:
        for phase in ("propose", "verify", "accept"):
            row |= {f"{phase}_ops": None, f"{phase}_ms": round(statistics.median(times[phase]), 3),
                    f"{phase}_us_per_op": None}
        return row
    counter = OpCounter()
    _charge(counter, eng.drafter, "propose", "propose")
    _charge(counter, eng.target, "tree_forward", "verify")
    _charge(counter, eng.verifier, "verify", "verify")
    _charge(counter, eng.target, "commit", "accept")
    _charge(counter, eng.drafter, "accept", "accept")
    iters, tau = 0, []
    with counter, torch.no_grad():
        for ids in prompts:
            st = eng.generate(ids, tokens).stats
            iters += st.iterations
            tau.append(st.tau)
    row |= {"iterations": iters, "tau": round(statistics.mean(tau), 3)}
    for phase in ("propose", "verify", "accept"):
        ops = counter.ops[phase] / iters
        ms = statistics.median(times[phase])
        row[f"{phase}_ops"] = round(ops, 1)
        row[f"{phase}_ms"] = round(ms, 3)
        row[f"{phase}_us_per_op"] = round(1e3 * ms / ops, 2) if ops else None
    return row


def _kernel(meta: dict) -> str:
    return f" ({meta['q4_kernel']} kernel)" if meta.get("q4_kernel") else ""


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"Per decode iteration, {meta['prompts']} prompts x {meta['domains']}, {meta['tokens']} new tokens, "
             f"{meta.get('dtype', 'bfloat16')}{_kernel(meta)}, {meta['threads']} threads; ms: median of {meta['reps']} runs. "
             "ops: aten ops dispatched.", "",
             "| method | budget | tau | propose ops | propose ms | verify ops | verify ms | accept ops | accept ms "
             "| us/op propose | us/op verify |", "|---" * 11 + "|"]
    f = lambda x: "-" if x is None else f"{x:.1f}"
    n = lambda x: "-" if x is None else f"{x:.0f}"
    for r in rows:
        lines.append(f"| {r['method']} | {r.get('budget', meta['budget'])} | {r['tau']:.2f} | {n(r['propose_ops'])} | {r['propose_ms']:.2f} | "
                     f"{n(r['verify_ops'])} | {r['verify_ms']:.2f} | {n(r['accept_ops'])} | {r['accept_ms']:.2f} | "
                     f"{f(r['propose_us_per_op'])} | {f(r['verify_us_per_op'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="lab", help="a model name or directory")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--methods", default="ar,lookup,specblock,eagle3")
    ap.add_argument("--domains", default="code,chat")
    ap.add_argument("--prompts", type=int, default=2, help="per domain")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget", default="24", help="node budget, or 'serving': each drafter's serving.json")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], metavar="METHOD:KEY=VALUE")
    ap.add_argument("--compile", action="store_true", help="every method on the compiled target (as the bench's)")
    ap.add_argument("--sdpa-drafter", action="store_true",
                    help="also time each compiled SpecBlock drafter with SDPA attention (the row 'METHOD [sdpa]'), "
                         "the baseline of its fused op")
    ap.add_argument("--q4-drafters", action="store_true",
                    help="beside a q4 target on the int8 kernel, also time each drafter with its linears rounded to "
                         "Q4_1 instead of Q8_0 (the row 'METHOD [q4]')")
    ap.add_argument("--packed-drafters", action="store_true",
                    help="beside a packed target where drafters run int8 linears, also time each drafter with "
                         "packed fp16 linears (the row 'METHOD [packed]'), the baseline of its int8 ones")
    ap.add_argument("--formula-norms", action="store_true",
                    help="where a drafter serves its RMSNorms through the C++ op (beside a packed target), also time "
                         "it with the formula's 7 ops (the row 'METHOD [formula norms]'), the baseline of the op")
    ap.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "drafter_cost")
    args = ap.parse_args(argv)
    try:
        torch.set_num_threads(args.threads)
        if args.budget != "serving" and not args.budget.isdigit():
            raise ValueError(f"--budget takes a number or 'serving', not {args.budget!r}")
        path = resolve_target(args.target)
        targets = Targets(TargetModel.load(path, args.dtype, "cpu"), "whole")
        tok = load_tokenizer(path, False)
        prompts = [chat.encode_prompt(tok, p) for d in args.domains.split(",") for p in load_prompts(d, args.prompts)]
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        engine_args = argparse.Namespace(set=args.set, method_options=method_options(args.set, methods), drafter_dir=None,
                                         compile=args.compile, budget=None if args.budget == "serving" else int(args.budget))
        rows = []
        for m in methods:
            base = measure(m, targets, prompts, args.tokens, args.reps, engine_args)
            rows.append(base)
            # baselines and variants, each timed with one module setting changed: (asked, applies, module, name, value, label)
            variants = [(args.sdpa_drafter, base["fused_attention"], static_drafter, "USE_FUSED", False, "sdpa"),
                        (args.q4_drafters, base["int8_linears"], drafters, "DRAFTER_BITS", 4, "q4"),
                        (args.packed_drafters, base["int8_linears"], drafters, "INT8_DRAFTERS", False, "packed"),
                        (args.formula_norms, base["norm_ops"], drafters, "NORM_OP", False, "formula norms")]
            for asked, applies, module, name, value, label in variants:
                if asked and applies:
                    before = getattr(module, name)
                    setattr(module, name, value)
                    try:
                        rows.append(measure(m, targets, prompts, args.tokens, args.reps, engine_args) | {"method": f"{m} [{label}]"})
                    finally:
                        setattr(module, name, before)
    except (SpecBlockError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    meta = {"prompts": args.prompts, "domains": args.domains, "tokens": args.tokens, "reps": args.reps,
            "threads": torch.get_num_threads(), "budget": args.budget, "target": args.target, "dtype": args.dtype,
            "set": args.set, "compile": args.compile, "packed_drafters": args.packed_drafters, "sdpa_drafter": args.sdpa_drafter, "q4_drafters": args.q4_drafters,
            "formula_norms": args.formula_norms,
            "q4_kernel": q4_kernel() if args.dtype == "q4" else None}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = markdown(rows, meta)
    args.out.with_suffix(".md").write_text(md)
    print(md, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
