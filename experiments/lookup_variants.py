"""Other shapes of the lookup branch, teacher-forced on the bench's text, before anyone builds them.

The shipped branch (``runtime/drafters/lookup_branch.py``) grafts lookup's most recent match, up to
3 tokens, at the root. This measures what two other shapes would add to a drafter's top-1 chain of
3, and how many nodes they would cost, on the target's greedy answers to the bench's prompts
(``served_gap.py``'s text; roots at answer positions):

- ``rootN``: the shipped branch, lookup's n-grams down to length N (1: as shipped; 2: no
  one-token matches);
- ``+deepM``: also lookup's chain from the drafter's depth-1 node (the context plus the drafted
  token), n-grams down to M, when that node is right: a chain that enters a repeated span one
  token after the root;
- ``multi2``: the two most recent distinct matches at the root instead of one.

Each row: expected accepted drafts per root (the longest right chain among the branches, the
drafter's included) and the mean lookup nodes added (what the verification pays for).

    python experiments/lookup_variants.py --drafter specblock=specblock:specblock/assets/drafters/smollm2-135m-instruct/specblock \
        --drafter eagle3=eagle3:specblock/assets/drafters/smollm2-135m-instruct/eagle3 --out experiments/results/lookup_variants_smollm2
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: its siblings

from served_gap import chain_hits, greedy_answer, load_chains  # noqa: E402

from specblock.atomic import write_atomic  # noqa: E402
from specblock.errors import SpecBlockError  # noqa: E402
from specblock.prompts import DOMAINS, load_prompts  # noqa: E402
from specblock.runtime import chat  # noqa: E402
from specblock.runtime.drafters.lookup import find_continuations  # noqa: E402
from specblock.training.specblock_step import target_pass  # noqa: E402

CHAIN = 3  # the drafter's chain and each lookup chain, as served
#: name: (the root chain's shortest n-gram, its matches, the depth-1 chain's shortest n-gram or None)
SHAPES = {"root1 (shipped)": (1, 1, None), "root2": (2, 1, None), "root1+deep1": (1, 1, 1),
          "root1+deep2": (1, 1, 2), "root2+deep2": (2, 1, 2), "multi2": (1, 2, None)}


def right(guess: np.ndarray, truth: np.ndarray) -> int:
    """How many leading tokens of ``guess`` are right."""
    n = min(len(guess), len(truth))
    wrong = np.flatnonzero(guess[:n] != truth[:n])
    return int(wrong[0]) if wrong.size else n


def look(seq: np.ndarray, r: int, min_ngram: int, matches: int = 1) -> tuple[int, int]:
    """(accepted, nodes) of lookup's chains from ``seq[:r+1]``: the best of ``matches`` recent
    distinct continuations, and the nodes they take (a trie of them, counted per path here)."""
    for n in range(3, min_ngram - 1, -1):
        cont = find_continuations(seq[: r + 1], n, CHAIN, matches)
        if cont.shape[0]:
            paths = [c[c >= 0] for c in cont]
            truth = seq[r + 1 : r + 1 + CHAIN]
            return max(right(p, truth) for p in paths), sum(len(p) for p in paths)
    return 0, 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--drafter", action="append", required=True, metavar="NAME=METHOD:DIR")
    ap.add_argument("--prompts", type=int, default=3, help="per domain, the bench's first N")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.md")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    try:
        model, tok, eos, nets = load_chains(a.target, a.drafter)
    except SpecBlockError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    acc: dict[tuple[str, str], list[int]] = defaultdict(list)
    nodes: dict[str, list[int]] = defaultdict(list)
    for d in DOMAINS:
        for p in load_prompts(d, a.prompts):
            ids = chat.encode_prompt(tok, p)
            seq = np.asarray(ids + greedy_answer(model, ids, a.max_new_tokens, eos), dtype=np.int64)
            roots = range(len(ids), len(seq) - 1)  # answer positions with a next token to check
            memo: dict[tuple[int, int, int], tuple[int, int]] = {}

            def at(r: int, min_ngram: int, matches: int = 1) -> tuple[int, int]:
                if r >= len(seq) - 1:  # no token left to check
                    return 0, 0
                if (r, min_ngram, matches) not in memo:
                    memo[r, min_ngram, matches] = look(seq, r, min_ngram, matches)
                return memo[r, min_ngram, matches]

            for r in roots:  # what each shape costs, whichever drafter it sits beside
                for s, (root_n, k, deep_n) in SHAPES.items():
                    nodes[s].append(at(r, root_n, k)[1] + (at(r + 1, deep_n)[1] if deep_n else 0))
            for name, (method, net) in nets.items():
                tp = target_pass(model, torch.tensor(seq[None]), tuple(net.cfg.tap_layers), net)
                hits = chain_hits(method, net, tp).numpy()  # row R-1 <-> root R, cumulative over depth
                for r in roots:
                    h = hits[r - 1, :CHAIN]
                    own = int(h.sum())
                    acc[name, "drafter alone"].append(own)
                    for s, (root_n, k, deep_n) in SHAPES.items():
                        best = max(own, at(r, root_n, k)[0])
                        if deep_n and h[0]:  # the depth-1 node is right: its chain starts from the true context
                            best = max(best, 1 + at(r + 1, deep_n)[0])
                        acc[name, s].append(best)
        print(d, "done", flush=True)
    shapes = ["drafter alone", *SHAPES]
    rows = [{"shape": s, "lookup_nodes": round(float(np.mean(nodes[s])), 3) if s in nodes else 0.0,
             **{name: round(float(np.mean(acc[name, s])), 4) for name in nets}} for s in shapes]
    md = [f"Teacher-forced on the target's greedy answers to the bench's prompts ({a.prompts} per domain, "
          f"{a.max_new_tokens} new tokens, fp32): expected accepted drafts per answer root (the drafter's top-1 chain "
          f"of {CHAIN} beside lookup's chains of up to {CHAIN}), and the lookup nodes each shape adds.", "",
          "| shape | lookup nodes | " + " | ".join(nets) + " |", "|---|---|" + "---|" * len(nets)]
    md += [f"| {r['shape']} | {r['lookup_nodes']:.2f} | " + " | ".join(f"{r[n]:.3f}" for n in nets) + " |" for r in rows]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(a.out.with_suffix(".json"), json.dumps({"command": " ".join(["python", *sys.argv]), "rows": rows},
                                                        indent=1) + "\n")
    write_atomic(a.out.with_suffix(".md"), "\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
