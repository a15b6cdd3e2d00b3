"""Where a SpecBlock or EAGLE-3 propose goes, part by part, in a real decode loop.

Why: ``drafter_cost.py`` gives a propose's whole time; this splits it, timing the parts of the
drafter that runs (wrapped in place, after a first pass that compiles and warms everything): the
whole propose (the lookup branch's included where the method has one), SpecBlock's own propose,
its block 1 (``_first_block``) and the compiled call inside it (``_run_block``), the candidates'
host copy and ``grow_block``; for EAGLE-3 (``--method eagle3@c``) the flush of committed positions
and its compiled call, each depth step's compiled call, the host copies of top-k, the tree's
expansion and the final rerank. Medians over every call of a second pass over the prompts.

    SPECBLOCK_Q4_KERNEL=int8 python experiments/propose_parts.py --method specblock+lookup@c --dtype q4 \
        --threads 2 --out experiments/results/propose_parts
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))  # results_io beside it, however it is loaded

from specblock.models import resolve_target  # noqa: E402
from specblock.prompts import load_prompts  # noqa: E402
from specblock.runtime import chat  # noqa: E402
from specblock.runtime.bench import Targets, build_engine  # noqa: E402
from specblock.runtime.bench_config import method_options  # noqa: E402
from specblock.runtime.cli import load_tokenizer  # noqa: E402
from specblock.compiled import eagle3 as eagle3_module  # noqa: E402
from specblock.runtime.drafters import specblock as specblock_module  # noqa: E402
from specblock.runtime.q4 import default_kernel  # noqa: E402
from specblock.runtime.target import TargetModel  # noqa: E402
from results_io import write_results  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--method", default="specblock+lookup@c", help="a bench method name with SpecBlock's or EAGLE-3's drafter (run compiled)")
    ap.add_argument("--dtype", default="q4")
    ap.add_argument("--domains", default="code,chat,math")
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], metavar="METHOD:KEY=VALUE",
                    help="more of the bench's per-method options, e.g. eagle3@c:budget=1")
    ap.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "propose_parts")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = resolve_target(args.target)
    targets = Targets(TargetModel.load(path, args.dtype, "cpu"), "whole")
    tok = load_tokenizer(path, False)
    prompts = [chat.encode_prompt(tok, p) for d in args.domains.split(",") for p in load_prompts(d, args.prompts)]
    sets = [f"{args.method}:compiled=true", *args.set]  # the static drafter and the compiled target, as the bench's --set
    eng = build_engine(args.method, targets, argparse.Namespace(set=sets, method_options=method_options(sets, [args.method]),
                                                                drafter_dir=None, compile=False, budget=None), frozenset())
    eng.warm_compiled()
    times: dict[str, list[float]] = defaultdict(list)

    def wrap(obj, name: str, label: str) -> None:
        fn = getattr(obj, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            times[label].append(time.perf_counter() - t0)
            return out

        setattr(obj, name, timed)

    outer = eng.drafter
    inner = getattr(outer, "inner", outer)
    with torch.no_grad():
        for ids in prompts:  # compiles and warms every shape met
            eng.generate(ids, args.tokens)
        wrap(outer, "propose", "propose, all")
        if inner is not outer:
            wrap(inner, "propose", f"{inner.name}'s propose")
        if isinstance(inner, eagle3_module.StaticEagle3Drafter):
            wrap(inner, "_flush_static", "flush")
            wrap(inner, "flush", "flush's compiled call")
            wrap(inner, "depth_step", "depth step's compiled call")
            wrap(inner, "_unpack", "top-k to host")
            wrap(eagle3_module, "expand", "expand")
            wrap(inner.policy, "prune", "rerank to the budget")
        else:
            wrap(inner, "_first_block", "block 1")
            if hasattr(inner, "_run_block"):
                wrap(inner, "_run_block", "block 1's compiled call")
            wrap(inner, "_candidates", "candidates to host")
            wrap(specblock_module, "grow_block", "grow_block")
        wrap(eng.target, "tree_forward", "verify: the target's tree forward")
        for ids in prompts:
            eng.generate(ids, args.tokens)
    rows = [{"part": k, "calls": len(v), "median_ms": round(1e3 * statistics.median(v), 3)} for k, v in times.items()]
    kernel = f" ({default_kernel()} kernel)" if args.dtype == "q4" else ""
    lines = [f"`python experiments/propose_parts.py --method {args.method} --dtype {args.dtype} --domains {args.domains} "
             f"--prompts {args.prompts} --tokens {args.tokens} --threads {args.threads}"
             + "".join(f" --set {x}" for x in args.set) + f" --out {args.out}`{kernel}: "
             "median ms a call over a second pass (parts nest: a call holds the compiled call inside it)", "",
             "| part | calls | median ms |", "|---|---|---|"]
    lines += [f"| {r['part']} | {r['calls']} | {r['median_ms']:.3f} |" for r in rows]
    write_results(args.out, args, rows, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
