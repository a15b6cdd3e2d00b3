"""Block-1 trees at a node budget on held-out windows: which widths rule accepts most (stop 60).

For every block-1 forward of a SpecBlock drafter over held-out windows of the feature cache (the
target's own answers, never trained on), each tree policy's own ``block_widths`` picks the widths
of one block under a node budget, and the target's greedy tokens say how many drafts a tree of
that shape accepts (the spine while its top-1 is right, then one sibling if the target's token is
among those kept). Rules: the rank head's widths (2, 4, 10, 0), fixed top-1 (a chain), top-2,
top-4, expected-acceptance widths with the rank head's probabilities and with draft probabilities
only, and the oracle (the best widths knowing the target's ranks: the ceiling for one block).

    python experiments/expected_widths_offline.py --features ~/.cache/specblock/features/smollm2-135m-instruct \
        --out experiments/results/expected_widths_offline_s60
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import numpy as np
import torch

from specblock.atomic import write_atomic
from specblock.errors import SpecBlockError
from specblock.models import drafters_dir, resolve_target
from specblock.policies.branching import RankBucketBranching, TopKBranching, TreePolicy
from specblock.policies.expected import ExpectedAcceptanceBranching
from specblock.runtime.drafters.specblock_net import SpecBlockNet
from specblock.runtime.target import load_causal_lm
from specblock.training.cachewindows import CacheWindows
from specblock.training.featcache import FeatureCache
from specblock.training.losses import rank_of
from specblock.training.specblock_step import first_block

TOP = 10  # candidates per position, as the served drafter offers them


@torch.no_grad()
def block_one(net: SpecBlockNet, held) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per block-1 forward: the target's rank at each position [N, K], the top-10 log-probs
    [N, K, 10] and the rank head's probabilities [N, K, 4] (blocks whose first target has no
    draft-vocabulary row are left out: nothing can be accepted there)."""
    ranks, lps, probs = [], [], []
    kk = net.cfg.K
    for tp in held.split(4):
        b, w = tp.tokens.shape
        hq, _ = first_block(net, tp.taps, tp.tokens)
        logits, rank_logits = net.heads(hq)
        idx = (torch.arange(w - 1)[:, None] + torch.arange(1, kk + 1)).clamp(max=w - 1)
        valid = (torch.arange(w - 1)[:, None] + torch.arange(1, kk + 1) <= w - 1)[None].expand(b, w - 1, kk)
        if tp.y_ok is not None:
            valid = valid & tp.y_ok[:, idx]
        rank = torch.where(valid, rank_of(logits, tp.y_star[:, idx]), torch.full_like(valid, 10**6, dtype=torch.long))
        keep = valid[..., 0].reshape(-1)
        ranks.append(rank.reshape(-1, kk)[keep])
        lps.append(logits.float().log_softmax(-1).topk(TOP, -1).values.reshape(-1, kk, TOP)[keep])
        probs.append(rank_logits.float().softmax(-1).reshape(-1, kk, 4)[keep])
    return torch.cat(ranks).numpy(), torch.cat(lps).numpy(), torch.cat(probs).numpy()


def accepted(rank: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Drafts a block with widths ``w`` [N, K] accepts: the spine while its top-1 is right, then
    one sibling where the target's token is among the kept candidates."""
    acc = np.zeros(len(rank))
    alive = np.ones(len(rank), dtype=bool)
    for d in range(rank.shape[1]):
        live = alive & (w[:, d] > 0)
        acc += live & (rank[:, d] < w[:, d])
        alive = live & (rank[:, d] == 0)
    return acc


def widths_of(policy: TreePolicy, lp: np.ndarray, prob: np.ndarray, budget: int, with_probs: bool) -> np.ndarray:
    """The policy's widths for each block alone (its own budget), through ``block_widths``."""
    out = np.empty(lp.shape[:2], dtype=np.int64)
    one = np.ones(1, dtype=bool)
    for n in range(len(lp)):
        w, _ = policy.block_widths(np.zeros((1, lp.shape[1]), np.float32), lp[n : n + 1], prob[n : n + 1].argmax(-1),
                                   budget, one, prob[n : n + 1] if with_probs else None)
        out[n] = w[0]
    return out


def oracle(rank: np.ndarray, budget: int) -> np.ndarray:
    """The best accepted count of any widths vector within the budget, per block."""
    kd = rank.shape[1]
    best = np.zeros(len(rank))
    for v in itertools.product(range(TOP + 1), repeat=kd):
        if sum(v) > budget or any(v[i] == 0 and any(v[i + 1 :]) for i in range(kd)):
            continue
        best = np.maximum(best, accepted(rank, np.broadcast_to(np.array(v), rank.shape)))
    return best


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--features", type=Path, required=True)
    ap.add_argument("--drafter", type=Path, default=None, help="a SpecBlock drafter (default: the shipped one)")
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--window", type=int, default=257)
    ap.add_argument("--budgets", default="1,2,3,4,5,6")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.md")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    try:
        target_dir = resolve_target(a.target)
        drafter = a.drafter or drafters_dir(target_dir) / "specblock"
        model = load_causal_lm(target_dir, "float32", "cpu", "sdpa", False).eval()
        net = SpecBlockNet.load(drafter, model.get_input_embeddings().weight, model.get_output_embeddings().weight).eval()
        held = CacheWindows(FeatureCache(a.features, target_dir), a.window).heldout(a.windows, net)
    except SpecBlockError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rank, lp, prob = block_one(net, held)
    rules = {"rank head (2, 4, 10, 0)": (RankBucketBranching(), False), "top-1 (chain)": (TopKBranching(k=1), False),
             "top-2": (TopKBranching(k=2), False), "top-4": (TopKBranching(k=4), False),
             "expected, rank head": (ExpectedAcceptanceBranching(), True),
             "expected, draft probabilities": (ExpectedAcceptanceBranching(), False)}
    rows = []
    for budget in map(int, a.budgets.split(",")):
        row = {"budget": budget}
        for name, (pol, with_probs) in rules.items():
            row[name] = round(float(accepted(rank, widths_of(pol, lp, prob, budget, with_probs)).mean()), 4)
        row["oracle"] = round(float(oracle(rank, budget).mean()), 4)
        print(json.dumps(row), flush=True)
        rows.append(row)
    # How far each probability of the top-1 is to be trusted: the rank head's b0 against the draft's own, at
    # positions whose spine above was right (what the policy's estimate is conditioned on)
    calib = []
    reached = np.concatenate([np.ones((len(rank), 1), bool), np.logical_and.accumulate(rank[:, :-1] == 0, axis=1)], axis=1)
    for lo, hi in ((0.0, 0.2), (0.2, 0.4), (0.4, 0.6), (0.6, 0.8), (0.8, 1.01)):
        by_rank = reached & (prob[..., 0] >= lo) & (prob[..., 0] < hi)
        by_draft = reached & (np.exp(lp[..., 0]) >= lo) & (np.exp(lp[..., 0]) < hi)
        calib.append({"band": [lo, min(hi, 1.0)], "rank_head_n": int(by_rank.sum()),
                      "rank_head_top1": round(float((rank[by_rank] == 0).mean()), 3) if by_rank.any() else None,
                      "draft_n": int(by_draft.sum()),
                      "draft_top1": round(float((rank[by_draft] == 0).mean()), 3) if by_draft.any() else None})
    names = [*rules, "oracle"]
    shown = drafter.resolve().relative_to(Path.cwd()) if drafter.resolve().is_relative_to(Path.cwd()) else drafter
    md = [f"Block-1 trees of `{shown}` on {len(rank)} held-out blocks ({a.windows} windows of {a.window} tokens of "
          "the target's own answers): accepted drafts per block at each node budget, each rule's own `block_widths`.", "",
          "| budget | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    md += [f"| {r['budget']} | " + " | ".join(f"{r[n]:.3f}" for n in names) + " |" for r in rows]
    md += ["", "The top-1's chance as each source states it, against how often it was right (positions whose spine above was right):", "",
           "| stated | rank head's b0: positions / top-1 right | draft probability: positions / top-1 right |", "|---|---|---|"]
    md += [f"| {c['band'][0]:.1f}-{c['band'][1]:.1f} | {c['rank_head_n']} / {c['rank_head_top1']} | "
           f"{c['draft_n']} / {c['draft_top1']} |" for c in calib]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(a.out.with_suffix(".json"), json.dumps({"drafter": str(shown), "blocks": int(len(rank)),
                                                         "windows": a.windows, "rows": rows, "calibration": calib}, indent=1) + "\n")
    write_atomic(a.out.with_suffix(".md"), "\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
