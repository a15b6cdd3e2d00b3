"""The real model's SpecBlock ablations, evaluated on held-out answers (issue 14).

Each variant of ``specblock_ablations.sh`` (TARGET=...) is loaded from its exported drafter and
evaluated on the same ``--windows`` held-out windows of the feature cache (the target's own answers,
never trained on), more than the 8 that training logs, so that a difference of a few points is
above the noise. Per variant:

- chain acceptance by in-block position for block 1 and block 2 (valid-prefix rule, as training
  logs it) and their sum, the expected accepted drafts of a top-1 chain (a tau proxy);
- the rank head's accuracy;
- the fourth ablation, **fixed top-k branching**, needs no retraining: on the same block-1 drafts,
  the chain a branching rule would accept if the target's token is among the candidates kept at
  every position so far (rank of the target token < width), for the rank head's widths (b0..b3 ->
  2, 4, 10, 0) and for fixed widths 1, 2, 4, 10, with the mean width kept per reached position
  (what those candidates cost). No node budget is applied: this is the branching rule's recall per
  candidate, the timing at equal node budgets is in the packed budget sweep.

    python experiments/ablation_table.py --target smollm2-135m-instruct \
        --features ~/.cache/specblock/features/smollm2-135m-instruct \
        --root ~/.cache/specblock/runs/smollm2-135m-instruct/ablations --out experiments/results/specblock_ablations_smollm2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from specblock.atomic import write_atomic
from specblock.errors import SpecBlockError
from specblock.models import resolve_target
from specblock.runtime.drafters.specblock_net import SpecBlockNet
from specblock.runtime.target import load_causal_lm
from specblock.training import recipes
from specblock.training.cachewindows import CacheWindows
from specblock.training.featcache import FeatureCache
from specblock.training.losses import rank_of
from specblock.training.specblock_step import TargetPass, first_block

VARIANTS = ("full", "no-shift", "no-prefix-broadcast", "no-valid-prefix", "no-cross-block")
RANK_WIDTHS = (2, 4, 10, 0)  # the paper's widths by bucket, as RankBucketBranching defaults
FIXED = (1, 2, 4, 10)


@torch.no_grad()
def branching(net: SpecBlockNet, held: TargetPass, rank_widths: tuple[int, ...] = RANK_WIDTHS) -> dict:
    """Block-1 chains accepted under the rank head's widths and under fixed top-w (see the docstring)."""
    table = torch.tensor(rank_widths)
    rules = {"rank": None, **{f"top{w}": w for w in FIXED}}
    acc = {name: [] for name in rules}
    width = {name: [] for name in rules}
    for tp in held.split(4):
        b, w = tp.tokens.shape
        kk = net.cfg.K
        hq, _ = first_block(net, tp.taps, tp.tokens)
        logits, rank_logits = net.heads(hq)
        r = w - 1
        idx = (torch.arange(r)[:, None] + torch.arange(1, kk + 1)).clamp(max=w - 1)  # [R, K]
        valid = (torch.arange(r)[:, None] + torch.arange(1, kk + 1) <= w - 1)[None].expand(b, r, kk)
        y = tp.y_star[:, idx]  # [B, R, K] head rows of the target's argmax
        if tp.y_ok is not None:
            valid = valid & tp.y_ok[:, idx]
        rank = rank_of(logits, y)
        kept = table[rank_logits.argmax(-1)]
        for name, fixed in rules.items():
            wk = kept if fixed is None else torch.full_like(rank, fixed)
            hit = ((rank < wk) & valid).float()
            chain = hit.cumprod(-1)  # position k is accepted if every position up to k was a hit
            reached = torch.cat([torch.ones_like(chain[..., :1]), chain[..., :-1]], -1)  # positions the rule drafts
            # every block counts, as the held-out chain acceptance counts them: one whose first target has
            # no draft-vocabulary row is a miss (valid is off there), as it is when serving
            acc[name].append(chain.sum(-1).flatten())
            width[name].append(((wk.float() * reached).sum(-1) / reached.sum(-1)).flatten())
    return {name: {"accepted": round(float(torch.cat(acc[name]).mean()), 4),
                   "mean_width": round(float(torch.cat(width[name]).mean()), 3)} for name in rules}


def evaluate(net: SpecBlockNet, held: TargetPass) -> dict:
    ev = recipes.get("specblock").evaluate(net, None, held, argparse.Namespace())
    ev["accepted_block1"] = round(float(sum(ev["block1_acc"])), 4)
    ev["branching"] = branching(net.eval(), held)
    return ev


def markdown(rows: list[dict], windows: int, window: int) -> str:
    lines = [f"Held-out: {windows} windows of {window} tokens of the target's own answers (chatgen shard 0).", "",
             "| variant | steps | train min | block-1 acc by position | sum | block-2 acc by position | rank acc (b1 / b2) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        minutes = "-" if r["train_s"] is None else f"{r['train_s'] / 60:.0f}"
        lines.append(f"| {r['variant']} | {r['steps'] or '-'} | {minutes} | "
                     f"{' / '.join(f'{a:.3f}' for a in r['block1_acc'])} | {r['accepted_block1']:.3f} | "
                     f"{' / '.join(f'{a:.3f}' for a in r.get('block2_acc', []))} | "
                     f"{r['block1_rank_acc']:.3f} / {r.get('block2_rank_acc', float('nan')):.3f} |")
    lines += ["", "Branching on block 1 (no node budget): accepted drafts per block / mean candidates kept per reached position.", "",
              "| variant | rank head (2,4,10,0) | " + " | ".join(f"top-{w}" for w in FIXED) + " |",
              "|---|---|" + "---|" * len(FIXED)]
    for r in rows:
        br = r["branching"]
        lines.append(f"| {r['variant']} | " + " | ".join(f"{br[n]['accepted']:.3f} / {br[n]['mean_width']:.2f}"
                                                      for n in ["rank", *[f"top{w}" for w in FIXED]]) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--features", type=Path, required=True)
    ap.add_argument("--root", type=Path, required=True, help="the ablation runs: ROOT/VARIANT/{metrics.jsonl,drafter}")
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--window", type=int, default=257, help="tokens per held-out window (training's --window)")
    ap.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.md")
    ap.add_argument("--also", action="append", default=[], metavar="NAME=DIR",
                    help="one more drafter evaluated on the same windows (e.g. the shipped one), after the variants")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    also = [x.split("=", 1) for x in a.also]
    if any(len(x) != 2 for x in also):
        print("error: --also takes NAME=DIR, e.g. --also shipped=specblock/assets/drafters/smollm2-135m-instruct/specblock",
              file=sys.stderr)
        return 2
    torch.set_num_threads(a.threads)
    try:
        target_dir = resolve_target(a.target)
        model = load_causal_lm(target_dir, "float32", "cpu", "sdpa", False).eval()
        emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        src = CacheWindows(FeatureCache(a.features, target_dir), a.window)
        todo = []  # (name, drafter dir, its run's final metrics; None for an --also drafter)
        for name in VARIANTS:
            metrics, drafter = a.root / name / "metrics.jsonl", a.root / name / "drafter"
            final = [r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("final")] \
                if metrics.is_file() else []
            if not final or not (drafter / "config.json").is_file():
                print(f"{name}: not finished, left out of the table", file=sys.stderr)
                continue
            todo.append((name, drafter, final[-1]))
        for name, drafter in also:
            if not (Path(drafter) / "config.json").is_file():
                raise SpecBlockError(f"--also {name}={drafter}: no drafter there (config.json missing)")
            todo.append((name, Path(drafter), None))
        rows = []
        for name, drafter, final in todo:
            net = SpecBlockNet.load(drafter, emb, head).eval()
            held = src.heldout(a.windows, net)  # the same windows for every drafter (y_star in its head rows)
            row = {"variant": name, "steps": final and final["step"], "train_s": final and final["train_s"],
                   **evaluate(net, held)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    except SpecBlockError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    a.out.parent.mkdir(parents=True, exist_ok=True)
    md = markdown(rows, a.windows, a.window)
    write_atomic(a.out.with_suffix(".json"), json.dumps({"windows": a.windows, "window": a.window, "rows": rows}, indent=1) + "\n")
    write_atomic(a.out.with_suffix(".md"), md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
