"""How much of the target's own (greedy) training answers is repetition loop (issue 14).

The share of answer tokens that close an n-gram already seen earlier in the same answer, over the
first 48 / 96 tokens of each answer (what a bench decodes) and over whole answers (what training
windows and held-out windows are cut from). The trainer's ``--skip-loops N`` leaves such positions
out of the loss.

    python experiments/loop_share.py --chatgen ~/.cache/specblock/data/chatgen/smollm2-135m-instruct \
        --out experiments/results/loop_share_smollm2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from specblock.atomic import write_atomic
from specblock.training.cachewindows import repeats

PREFIXES = (48, 96, None)  # None: the whole answer


def share(answers: list[list[int]], n: int, prefix: int | None) -> float:
    closed = total = 0
    for a in answers:
        a = a[:prefix]
        total += len(a)
        closed += int(repeats(np.asarray([a], dtype=np.int64), n).sum()) if a else 0
    return closed / max(total, 1)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chatgen", type=Path, required=True, help="a chatgen directory (shard_NNNNN.jsonl files)")
    ap.add_argument("--n", type=int, default=8, help="n-gram length")
    ap.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.md")
    a = ap.parse_args(argv)
    shards = sorted(a.chatgen.glob("shard_*.jsonl"))
    if not shards:
        print(f"error: no chatgen shards (shard_NNNNN.jsonl) in {a.chatgen}", file=sys.stderr)
        return 2
    rows = [json.loads(line) for s in shards for line in s.read_text().splitlines() if line.strip()]
    answers = [r["answer_ids"] for r in rows]
    res = {"shards": len(shards), "answers": len(answers), "n": a.n,
           "answer_tokens": sum(len(x) for x in answers),
           "stopped": round(sum(bool(r.get("stopped")) for r in rows) / max(len(rows), 1), 4),
           "share": {str(p or "all"): round(share(answers, a.n, p), 4) for p in PREFIXES}}
    md = (f"{res['answers']} answers ({res['answer_tokens']:,} tokens, {res['stopped']:.0%} ended by the model) in "
          f"{res['shards']} chatgen shards: share of answer tokens closing a repeated {a.n}-gram\n\n"
          "| first 48 tokens | first 96 tokens | whole answers |\n|---|---|---|\n"
          + "| " + " | ".join(f"{v:.1%}" for v in res["share"].values()) + " |\n")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(a.out.with_suffix(".json"), json.dumps(res, indent=1) + "\n")
    write_atomic(a.out.with_suffix(".md"), md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
