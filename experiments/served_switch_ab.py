"""A load-time switch served: each method's tokens/s on two targets loaded with the switch off and
on, in one process, generations interleaved with the order alternating.

Why: two benches run one after the other (the switch off, then on) compare two moments of this
machine as much as two settings. In stop 63 four such benches (off, on, on, off) put the rotary op
between -3% and +9% of the baseline, while the op took 3-6% off each forward of the target alone.
Here both settings run in one process on the same prompts, each generation of one setting next to
the other's, and the side that goes first alternates (``eager_switch_ab.py`` found the second of a
pair ran up to 2-4% faster). ``--load-order`` picks which target loads first: the first-loaded one
ran slower in ``eager_switch_ab.py --null``; run both orders.

    python experiments/served_switch_ab.py --switch SPECBLOCK_ROTARY_OP [--methods ar,specblock] [--load-order on,off]

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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

from eager_switch_ab import SWITCHES, load_with  # noqa: E402
from specblock.models import resolve_target  # noqa: E402
from specblock.prompts import load_prompts  # noqa: E402
from specblock.runtime import chat  # noqa: E402
from specblock.runtime.bench import Targets, build_engine  # noqa: E402
from specblock.runtime.bench_config import method_options  # noqa: E402
from specblock.runtime.cli import load_tokenizer  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--switch", choices=SWITCHES, required=True)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="packed-fp16")
    ap.add_argument("--methods", default="ar,specblock,eagle3", help="bench method names, at their serving settings")
    ap.add_argument("--domains", default="code,math,chat,qa,mtbench")
    ap.add_argument("--prompts", type=int, default=1, help="per domain")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3, help="timed generations per prompt, method and side")
    ap.add_argument("--load-order", default="off,on")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "served_switch_ab")
    args = ap.parse_args(argv)
    order = args.load_order.split(",")
    if sorted(order) != ["off", "on"]:
        raise SystemExit(f"--load-order {args.load_order!r}: name off and on, in the order to load them")
    torch.set_num_threads(args.threads)
    path = resolve_target(args.target)
    targets = {side: Targets(load_with(path, args.dtype, args.switch, side), "whole") for side in order}
    tok = load_tokenizer(path, False)
    prompts = [chat.encode_prompt(tok, p) for d in args.domains.split(",") for p in load_prompts(d, args.prompts)]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    engine_args = argparse.Namespace(set=[], method_options=method_options([], methods), drafter_dir=None,
                                     compile=False, budget=None)
    rows = []
    for m in methods:
        engines = {side: build_engine(m, targets[side], engine_args, frozenset()) for side in order}
        outputs: dict[str, list] = {side: [] for side in order}
        for side in order:  # untimed warm-up
            engines[side].generate(prompts[0][-16:], 8)
        rates: dict[str, list[float]] = {side: [] for side in order}
        turn = 0
        for ids in prompts:
            for _ in range(args.rounds):
                for side in (order if turn % 2 == 0 else order[::-1]):
                    start = time.perf_counter()
                    res = engines[side].generate(ids, args.tokens)
                    rates[side].append(len(res.token_ids) / (time.perf_counter() - start))
                    outputs[side].append(list(res.token_ids))
                turn += 1
        off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
        rows.append({"method": m, "off_tok_s": round(off, 2), "on_tok_s": round(on, 2), "ratio": round(on / off, 3),
                     "same_outputs": outputs["off"] == outputs["on"], "generations": len(rates["on"])})
        print(rows[-1], flush=True)
    cmd = "python experiments/served_switch_ab.py " + " ".join(argv if argv is not None else sys.argv[1:])
    res = {"command": cmd, **{k: v for k, v in vars(args).items() if k != "out"}, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    lines = [f"`{cmd}` ({args.target}, {args.dtype}, {args.threads} threads; {len(prompts)} prompts x {args.rounds} "
             f"rounds x {args.tokens} new tokens per method and side, interleaved, the first side alternating, "
             f"loaded {args.load_order}; medians of the generations' tokens/s)", "",
             "| method | off tokens/s | on tokens/s | on / off | same outputs |", "|---|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['off_tok_s']:.2f} | {r['on_tok_s']:.2f} | {r['ratio']:.3f} | {r['same_outputs']} |"
              for r in rows]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
