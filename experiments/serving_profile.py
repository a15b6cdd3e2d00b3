"""Where a served method's CPU time goes: ``torch.profiler`` over whole generations, ops by self time.

Why: after stop 62 took small ops out of the eager forward (norms, rotary's cos/sin, q/k/v calls),
this says what is left, per op, for one method at its serving settings, target and drafter
together, and the drafter's propose/accept medians beside it.

    python experiments/serving_profile.py [--method specblock] [--domain chat] [--prompts 2] [--tokens 48]

Writes ``--out``.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specblock.models import resolve_target  # noqa: E402
from specblock.prompts import load_prompts  # noqa: E402
from specblock.runtime import chat, drafters  # noqa: E402
from specblock.runtime.cli import load_tokenizer  # noqa: E402
from specblock.runtime.engine import Engine  # noqa: E402
from specblock.runtime.target import TargetModel  # noqa: E402
from specblock.runtime.verify import GreedyVerifier  # noqa: E402


def timed(calls: list[float], f):
    def wrapper(*a, **k):
        start = time.perf_counter()
        out = f(*a, **k)
        calls.append(time.perf_counter() - start)
        return out
    return wrapper


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="packed-fp16")
    ap.add_argument("--method", default="specblock")
    ap.add_argument("--domain", default="chat")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "serving_profile")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = resolve_target(args.target)
    target = TargetModel.load(path, args.dtype, "cpu")
    tok = load_tokenizer(path, False)
    opts = drafters.serving_settings(args.method, target, {})
    budget = int(opts.pop("budget", drafters.DEFAULT_BUDGET))
    drafter = drafters.build(args.method, target, opts)
    engine = Engine(target, drafter, GreedyVerifier(), budget, set())  # no stop tokens: every run the same length
    prompts = [chat.encode_prompt(tok, p) for p in load_prompts(args.domain, args.prompts)]
    engine.generate(prompts[0], 16)  # warm-up, unprofiled
    calls: dict[str, list[float]] = {"propose": [], "accept": []}
    drafter.propose, drafter.accept = timed(calls["propose"], drafter.propose), timed(calls["accept"], drafter.accept)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for ids in prompts:
            engine.generate(ids, args.tokens)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    rows = [{"op": e.key, "calls": e.count, "self_ms": round(e.self_cpu_time_total / 1e3, 2),
             "share": round(e.self_cpu_time_total / total, 4)} for e in events[: args.top]]
    medians = {k: round(1e3 * statistics.median(v), 3) for k, v in calls.items() if v}
    cmd = "python experiments/serving_profile.py " + " ".join(argv if argv is not None else sys.argv[1:])
    res = {"command": cmd, "target": args.target, "dtype": args.dtype, "method": args.method, "budget": budget,
           "domain": args.domain, "prompts": args.prompts, "tokens": args.tokens, "threads": args.threads,
           "self_ms_total": round(total / 1e3, 2), "median_ms": medians, "iterations": len(calls["propose"]), "ops": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    lines = [f"`{cmd}` ({args.target}, {args.dtype}, {args.method} at budget {budget}, {args.prompts} {args.domain} "
             f"prompts x {args.tokens} tokens, {args.threads} threads; profiler self CPU time, {total / 1e3:.0f} ms in all "
             f"over {len(calls['propose'])} iterations; propose / accept medians {medians.get('propose')} / "
             f"{medians.get('accept')} ms, timed under the profiler)", "",
             "| op | calls | self ms | share |", "|---|---|---|---|"]
    lines += [f"| `{r['op']}` | {r['calls']} | {r['self_ms']:.1f} | {100 * r['share']:.1f}% |" for r in rows]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
