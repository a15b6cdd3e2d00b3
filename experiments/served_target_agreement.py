"""How often the served target's next token agrees with the model the drafters were trained on.

    python experiments/served_target_agreement.py [--served packed-q4-amx] [--trained bfloat16]
        [--prompts 4] [--tokens 48] [--split tune] [--out experiments/results/served_target_agreement]

Why: the feature cache (taps, soft targets, argmax) is computed once in one dtype (its manifest says
``bfloat16``), while the bench serves the target in another (``--dtype auto``: packed-q4-amx on this
CPU until stop 73, q4 since stop 74). Each is lossless against itself, but a drafter learns the cache's target: where the served
target's argmax differs from it, a drafter that learnt its lesson still misses. Teacher-forced over
the served target's own greedy answers to each domain's prompts (the tune split by default, which
no table reports), the share of answer positions where the argmaxes agree, for the served dtype
against the trained one and against fp32.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specblock.atomic import check_output, write_atomic  # noqa: E402
from specblock.prompts import load_prompts  # noqa: E402
from specblock.runtime.chat import encode_prompt  # noqa: E402
from specblock.runtime.cli import load_tokenizer  # noqa: E402
from specblock.runtime.config import validate  # noqa: E402
from specblock.runtime.target import TargetModel, resolve_dtype  # noqa: E402

DOMAINS = ("code", "math", "chat", "qa", "mtbench")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--served", default="auto", help="the dtype the bench serves (default: --dtype auto's choice)")
    ap.add_argument("--trained", default="bfloat16", help="the feature cache's dtype (its manifest's)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--split", default="tune", choices=("tune", "eval"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("experiments/results/served_target_agreement"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    check_output(args.out.with_suffix(".json"), "--out", make_parents=True)
    path = validate({"target": args.target}).target_dir
    served_dtype = resolve_dtype(args.served, "auto", path)
    tok = load_tokenizer(path, False)
    models = {"served": TargetModel.load(path, served_dtype, "cpu"), "trained": TargetModel.load(path, args.trained, "cpu"),
              "fp32": TargetModel.load(path, "float32", "cpu")}
    rows = {}
    for dom in DOMAINS:
        same = {"served_trained": 0, "served_fp32": 0, "trained_fp32": 0}
        total = 0
        for p in load_prompts(dom, args.prompts, args.split):
            ids = encode_prompt(tok, p)
            with torch.no_grad():
                seq = models["served"].model.generate(torch.tensor([ids]), max_new_tokens=args.tokens, do_sample=False,
                                                      pad_token_id=tok.eos_token_id)
                top = {k: m.model(seq).logits[0, len(ids) - 1:-1].argmax(-1) for k, m in models.items()}
            for a, b in (("served", "trained"), ("served", "fp32"), ("trained", "fp32")):
                same[f"{a}_{b}"] += int((top[a] == top[b]).sum())
            total += int(top["served"].shape[0])
        rows[dom] = {"positions": total, **{k: round(v / total, 4) for k, v in same.items()}}
        print(dom, rows[dom], flush=True)
    mean = {k: round(sum(r[k] for r in rows.values()) / len(rows), 4) for k in ("served_trained", "served_fp32", "trained_fp32")}
    res = {"target": args.target, "served": served_dtype, "trained": args.trained, "split": args.split,
           "prompts": args.prompts, "tokens": args.tokens, "domains": rows, "mean": mean}
    write_atomic(args.out.with_suffix(".json"), json.dumps(res, indent=1) + "\n")
    lines = [f"`python experiments/served_target_agreement.py {' '.join(argv)}` ({args.target}; teacher-forced over the "
             f"served ({served_dtype}) target's {args.tokens} greedy tokens for {args.prompts} {args.split}-split prompts "
             "a domain; share of positions whose argmax agrees)", "",
             f"| domain | positions | served = trained ({args.trained}) | served = fp32 | trained = fp32 |", "|---|---|---|---|---|"]
    for dom, r in rows.items():
        lines.append(f"| {dom} | {r['positions']} | {r['served_trained']:.2%} | {r['served_fp32']:.2%} | {r['trained_fp32']:.2%} |")
    lines.append(f"| mean | | {mean['served_trained']:.2%} | {mean['served_fp32']:.2%} | {mean['trained_fp32']:.2%} |")
    write_atomic(args.out.with_suffix(".md"), "\n".join(lines) + "\n")
    print(f"wrote {args.out.with_suffix('.json')}, {args.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
