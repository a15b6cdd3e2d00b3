"""Self-generated data, old loop against new, on one chatgen shard's prompts (issue 14's data job).

Old: HF ``generate`` on one left-padded batch of the whole shard (``--batch 64``, as the data job
ran until this round). New: ``chatgen.generate_batch`` (stopped rows leave the batch, last-position
LM head at prefill) in batches of ``--batch`` prompts sorted by length, as ``chatgen`` runs them.
Both greedy, same dtype and threads; the answers are compared (they may part at fp32 near-ties,
since padding and batch shapes differ) and the answer tokens per second printed.

    python experiments/chatgen_speed.py --shard 1 --threads 1 --out experiments/results/chatgen_speed
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specblock.atomic import write_atomic
from specblock.models import resolve_target, specblock_home
from specblock.runtime.chat import stop_ids
from specblock.runtime.target import load_causal_lm
from specblock.training import chatgen


def old_loop(model, prompts, max_new, stops, pad):
    """What chatgen ran before: HF generate, the whole batch until the longest answer ends."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                             eos_token_id=sorted(stops), pad_token_id=pad)
    res = []
    for row in out[:, width:].tolist():
        cut = next((i for i, t in enumerate(row) if t in stops), None)
        res.append(row[:cut + 1] if cut is not None else row)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--shard", type=int, default=1)
    ap.add_argument("--old-batch", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tdir = resolve_target(args.target)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tdir)
    model = load_causal_lm(tdir, "float32", "cpu", "sdpa", False).eval()
    eos = model.generation_config.eos_token_id
    stops = stop_ids(tok, set(eos if isinstance(eos, list) else [eos]))
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(stops)
    path = specblock_home() / "data" / "chatgen" / Path(tdir).name / f"shard_{args.shard:05d}.jsonl"
    prompts = sorted((json.loads(x)["prompt_ids"] for x in path.read_text().splitlines()), key=len)
    rows = {}
    for name, run, b in (("old", old_loop, args.old_batch), ("new", chatgen.generate_batch, args.batch)):
        t0, answers = time.perf_counter(), []
        for i in range(0, len(prompts), b):
            got = run(model, prompts[i:i + b], args.max_new_tokens, stops, pad)
            answers += [g[0] if isinstance(g, tuple) else g for g in got]
        dt = time.perf_counter() - t0
        n = sum(map(len, answers))
        rows[name] = {"batch": b, "seconds": round(dt, 1), "answer_tokens": n, "tok_s": round(n / dt, 1), "answers": answers}
        print(f"{name}: batch {b}, {n} answer tokens in {dt:.1f} s, {n / dt:.1f} tokens/s", flush=True)
    same = sum(a == b for a, b in zip(rows["old"]["answers"], rows["new"]["answers"]))
    for r in rows.values():
        del r["answers"]
    res = {"shard": path.name, "prompts": len(prompts), "threads": args.threads, "max_new_tokens": args.max_new_tokens,
           **rows, "speedup": round(rows["new"]["tok_s"] / rows["old"]["tok_s"], 2), "identical_answers": same}
    print(json.dumps(res), flush=True)
    write_atomic(args.out.with_suffix(".json"), json.dumps(res, indent=1) + "\n")
    write_atomic(args.out.with_suffix(".md"), f"""# chatgen: old loop against new ({path.name}, {len(prompts)} prompts, {args.threads} thread(s), fp32)

| loop | batch | answer tokens | seconds | tokens/s |
|---|---|---|---|---|
| HF generate, one padded batch | {rows['old']['batch']} | {rows['old']['answer_tokens']} | {rows['old']['seconds']} | {rows['old']['tok_s']} |
| generate_batch, sorted batches | {rows['new']['batch']} | {rows['new']['answer_tokens']} | {rows['new']['seconds']} | {rows['new']['tok_s']} |

{res['speedup']}x the answer tokens per second; {same} of {len(prompts)} answers identical (the rest part at fp32
near-ties: padding and batch shapes differ).
""")


if __name__ == "__main__":
    main()
