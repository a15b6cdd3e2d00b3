"""``python -m specblock.training.selfgen``: text the target generated itself, for drafter training.

At inference the drafter conditions on the target's own (greedy) output, which is far more
predictable than human text; teacher forcing on the corpus teaches contexts that inference never
sees (DESIGN.md). This writes JSONL ``{"text": prompt + greedy continuation}`` for
``python -m specblock.training drafter --data FILE``. Prompts are the first ``--prompt-tokens``
tokens of random training windows of the lab corpus, mixed like the target's training data;
continuations come from batched greedy decoding (cheap: one forward per step for the batch).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from specblock.runtime.target import load_causal_lm
from specblock.training.windows import WindowSource


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specblock.training.selfgen", description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--n", type=int, default=512, help="sequences to generate")
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=208)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_causal_lm(args.target, "bfloat16", "cpu", "sdpa", False).eval()
    tok = AutoTokenizer.from_pretrained(args.target)
    src = WindowSource("lab", args.target, args.prompt_tokens, seed=args.seed)
    tmp = args.out.with_suffix(".tmp")
    with tmp.open("w") as f, torch.no_grad():
        for _ in tqdm(range(0, args.n, args.batch), desc="selfgen"):
            prompts = src.batch(args.batch)
            out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=args.new_tokens,
                                 do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=None)
            for row in out.tolist():
                f.write(json.dumps({"text": tok.decode(row, skip_special_tokens=True)}) + "\n")
    os.replace(tmp, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
