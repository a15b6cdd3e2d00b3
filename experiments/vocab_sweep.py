"""Draft-vocabulary size for the real model's drafters: N = 4k / 8k / 16k / full (issue 14, item 3).

A drafter's LM-head rows are the target's own frozen rows ``W[d2t]`` (``draftvocab.py``), so one
trained drafter can be re-headed to any N without retraining: the same hidden states score N rows.
This script does that for the shipped drafters with an LM head (trained at N = 8192; ``--methods``,
default SpecBlock and EAGLE-3, also Medusa, ParallelSpec and Falcon):

1. held-out (the feature cache's held-out shards, the windows training evaluates on): how often the
   target's argmax has a head row (coverage, the ceiling on acceptance), chain acceptance by position
   (SpecBlock: block 1 and block 2 under the valid-prefix rule; EAGLE-3, ParallelSpec, Falcon: by
   depth) and their sum, the expected accepted drafts of one chain; Medusa: each head's top-1 and
   top-5 (its heads are not a chain);
2. writes each re-headed drafter, with the shipped ``serving.json``, to ``--out-dir`` so that
   ``experiments/real_drafters.sh vocab`` benches them (tau, T_D%, Spd in one run).

What this is not: the issue's full protocol retrains a drafter per N. Here the drafter learned at
8k; rows beyond it never were labels in training (they were masked out), so N > 8k measures what
the extra rows add *without* training for them, and N = 4k what dropping rows costs.

    python experiments/vocab_sweep.py --target smollm2-135m-instruct \
        --features ~/.cache/specblock/features/smollm2-135m-instruct --out-dir ~/.cache/specblock/vocab_sweep \
        --json experiments/results/vocab_sweep_smollm2.json
    python experiments/vocab_sweep.py --methods medusa,parallelspec,falcon ... --json experiments/results/vocab_sweep_smollm2_b.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

from specblock.errors import SpecBlockError
from specblock.models import resolve_target
from specblock.runtime.drafters.eagle3 import Eagle3Net
from specblock.runtime.drafters.falcon import FalconNet
from specblock.runtime.drafters.medusa import MedusaNet
from specblock.runtime.drafters.parallelspec import ParallelSpecNet
from specblock.runtime.drafters.specblock_net import SpecBlockNet
from specblock.runtime.target import load_causal_lm
from specblock.training import recipes, vocab
from specblock.training.cachewindows import CacheWindows
from specblock.training.vocab import vocab_counts
from specblock.training.featcache import FeatureCache

SIZES = (4096, 8192, 16384, None)  # None: the target's whole vocabulary
NETS = {"eagle3": Eagle3Net, "medusa": MedusaNet, "parallelspec": ParallelSpecNet, "falcon": FalconNet}


def load(kind: str, path: Path, model):
    if kind == "specblock":
        return SpecBlockNet.load(path, model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    if kind not in NETS:
        raise SpecBlockError(f"--methods: {kind!r} has no LM head to re-head; use some of specblock, {', '.join(NETS)}")
    return NETS[kind].load(path, model)


def reheaded(base, model, d2t: np.ndarray | None):
    """``base`` with its head over ``d2t`` (None: all rows); every trained weight unchanged."""
    cfg = base.cfg.model_copy(update={"draft_vocab": None if d2t is None else len(d2t)})
    net = type(base)(cfg)
    if d2t is not None:
        net.set_vocab(torch.as_tensor(d2t))
    net.tie_to_target(model)
    trained = {k: v for k, v in base.state_dict().items() if k not in ("d2t", "lm_head.weight")}
    missing, unexpected = net.load_state_dict(trained, strict=False)
    if unexpected or set(missing) - {"d2t", "lm_head.weight"}:
        raise SpecBlockError(f"re-heading {type(base).__name__} lost weights: {missing} {unexpected}")
    return net.eval()


@torch.no_grad()
def evaluate(kind: str, net, cache: FeatureCache, windows: int, window: int = 257) -> dict:
    src = CacheWindows(cache, window, feature=recipes.get(kind).cached)  # what the method trained on
    held = src.heldout(windows, net)
    y_ok = getattr(held, "y_ok", None)  # None: the full vocabulary (SpS)
    cov = 1.0 if y_ok is None else float(y_ok[:, :-1].float().mean())
    args = argparse.Namespace(ttt_steps=6, hard_labels=False)
    ev = recipes.get(kind).evaluate(net, None, held, args)
    out = {"coverage": round(cov, 4), **ev}
    chains = [v for k, v in ev.items() if k.endswith("_acc") and isinstance(v, list)]
    out["accepted_per_chain"] = [round(float(sum(c)), 3) for c in chains]
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--features", type=Path, required=True, help="the feature cache the drafters trained on")
    ap.add_argument("--drafters", type=Path, default=Path("specblock/assets/drafters/smollm2-135m-instruct"))
    ap.add_argument("--methods", default="specblock,eagle3")
    ap.add_argument("--windows", type=int, default=16, help="held-out windows of 257 tokens")
    ap.add_argument("--vocab-corpus", type=float, default=0.5, help="as in training (real_drafters.sh)")
    ap.add_argument("--out-dir", type=Path, required=True, help="re-headed drafters go to OUT_DIR/METHOD_N")
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    try:
        target_dir = resolve_target(a.target)
        model = load_causal_lm(target_dir, "float32", "cpu", "sdpa", False).eval()
        cache = FeatureCache(a.features, target_dir)
        v = model.config.vocab_size
        counts = vocab_counts(argparse.Namespace(features=a.features, vocab_corpus=a.vocab_corpus, target=target_dir,
                                                 window=257), CacheWindows(cache, 257), v)
        rows = []
        for kind in a.methods.split(","):
            base = load(kind, a.drafters / kind, model)
            for n in SIZES:
                # the shipped map where N is the shipped size (the drafter as served), else the top N
                d2t = (None if n is None else base.d2t.numpy() if n == base.cfg.draft_vocab else vocab.top_n(counts, n))
                net = base if n == base.cfg.draft_vocab else reheaded(base, model, d2t)
                name = f"{kind}_{'full' if n is None else n}"
                dest = a.out_dir / name
                ev = evaluate(kind, net, cache, a.windows)  # first: Medusa's evaluation recalibrates its tree table
                net.save(dest)
                if (a.drafters / kind / "serving.json").is_file():
                    shutil.copy(a.drafters / kind / "serving.json", dest / "serving.json")
                row = {"method": kind, "N": n or v, "drafter": str(dest), **ev}
                print(json.dumps(row), flush=True)
                rows.append(row)
    except SpecBlockError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({"windows": a.windows, "trained_at": 8192, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
