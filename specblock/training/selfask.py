"""``python -m specblock.training selfask``: chat-like instructions written by the target itself.

The bench's chat-like domains (chat, qa, mtbench) are where the drafters accept least, and the
training instructions hold little of their kind: AlpacaEval's 700 instructions run out by chatgen
shard 37, and nothing in ``../shared/data`` outside the bench looks like a search question. So the
target writes more (self-instruct). Asked through its chat template, a 135M model answers the
request instead of writing one ("What a fascinating topic!"), so it continues a numbered list
as plain text instead: a header, three example lines drawn from the short lists below (written
for this module, none taken from an evaluation set), then ``4.`` and a sampled line (temperature
:data:`TEMPERATURE`, top-k :data:`TOP_K`, seeded). Sampling only picks the instructions; chatgen
then answers each one greedily through the template (``chatgen --instructions``), as it answers
the data set's own.

Output: one ``{"id", "domain", "text"}`` per line (``ask-qa`` or ``ask-chat``), deduplicated
without regard to case, written atomically (``specblock.atomic``). The same seed and count give the
same file.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from specblock.atomic import check_output, write_atomic
from specblock.errors import SpecBlockError

TEMPERATURE = 1.0
TOP_K = 50

#: Each family: a header and example lines (written here). The examples only set the form.
FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "ask-qa": ("Questions people typed into a search engine, one per line:", (
        "who invented the telephone", "what is the capital of australia", "when did the first world war end",
        "how many bones are in the human body", "who painted the starry night", "where is mount kilimanjaro",
        "what language is spoken in brazil", "when was the eiffel tower built", "who wrote the odyssey",
        "how long does it take light to reach earth from the sun", "what is the largest desert in the world",
        "who was the first woman to win a nobel prize", "what does dna stand for", "where do penguins live",
        "how tall is a giraffe", "what year did the berlin wall fall", "who discovered penicillin",
        "which planet has the most moons", "what is the boiling point of water at sea level",
        "who composed the four seasons", "how many players are on a basketball team", "what is the currency of japan",
        "when did humans first land on the moon", "what causes the northern lights")),
    "ask-chat": ("Requests people sent to an AI assistant, one per line:", (
        "Write a short poem about autumn leaves.", "Explain how a refrigerator keeps food cold.",
        "Give me three tips for staying focused while studying.", "Compose a polite email asking my landlord to fix the heating.",
        "What are the pros and cons of working from home?", "Describe a busy market in a small town.",
        "Suggest a name for a bakery that sells vegan bread.", "Explain the difference between weather and climate.",
        "Write a short story about a robot who learns to paint.", "How can I improve my public speaking skills?",
        "Summarize the main causes of the French Revolution.", "Plan a three-day trip to the mountains for a family.",
        "Pretend you are a tour guide and describe an old castle.", "Compare cats and dogs as pets.",
        "Give me a simple recipe for vegetable soup.", "Why is the sky blue? Explain it to a child.",
        "Write a motivational message for someone starting a new job.", "List five ways to save energy at home.",
        "Draft a short speech for a friend's birthday party.", "What should I consider before buying a used car?",
        "Explain what inflation is in simple terms.", "Write a haiku about the ocean.",
        "Help me write a cover letter for a job at a library.", "Describe the water cycle step by step.")),
}


def prompt_text(family: str, rng: random.Random) -> str:
    """A family's header and three of its examples in a seeded order, then ``4.``: the target writes line 4."""
    header, examples = FAMILIES[family]
    shots = rng.sample(examples, 3)
    return header + "\n" + "".join(f"{i}. {s}\n" for i, s in enumerate(shots, 1)) + "4."


def clean(line: str, family: str) -> str | None:
    """The written line as an instruction, or None where it is not one: cut short, too short or long,
    an example copied, or (for questions) no question word."""
    text = " ".join(line.split())
    words = text.split()
    if not 3 <= len(words) <= 40 or text.lower() in {e.lower() for e in FAMILIES[family][1]}:
        return None
    if any(ch.isdigit() for ch in words[0]) or text.endswith((",", ":", "-")):
        return None
    if family == "ask-qa" and words[0].lower() not in {"who", "what", "when", "where", "which", "how", "why", "is",
                                                     "are", "does", "do", "did", "can", "was", "were", "whats"}:
        return None
    return text


def sample_lines(model, tok, prompts: list[str], max_new: int, seed: int) -> list[str | None]:
    """One sampled line per prompt (None where it did not end within ``max_new`` tokens)."""
    import torch

    from specblock.training.chatgen import generate_batch

    newline = set(tok.encode("\n", add_special_tokens=False))
    if len(newline) != 1:
        raise SpecBlockError("selfask needs a tokenizer with a single newline token")
    stops = frozenset(newline | ({tok.eos_token_id} if tok.eos_token_id is not None else set()))
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(stops)
    gen = torch.Generator().manual_seed(seed)
    out = generate_batch(model, [tok.encode(p) for p in prompts], max_new, stops, pad,
                         temperature=TEMPERATURE, top_k=TOP_K, generator=gen)
    return [tok.decode(a[:-1]) if stopped and a[-1] in newline else None for a, stopped in out]


def write_instructions(model, tok, count: int, seed: int, batch: int = 64, max_new: int = 40,
                       progress=None) -> list[dict]:
    """``count`` distinct instructions, the families alternating, in batches of ``batch`` prompts."""
    rng = random.Random(seed)
    fams = list(FAMILIES)
    seen: set[str] = set()
    rows: list[dict] = []
    tries = 0
    while len(rows) < count:
        if tries > 20 * count:  # a target that writes no usable line would loop for ever
            raise SpecBlockError(f"selfask kept {len(rows)} of {count} instructions after {tries} tries; "
                                 "the target does not continue the lists (try another --target)")
        fam_of = [fams[(tries + i) % len(fams)] for i in range(batch)]
        lines = sample_lines(model, tok, [prompt_text(f, rng) for f in fam_of], max_new, seed * 1_000_003 + tries)
        tries += batch
        for fam, line in zip(fam_of, lines):
            text = clean(line, fam) if line is not None else None
            if text is None or text.lower() in seen or len(rows) >= count:
                continue
            seen.add(text.lower())
            rows.append({"id": f"selfask/{seed}/{len(rows)}", "domain": fam, "text": text})
            if progress is not None:
                progress(1)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specblock.training selfask", description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="a model name (smollm2-135m-instruct) or directory")
    ap.add_argument("--out", type=Path, required=True, help="the instructions file (jsonl) to write")
    ap.add_argument("--count", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if args.count < 1 or args.batch < 1:
        raise SpecBlockError("--count and --batch must be positive")
    if args.out.is_file():  # written whole or not at all (a rename): a rerun keeps it
        have = sum(1 for line in args.out.read_text(encoding="utf-8").splitlines() if line.strip())
        if have != args.count:
            raise SpecBlockError(f"{args.out} already holds {have} instructions, not --count {args.count}; use another --out")
        print(json.dumps({"out": str(args.out), "instructions": have, "existed": True}))
        return 0
    check_output(args.out, "--out", make_parents=True)  # before the model loads, not after the minutes of sampling
    import torch
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from specblock.models import resolve_target
    from specblock.runtime.target import load_causal_lm

    target_dir = resolve_target(args.target)
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(target_dir)
    model = load_causal_lm(target_dir, args.dtype, "cpu", "sdpa", False).eval()
    with tqdm(total=args.count, desc="selfask", dynamic_ncols=True) as bar:
        rows = write_instructions(model, tok, args.count, args.seed, args.batch, progress=bar.update)
    write_atomic(args.out, "".join(json.dumps(r) + "\n" for r in rows))
    print(json.dumps({"out": str(args.out), "instructions": len(rows)}))
    return 0
