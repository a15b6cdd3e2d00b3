"""Export a drafter training run (SpecBlock, EAGLE-3, Medusa, ParallelSpec, Falcon, SpS) (``--run-dir``) as a drafter directory with its model card.

The card's figures all come from files: steps, training minutes and threads from the checkpoint,
held-out acceptance from the run's last ``metrics.jsonl`` record, data and feature totals from the
chatgen and feature-cache manifests. Nothing is typed in by hand.
"""

from __future__ import annotations

import argparse
import argparse as _ap
import json
import sys
from pathlib import Path

from specblock.atomic import write_atomic
from specblock.runtime.target import load_causal_lm
from specblock.training import recipes
from specblock.training.checkpoint import load_checkpoint
from specblock.training.drafter import CKPT, lr_at
from specblock.training.exported import TRAINING, training_record
from specblock.training.featcache import is_reference


DESCRIBE = {
    "specblock": lambda c: (f"A SpecBlock drafter (`specblock/runtime/drafters/specblock_net.py`): {c.num_layers} decoder layers at hidden "
                            f"{c.hidden_size} with MLP {c.intermediate_size}, K = {c.K} positions per block, layer-wise shift {c.shift}, "
                            f"prefix broadcast {c.prefix_broadcast}, rank head over b0..b3, taps {list(c.tap_layers)}."),
    "eagle3": lambda c: (f"An EAGLE-3 drafter (`specblock/runtime/drafters/eagle3.py`): one decoder layer at hidden {c.hidden_size} "
                         f"with MLP {c.intermediate_size}, fusing taps {list(c.tap_layers)}, trained with training-time test."),
    "medusa": lambda c: f"Medusa-1 heads (`specblock/runtime/drafters/medusa.py`): {c.heads} heads on the top hidden state.",
    "parallelspec": lambda c: (f"A ParallelSpec drafter (`specblock/runtime/drafters/parallelspec.py`): {c.num_layers} decoder layer(s) at "
                               f"hidden {c.hidden_size} with MLP {c.intermediate_size}, fusing taps {list(c.tap_layers)}, k = {c.k} "
                               "tokens per forward ([MASK] queries)."),
    "falcon": lambda c: (f"A Falcon drafter (`specblock/runtime/drafters/falcon.py`): {c.num_layers} decoder layer(s) at hidden "
                         f"{c.hidden_size} with MLP {c.intermediate_size}, fusing taps {list(c.tap_layers)}, blocks of "
                         f"{c.block_size} tokens, {c.forwards} forwards per tree, trained with glancing."),
    "sps": lambda c: (f"An SpS draft model (`specblock/runtime/drafters/sps.py`, also HF's assistant for `hf-assisted`): a "
                      f"`LlamaForCausalLM` with {c.num_hidden_layers} layers at hidden {c.hidden_size}, MLP {c.intermediate_size}, "
                      f"{c.num_attention_heads} heads, tied vocabulary matrix {'(started from the target embedding in its top principal directions)' if c.tie_word_embeddings else ''}."),
}

VOCAB_HEAD = """Draft vocabulary: {n}
of the target's {v} tokens (the most frequent in the training answers, mixed 50/50 with the shared-data
corpus; `d2t` in `model.safetensors`); a token outside it is never drafted. The embedding and the LM head rows
are the target's and are not stored here."""
VOCAB_LM = """It is a whole language model over the
target's {v} tokens with its own (stored) vocabulary matrix: HF's assisted generation serves it as it is."""


def _acc(xs) -> str:
    return " / ".join(f"{x:.3f}" for x in xs) if isinstance(xs, list) and all(isinstance(x, (int, float)) for x in xs) else str(xs)


def _sessions_line(lines: list[dict]) -> str:
    """Where a run was stopped and resumed. The log does not say whether the resume raised
    ``--max-minutes`` (which restarts the cosine from a higher point) or kept it (a stop and resume
    on the same schedule), so the card says what each would mean."""
    ends = [r for r in lines[:-1] if r.get("final")]
    if not ends:
        return ""
    where = ", ".join(f"step {r['step']} ({r['train_s'] / 60:.1f} min)" for r in ends)
    return (f"\n- Trained in {len(ends) + 1} sessions: each earlier one ended at {where}; the next resumed from its "
            "checkpoint. The learning rate follows wall time to --max-minutes: a resume with the same value went on "
            "along the same schedule, one with a longer value rose again and decayed over the new length.")


def lineage(run: dict) -> list[dict]:
    """The runs a fine-tune descends from, nearest first. Runs record their source's lineage since
    this round; for older ones the source checkpoint is read from disk while it is there."""
    chain, init = [], run.get("init")
    while init:
        chain.append(init)
        nxt = init.get("init")
        src = Path(init["from"]) / CKPT
        if nxt is None and src.is_file():
            nxt = load_checkpoint(src).get("init")
        init = nxt
    return chain


def _init_line(run: dict) -> str:
    """A fine-tune (``--init-from``) counts only its own steps below; say what it started from, and
    what that started from."""
    chain = lineage(run)
    if not chain:
        return ""
    runs = "; that one from ".join(_source(i, n == 0) for n, i in enumerate(chain))
    if any(i.get("exported") and not i.get("record") for i in chain):  # an export from before training.json
        return (f"\n- Fine-tuned from {runs}. The figures above are this fine-tune's alone (its own optimizer and "
                "schedule); the source's own training is on its model card in git history.")
    total = run["train_s"] + sum(i["train_s"] for i in chain)
    return (f"\n- Fine-tuned from {runs}. The figures above are this fine-tune's alone (its own optimizer and "
            f"schedule); all rounds together: {run['step'] + sum(i['step'] for i in chain):,} steps, {total / 60:.1f} minutes.")


def _source(i: dict, first: bool) -> str:
    what = "the exported drafter in " if i.get("exported") else "the run in " if first else ""
    if i.get("exported") and not i.get("record"):
        return f"{what}`{i['from']}` (no training.json beside it)"
    name = i["from"] if i.get("exported") else Path(i["from"]).name  # a shipped drafter's path says which one
    return (f"{what}`{name}` ({i['step']:,} steps, {i['train_s'] / 60:.1f} minutes on "
            f"{i['args'].get('threads', '?')} thread(s), batch {i['args'].get('batch')} x {i['args'].get('window')}, lr {i['args'].get('lr')}"
            f"{_no_cross_block(i['args'])})")


def _no_cross_block(args: dict) -> str:
    """SpecBlock rounds trained without the paper's cross-block training say so (the flag means nothing elsewhere)."""
    return ", without cross-block training" if args.get("method", "specblock") == "specblock" and args.get("cross_block") is False else ""


def _stopped_line(run: dict, last: dict) -> str:
    """A run stopped (SIGTERM) before its schedule's end never decayed its learning rate fully."""
    a = run["args"]
    progress = max(run["step"] / a["max_steps"], run["train_s"] / (60 * a["max_minutes"]))
    if progress >= 1 or not last.get("final"):
        return ""
    lr = lr_at(run["step"], progress, _ap.Namespace(**a))
    return (f" Stopped by hand at {progress:.0%} of its schedule ({a['max_minutes']:g} minutes or {a['max_steps']:,} steps), "
            f"the learning rate at {lr:.2g}.")


def _training_line(run: dict, method: str, last: dict, has_refs: bool = True) -> str:
    a = run["args"]
    extra = {"specblock": f", rank head frozen for the first {a['rank_freeze']:.0%}, valid-prefix mask {a['valid_prefix']}, "
                          f"cross-block {a['cross_block']}, shared norm {not a['per_k_norm']}",
             "eagle3": f", training-time test over {a['ttt_steps']} depths",
             "medusa": ", soft targets from the cached top-8",
             "falcon": f", glancing {a['glance_start']} -> {a['glance_end']}",
             "sps": ", soft targets from the cached top-8 (no target pass per step)"}.get(method, "")
    mix = (f"; {a['own_share']:.0%} of windows from the target's own answers" if a.get("own_share") is not None else "")
    if not has_refs and a.get("own_share") is not None:  # the trainer applies --own-share only where both kinds exist
        mix = "; all windows from the target's own answers (no reference shards to mix in)"
    return (f"{run['step']:,} steps in {run['train_s'] / 60:.1f} minutes of training on {a['threads']} thread(s): batch {a['batch']} x "
            f"{a['window']}-token windows ({run['step'] * a['batch'] * a['window']:,} window tokens seen), AdamW lr {a['lr']} with "
            f"warmup and cosine decay over wall time{extra}{mix}.{_stopped_line(run, last)}{_init_line(run)}")


def gen_totals(gen: dict, feat: dict) -> dict:
    """The chatgen totals over the shards the feature cache holds: generation may have gone on
    since, and answers never cached were never trained on."""
    shards = [v for n, v in gen.get("shards", {}).items() if n in feat.get("shards", {})]
    if not shards:
        return gen.get("totals", {})
    ans, secs = sum(s.get("answer_tokens", 0) for s in shards), sum(s.get("seconds", 0.0) for s in shards)
    return {"sequences": sum(s.get("sequences", 0) for s in shards), "answer_tokens": ans, "minutes": round(secs / 60, 2),
            "answer_tokens_per_s": round(ans / secs, 1) if secs else 0}


def card(run: dict, last: dict, gen: dict, refs: dict | None, feat: dict, net, target_name: str, sessions: str = "",
         ask: dict | None = None) -> str:
    method = run["method"]
    cfg = net.cfg if hasattr(net, "cfg") else net.model.config  # SpS: an HF model's config
    vocab = (VOCAB_LM.format(v=cfg.vocab_size) if method == "sps" else
             VOCAB_HEAD.format(n=getattr(cfg, "draft_vocab", None) or cfg.vocab_size, v=cfg.vocab_size))
    g, f = gen_totals(gen, feat), feat.get("totals", {})
    ref_tokens = sum(s.get("answer_tokens", 0) for n, s in feat.get("shards", {}).items() if is_reference(n))
    ref_line = ""
    if refs is not None:
        ref_line = (f"\n- Reference answers (`training/refanswers.py`, cached in the feature cache as `ref_*` shards): "
                    f"{sum(1 for n in feat.get('shards', {}) if is_reference(n))} shards, {ref_tokens:,} answer tokens of "
                    "AlpacaEval 0-699 responses by 11 open chat models, GSM8K training solutions and whole stdlib "
                    "functions, encoded with the target's chat template; soft targets and features from the target.")
    if ask is not None:
        a = gen_totals(ask, feat)
        ref_line += (f"\n- Instructions the target wrote itself (`training/selfask.py`: search questions and requests to an "
                     f"assistant), answered the same way (`chatgen --instructions`, `ask*_*` shards): {a.get('sequences', 0):,} "
                     f"sequences, {a.get('answer_tokens', 0):,} answer tokens in {a.get('minutes', 0)} minutes.")
    held = set(feat.get("heldout_shards", []))
    own = sum(s["tokens"] for n, s in feat.get("shards", {}).items() if not is_reference(n) and n not in held)
    ref = sum(s["tokens"] for n, s in feat.get("shards", {}).items() if is_reference(n))
    mix_line = (f"\n- Training windows are drawn from {own:,} tokens of the target's own answers and {ref:,} tokens of "
                f"reference answers (prompts included); the held-out shards ({', '.join(sorted(held)) or 'none'}) are never trained on.")
    figures = "\n".join(f"  - {k}: {_acc(v)}" for k, v in last.items() if k not in ("step", "train_s", "final", "loss"))
    return f"""# {method} drafter for {target_name}

{DESCRIBE.get(method, lambda c: f"A {method} drafter.")(cfg)} {vocab}

## Training (`experiments/real_drafters.sh`)

- Data: the target's own greedy answers ({gen.get('dtype', 'dtype not recorded')}, its chat template, up to {gen.get('settings', {}).get('max_new_tokens', '?')} new tokens) to training
  instructions (GSM8K train, AlpacaEval 0-699, stdlib functions framed as the bench's code prompts,
  Shakespeare continuations): {g.get('sequences', 0):,} sequences, {g.get('answer_tokens', 0):,} answer tokens in
  {g.get('minutes', 0)} minutes ({g.get('answer_tokens_per_s', 0)} answer tokens/s; `training/chatgen.py`). Held-out: chatgen shard 0.{ref_line}
- Features: {f.get('tokens', 0):,} tokens (prompts and answers) in {f.get('shards', 0)} shards, {f.get('gb', 0)} GB,
  {f.get('minutes', 0)} minutes, the target in {feat.get('dtype')} (`training/featcache.py`).{mix_line}
- {_training_line(run, method, last, ref > 0)}{sessions}
- Held-out figures at the run's last evaluation (step {last.get('step')}), from `metrics.jsonl`:
{figures}
"""


def refuse(why: str) -> None:
    """One line on stderr and exit 2, before anything is written."""
    print(f"error: {why}", file=sys.stderr)
    raise SystemExit(2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--features", type=Path, default=None,
                    help="the feature cache the run trained on, for the card (default: the one its flags name)")
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--refs", type=Path, default=None, help="the refanswers directory, when the cache holds reference shards")
    ap.add_argument("--ask", type=Path, action="append", default=[],
                    help="a chatgen --instructions directory (selfask), when the cache holds its shards (repeat for several)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    run = load_checkpoint(args.run_dir / CKPT)
    targs = _ap.Namespace(**run["args"])
    trained_on = getattr(targs, "features", None)
    if args.features is None and trained_on is None:
        refuse(f"{args.run_dir} trained without a feature cache; pass --features for the card")
    if args.features is None:
        args.features = Path(trained_on)
    elif trained_on is not None and Path(trained_on).resolve() != args.features.resolve():
        # the card's feature totals and target dtype come from this cache: another one would misstate them
        refuse(f"{args.run_dir} trained on the feature cache {trained_on}, not {args.features}; "
               "pass that one (or leave --features out)")
    targs.d2t = run["net"].get("d2t")  # the flags keep only a string of it; the weights hold the map
    target = load_causal_lm(targs.target, "bfloat16", "cpu", "sdpa", False)
    net = recipes.get(run["method"]).build(target, targs)
    net.load_state_dict(run["net"])
    serving = args.out / "serving.json"  # measured serving settings (best_budgets.py): kept over a re-export
    kept = serving.read_bytes() if serving.is_file() else None
    net.save(args.out)  # SpS writes a fresh HF directory in place of the old one
    if kept is not None:
        write_atomic(serving, kept)
    write_atomic(args.out / TRAINING, json.dumps(training_record(run), indent=1))  # a later --init-from's lineage
    lines = [json.loads(x) for x in (args.run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    gen = json.loads((args.data / "manifest.json").read_text())
    refs = json.loads((args.refs / "manifest.json").read_text()) if args.refs else None
    asks = [json.loads((d / "manifest.json").read_text()) for d in args.ask]  # distinct shard names: one set of shards
    ask = {"shards": {n: v for m in asks for n, v in m.get("shards", {}).items()}} if asks else None
    feat = json.loads((args.features / "manifest.json").read_text())
    write_atomic(args.out / "README.md", card(run, lines[-1] if lines else {}, gen, refs, feat, net, Path(targs.target).name,
                                                  _sessions_line(lines), ask))
    print(f"exported step {run['step']} to {args.out} "
          f"({(args.out / 'model.safetensors').stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
