"""Which shipped drafters part from plain decoding at q4, per kernel: ours (int8, fp32) against torch's (bf16).

Why: ``tests/test_real_model.py`` asserts that on our kernel every shipped drafter, at its serving
settings, equals the q4 model's plain decoding on its two chat questions. This shows the same runs
on torch's int4 kernel, which rounds activations to bf16, so the test's questions are ones where
that kernel's near-ties do part (the test could fail).

    python experiments/q4_partings.py --tokens 48 --threads 2 --out experiments/results/q4_partings

Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from specblock.models import MODELS, resolve_target  # noqa: E402
from specblock.runtime import chat, drafters, q4  # noqa: E402
from specblock.runtime.cli import load_tokenizer  # noqa: E402
from specblock.runtime.engine import Engine  # noqa: E402
from specblock.runtime.target import TargetModel, read_generation_eos  # noqa: E402
from test_real_model import NAME, QUESTIONS  # noqa: E402


def run(kernel: str, path: Path, tokens: int) -> dict[str, list[bool]]:
    default = q4.default_kernel
    q4.default_kernel = lambda: kernel
    try:
        target = TargetModel.load(path, "q4", "cpu")
    finally:
        q4.default_kernel = default
    tok = load_tokenizer(path, False)
    stops = chat.stop_ids(tok, read_generation_eos(path))
    methods = sorted(p.name for p in MODELS[NAME].drafters.iterdir() if (p / "config.json").is_file())
    out: dict[str, list[bool]] = {}
    for method in methods:
        for q in QUESTIONS:
            ids = chat.encode(tok, chat.ChatRequest(prompt=q))
            plain = Engine(target, drafters.build("ar", target, {}), eos_ids=stops).generate(ids, tokens)
            opts = drafters.serving_settings(method, target, {})
            budget = int(opts.pop("budget", drafters.DEFAULT_BUDGET))
            res = Engine(target, drafters.build(method, target, opts), budget=budget, eos_ids=stops).generate(ids, tokens)
            out.setdefault(method, []).append(res.token_ids == plain.token_ids)
        print(kernel, method, out[method], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kernels", default=None, help="comma-separated (default: every kernel this CPU runs)")
    ap.add_argument("--out", type=Path, default=Path("experiments/results/q4_partings"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_target(NAME)
    ours = q4.q4_kernel.load()
    kernels = args.kernels.split(",") if args.kernels else \
        (["int8"] if ours and q4.q4_kernel.vnni_supports() else []) + (["fp32"] if ours else []) + ["bf16"]
    res = {k: run(k, path, args.tokens) for k in kernels}
    picked = f" --kernels {args.kernels}" if args.kernels else ""
    lines = [f"`python experiments/q4_partings.py --tokens {args.tokens} --threads {args.threads}{picked} --out {args.out}`: "
             f"each shipped drafter at its serving settings against plain decoding, the q4 model, {args.tokens} new tokens, "
             "identical or not per question:", "",
             "| drafter | " + " | ".join(f"{k} kernel: " + " / ".join(q.split()[0] + "..." for q in QUESTIONS) for k in res) + " |",
             "|---" * (len(res) + 1) + "|"]
    for m in next(iter(res.values())):
        lines.append(f"| {m} | " + " | ".join(" / ".join("identical" if x else "parts" for x in res[k][m]) for k in res) + " |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"identical": res, "tokens": args.tokens, "questions": QUESTIONS},
                                                        indent=1) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
