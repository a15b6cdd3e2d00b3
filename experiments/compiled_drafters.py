"""Do compiled drafter forwards pay on this CPU? Propose time per iteration, eager against
``torch.compile`` of each drafter's network calls, in one process (issue 16, item 2).

What is compiled: SpecBlock's block forward (``run_serving``) and heads, EAGLE-3's decoder layer
and logits, Medusa's heads; ``dynamic=True`` because the drafter's cache grows every step (a
static-shape drafter would need a static cache of its own). The tree policy, top-k and the host
copies stay eager: they are part of what a drafter costs. Drafts never change the output (the
target verifies), so this measures speed only; tau is printed to show the trees stayed the same.

    python experiments/compiled_drafters.py [--methods specblock,eagle3,medusa] [--dtype packed-fp16]
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

from specblock.compiled.precompile import use_disk_cache  # noqa: E402
from specblock.compiled.target import _allow_recompiles  # noqa: E402
from specblock.models import resolve_target  # noqa: E402
from specblock.prompts import load_prompts  # noqa: E402
from specblock.runtime import drafters  # noqa: E402
from specblock.runtime.chat import encode_prompt  # noqa: E402
from specblock.runtime.cli import load_tokenizer  # noqa: E402
from specblock.runtime.engine import Engine  # noqa: E402
from specblock.runtime.target import TargetModel  # noqa: E402
from specblock.runtime.verify import GreedyVerifier  # noqa: E402

#: per method, the network attributes replaced by compiled versions (object path, attribute)
COMPILED = {
    "specblock": [("net", "run_serving"), ("net", "heads")],
    "eagle3": [("net.layer", "forward"), ("net", "logits")],
    "medusa": [("net", "logits")],
}


def compile_drafter(drafter) -> None:
    for path, attr in COMPILED[drafter.name]:
        obj = drafter
        for part in path.split("."):
            obj = getattr(obj, part)
        setattr(obj, attr, torch.compile(getattr(obj, attr), dynamic=True))


def propose_ms(eng: Engine, prompts: list[list[int]], tokens: int, reps: int) -> tuple[list[float], float]:
    out, tau = [], []
    for _ in range(reps):
        it = draft = 0.0
        for ids in prompts:
            st = eng.generate(ids, tokens).stats
            it, draft = it + st.iterations, draft + st.draft_s
            tau.append(st.tau)
        out.append(1e3 * draft / it)
    return out, statistics.mean(tau)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--methods", default="specblock,eagle3,medusa")
    ap.add_argument("--dtype", default="packed-fp16")
    ap.add_argument("--domains", default="code,chat")
    ap.add_argument("--prompts", type=int, default=1, help="per domain")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "compiled_drafters")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    use_disk_cache()
    _allow_recompiles()
    path = resolve_target(args.target)
    target = TargetModel.load(path, args.dtype, "cpu")
    tok = load_tokenizer(path, False)
    # through the chat template, as the bench and the server send them (a chat model's drafters trained on that)
    prompts = [encode_prompt(tok, p) for d in args.domains.split(",") for p in load_prompts(d, args.prompts)]
    rows = []
    for method in args.methods.split(","):
        settings = drafters.serving_settings(method, target, {})
        drafter = drafters.build(method, target, settings)
        eng = Engine(target, drafter, GreedyVerifier(), settings.get("budget", 8))
        eng.generate(prompts[0][-16:], 8)
        eager, tau_e = propose_ms(eng, prompts, args.tokens, args.reps)
        compile_drafter(drafter)
        t0 = time.perf_counter()
        eng.generate(prompts[0][-16:], 8)  # compiles
        for ids in prompts:  # shapes the short warm-up did not meet
            eng.generate(ids, args.tokens)
        first_s = time.perf_counter() - t0
        comp, tau_c = propose_ms(eng, prompts, args.tokens, args.reps)
        rows.append({"method": method, "settings": settings, "eager_ms": eager, "compiled_ms": comp,
                     "tau_eager": round(tau_e, 3), "tau_compiled": round(tau_c, 3), "first_use_s": round(first_s, 1)})
        print(json.dumps(rows[-1]), flush=True)
    med = statistics.median
    lines = [f"Propose ms per iteration (median of {args.reps} runs over {args.prompts} prompt(s) x {args.domains}, "
             f"{args.tokens} new tokens), {args.dtype} target, {torch.get_num_threads()} threads; each drafter at its "
             "serving.json settings. First use: the compiling pass (warm-up plus one pass over the prompts).", "",
             "| method | eager ms | compiled ms | ratio | tau eager / compiled | first use s |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {med(r['eager_ms']):.2f} | {med(r['compiled_ms']):.2f} | "
                     f"{med(r['compiled_ms']) / med(r['eager_ms']):.2f} | {r['tau_eager']:.2f} / {r['tau_compiled']:.2f} | "
                     f"{r['first_use_s']} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"rows": rows, "args": {k: str(v) for k, v in vars(args).items()}},
                                                        indent=1))
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
