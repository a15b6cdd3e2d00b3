"""Export a SpecBlock training run (``--run-dir``) as a drafter directory with its model card.

The card's figures all come from files: steps, training minutes and threads from the checkpoint,
held-out acceptance from the run's last ``metrics.jsonl`` record, data and feature totals from the
chatgen and feature-cache manifests. Nothing is typed in by hand.
"""

from __future__ import annotations

import argparse
import argparse as _ap
import json
from pathlib import Path

from specblock.runtime.target import load_causal_lm
from specblock.training import recipes
from specblock.training.checkpoint import load_checkpoint
from specblock.training.drafter import CKPT


def card(run: dict, last: dict, gen: dict, feat: dict, net) -> str:
    a = run["args"]
    cfg = net.cfg
    tokens = run["step"] * a["batch"] * a["window"]
    g, f = gen.get("totals", {}), feat.get("totals", {})
    acc = lambda xs: " / ".join(f"{x:.3f}" for x in xs)
    return f"""# SpecBlock drafter for smollm2-135m-instruct

A SpecBlock drafter (`specblock/runtime/drafters/specblock_net.py`) for SmolLM2-135M-Instruct:
{cfg.num_layers} decoder layers at hidden {cfg.hidden_size} with MLP {cfg.intermediate_size}, K = {cfg.K} positions per
block, layer-wise shift {cfg.shift}, prefix broadcast {cfg.prefix_broadcast}, rank head over b0..b3, taps
{list(cfg.tap_layers)}. Draft vocabulary: {cfg.draft_vocab or cfg.vocab_size} of the target's {cfg.vocab_size} tokens (the most frequent in
the training answers; `d2t` in `model.safetensors`); a token outside it is never drafted. The
embedding and the LM head rows are the target's and are not stored here.

## Training (`experiments/real_drafters.sh data features specblock export`)

- Data: the target's own greedy answers (bf16, its chat template, up to 256 new tokens) to
  training instructions (GSM8K train, AlpacaEval 0-699, stdlib functions framed as the bench's code
  prompts, Shakespeare continuations): {g.get('sequences', 0):,} sequences, {g.get('answer_tokens', 0):,} answer tokens
  ({g.get('prompt_tokens', 0):,} prompt tokens) in {g.get('minutes', 0)} minutes ({g.get('answer_tokens_per_s', 0)} answer tokens/s on a
  shared 2-core CPU; `training/chatgen.py`). Held-out: chatgen shard 0.
- Features: {f.get('tokens', 0):,} tokens in {f.get('shards', 0)} shards, {f.get('gb', 0)} GB, {f.get('minutes', 0)} minutes
  (`training/featcache.py`).
- {run['step']:,} steps in {run['train_s'] / 60:.1f} minutes of training on {a['threads']} threads: batch {a['batch']} x {a['window']}-token
  windows ({tokens:,} window tokens seen), AdamW lr {a['lr']} with warmup and cosine decay,
  rank head frozen for the first {a['rank_freeze']:.0%}, valid-prefix mask {a['valid_prefix']}, cross-block {a['cross_block']},
  shared norm {not a['per_k_norm']}.
- Held-out chain acceptance by in-block position (the run's last evaluation, step {last.get('step')}):
  block 1 {acc(last.get('block1_acc', []))}; block 2 {acc(last.get('block2_acc', []))};
  rank-head accuracy {last.get('block1_rank_acc')} / {last.get('block2_rank_acc')}.
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--features", type=Path, required=True)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    run = load_checkpoint(args.run_dir / CKPT)
    targs = _ap.Namespace(**run["args"])
    targs.d2t = run["net"].get("d2t")  # the flags keep only a string of it; the weights hold the map
    target = load_causal_lm(targs.target, "bfloat16", "cpu", "sdpa", False)
    net = recipes.get(run["method"]).build(target, targs)
    net.load_state_dict(run["net"])
    net.save(args.out)
    lines = [json.loads(x) for x in (args.run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    gen = json.loads((args.data / "manifest.json").read_text())
    feat = json.loads((args.features / "manifest.json").read_text())
    (args.out / "README.md").write_text(card(run, lines[-1] if lines else {}, gen, feat, net))
    print(f"exported step {run['step']} to {args.out} "
          f"({(args.out / 'model.safetensors').stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
