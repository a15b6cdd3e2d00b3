"""``python -m specblock.training refanswers``: reference answers from the shared data, written in
chatgen's shard format so the feature cache takes them beside the target's own answers.

Why: on this CPU the target generates ~50 answer tokens/s (``chatgen``) but computes features at
~550 tokens/s, so fixed text gives ten times the training tokens per CPU minute. The soft targets
and features still come from the target (``featcache``); only the contexts are human- or
other-model-written: the responses of 11 open chat models to AlpacaEval instructions 0-699,
GSM8K training solutions (calculator annotations ``<<...>>`` removed, the ``#### N`` line kept)
and whole stdlib functions behind the bench's code framing. None of it is an evaluation prompt.
Held-out evaluation stays on the target's own answers (chatgen's held-out shard), the
distribution the drafter serves.

The directory's manifest has ``kind: specblock-reference`` and the target's identity (whose
tokenizer and chat template encoded the text); shards are named ``ref_NNNNN`` so they never
collide with chatgen's in a shared feature cache.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
from pathlib import Path

from specblock.errors import SpecBlockError
from specblock.training.chatgen import Instruction, code_prompt, read_jsonl, training_functions
from specblock.training.featcache import REF_PREFIX

#: Share of answers per domain while every domain lasts (the bench's chat-like domains weigh most).
MIX: dict[str, float] = {"chat": 0.5, "math": 0.3, "code": 0.2}
_CALC = re.compile(r"<<[^>]*>>")


def chat_pairs() -> list[tuple[Instruction, str]]:
    return [(Instruction(f"alpaca_eval/{r['id']}/{r.get('generator', j)}", "chat", r["instruction"].strip()), r["output"].strip())
            for j, r in enumerate(read_jsonl("alpaca_eval", "train.jsonl")) if int(r["id"]) < 700 and r.get("output")]


def math_pairs() -> list[tuple[Instruction, str]]:
    return [(Instruction(f"gsm8k/train/{i}", "math", r["question"].strip()), _CALC.sub("", r["answer"]).strip())
            for i, r in enumerate(read_jsonl("gsm8k", "train.jsonl"))]


def code_pairs(per_file: int = 12) -> list[tuple[Instruction, str]]:
    return [(Instruction(key, "code", code_prompt(head)), f"```python\n{whole}```")
            for key, head, whole in training_functions(per_file)]


def all_pairs(seed: int = 0) -> list[tuple[Instruction, str]]:
    """Every domain shuffled (seeded), then interleaved by :data:`MIX` until each runs out."""
    pools = {"chat": chat_pairs(), "math": math_pairs(), "code": code_pairs()}
    rng = random.Random(seed)
    for items in pools.values():
        rng.shuffle(items)
    credit = dict.fromkeys(pools, 0.0)
    out = []
    while any(pools.values()):
        live = {d: w for d, w in MIX.items() if pools[d]}
        for d, w in live.items():
            credit[d] += w / sum(live.values())
        d = max(live, key=lambda k: credit[k])
        credit[d] -= 1.0
        out.append(pools[d].pop())
    return out


def encode_pair(tok, inst: Instruction, answer: str, end_ids: list[int]) -> dict:
    """The prompt as chatgen encodes it; the answer as the assistant turn's text plus end-of-turn."""
    from specblock.runtime.chat import ChatRequest, encode

    ids = encode(tok, ChatRequest(prompt=inst.text))
    ans = tok(answer, add_special_tokens=False)["input_ids"] + end_ids
    return {"id": inst.id, "domain": inst.domain, "prompt_ids": ids, "answer_ids": ans, "stopped": True}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specblock.training refanswers", description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="a model name or directory (its tokenizer and chat template)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shard-size", type=int, default=256, help="answers per shard")
    ap.add_argument("--max-answer-tokens", type=int, default=384, help="longer answers are cut")
    ap.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts are skipped")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.shard_size < 1 or args.max_answer_tokens < 1:
        raise SpecBlockError("--shard-size and --max-answer-tokens must be positive")
    from transformers import AutoTokenizer

    from specblock.models import resolve_target
    from specblock.models.convert import sha256
    from specblock.training.featcache import target_identity

    target_dir = resolve_target(args.target)
    ident = target_identity(target_dir)
    tok = AutoTokenizer.from_pretrained(target_dir)
    end = tok.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tok.get_vocab() else tok.eos_token_id
    settings = {"seed": args.seed, "shard_size": args.shard_size, "max_answer_tokens": args.max_answer_tokens,
                "max_prompt_tokens": args.max_prompt_tokens}
    path = args.out / "manifest.json"
    if path.is_file():
        man = json.loads(path.read_text())
        if man.get("target_sha256") != ident["weights_sha256"] or man.get("settings") != settings:
            raise SpecBlockError(f"{args.out} holds reference answers made for another target or settings; use another --out")
        print(json.dumps({"out": str(args.out), **man["totals"]}))
        return 0
    rows = []
    for inst, answer in all_pairs(args.seed):
        row = encode_pair(tok, inst, answer, [end])
        if len(row["prompt_ids"]) <= args.max_prompt_tokens:
            row["answer_ids"] = row["answer_ids"][:args.max_answer_tokens]
            rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    man = {"kind": "specblock-reference", "target": ident["name"], "target_sha256": ident["weights_sha256"],
           "settings": settings, "heldout_shards": [], "shards": {}}
    for i in range(0, len(rows), args.shard_size):
        part, name = rows[i:i + args.shard_size], f"{REF_PREFIX}{i // args.shard_size:05d}"
        f = args.out / f"{name}.jsonl"
        tmp = f.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in part))
        os.replace(tmp, f)
        man["shards"][name] = {"sequences": len(part), "prompt_tokens": sum(len(r["prompt_ids"]) for r in part),
                               "answer_tokens": sum(len(r["answer_ids"]) for r in part), "sha256": sha256(f),
                               "domains": {d: sum(r["domain"] == d for r in part) for d in MIX}}
    man["totals"] = {"sequences": len(rows), "answer_tokens": sum(len(r["answer_ids"]) for r in rows),
                     "prompt_tokens": sum(len(r["prompt_ids"]) for r in rows)}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(man, indent=1))
    os.replace(tmp, path)  # last: a directory without a manifest is an interrupted run, rebuilt from scratch
    print(json.dumps({"out": str(args.out), **man["totals"]}))
    return 0
