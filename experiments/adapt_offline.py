"""Does one serving-time update help the queries that come after it? Adaptation without the clock.

The bench's ``specblock+adapt`` row mixes two things: what an update costs (the wait the bench
charges) and what it buys (acceptance afterwards). This script measures the second alone. The
shipped SpecBlock drafter serves ``--prompts`` queries of a domain with the adapter recording
the free signal and never training (the same records an adapting server keeps). One update of
each ``ARM@LR`` is then trained on the first half of the queries, exactly as the worker would
(``adapt_update.UpdateTrainer.step``: its steps, batch, replay weights, KL anchor and autocast),
and scored on the second half against the weights it started from.

The score is the drafter's block-1 chain length under teacher forcing: at every generated
position, how many of its K top-1 drafts in a row equal the target's greedy tokens (0..K). That
is what a chain verification accepts, without the tree or the clock; a ratio below 1 means the
update made the next queries' drafts worse. Each arm is the mean over ``--seeds`` updates (the
replay draws differ).

The prompts default to numbers 40-55 of each domain: the bench reads the first few (3 in the
main tables), never these.

    .venv/bin/python experiments/adapt_offline.py --domains qa,mtbench,chat \\
        --arms heads@1e-3,heads@1e-4,full@2e-4,full@1e-5 --out experiments/results/adapt_offline

About 2-3 minutes per domain on 2 cores.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))  # results_io beside it, however it is loaded

from results_io import write_results  # noqa: E402
from specblock.models import resolve_target  # noqa: E402
from specblock.prompts import load_prompts  # noqa: E402
from specblock.runtime import drafters  # noqa: E402
from specblock.runtime.adapt import Adapter, AdaptSettings  # noqa: E402
from specblock.runtime.adapt_signal import Sample, block1_rows  # noqa: E402
from specblock.runtime.chat import encode_prompt  # noqa: E402
from specblock.runtime.cli import load_tokenizer, quiet_transformers  # noqa: E402
from specblock.runtime.drafters.specblock_net import SpecBlockNet  # noqa: E402
from specblock.runtime.engine import Engine  # noqa: E402
from specblock.runtime.target import TargetModel, read_generation_eos  # noqa: E402


def chain_length(net: SpecBlockNet, samples: list[Sample]) -> float:
    """Mean accepted length of the block-1 top-1 chain over every labelled position."""
    total, rows = 0.0, 0
    t2d = net.t2d() if getattr(net.cfg, "draft_vocab", None) is not None else None
    with torch.no_grad():
        for s in samples:
            hq = block1_rows(net, s.taps, s.tokens, s.rows)
            logits, _ = net.heads(hq.reshape(-1, hq.shape[-1]))
            pred = logits.argmax(-1).reshape(hq.shape[:2])
            greedy = s.y_ids[:, :, 0]
            if t2d is not None:  # target ids to draft rows; a token outside the draft vocabulary is -1
                greedy = t2d[greedy]
            hit = (pred == greedy) & s.valid
            total += float(hit.int().cumprod(-1).sum())
            rows += hit.shape[0]
    return total / max(rows, 1)


def recording_adapter(name: str, dtype: str, settings: AdaptSettings):
    """The shipped SpecBlock drafter at its ``serving.json`` settings, wrapped in an Adapter that
    records the signal (``settings.window`` huge: it never trains on its own), and the engine and
    tokenizer that serve it as the bench does. Returns (adapter, engine, tokenizer)."""
    path = resolve_target(name)
    target = TargetModel.load(path, dtype, "cpu", "sdpa", False)
    tok = load_tokenizer(path, False)
    opts = drafters.serving_settings("specblock", target, {})
    budget = int(opts.pop("budget"))
    adapter = Adapter(drafters.build("specblock", target, opts), settings)
    eos = frozenset(read_generation_eos(path) or {tok.eos_token_id})
    return adapter, Engine(target, adapter, budget=budget, eos_ids=eos), tok


def parse_arms(text: str) -> list[tuple[str, float]]:
    arms = []
    for item in text.split(","):
        arm, _, lr = item.partition("@")
        if arm not in ("heads", "full") or not lr:
            raise SystemExit(f"--arms: {item!r} is not ARM@LR with ARM heads or full (e.g. heads@1e-4)")
        arms.append((arm, float(lr)))
    return arms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="packed-fp16")
    ap.add_argument("--domains", default="qa,mtbench,chat")
    ap.add_argument("--first", type=int, default=40, help="first prompt number of each domain")
    ap.add_argument("--prompts", type=int, default=16, help="queries per domain: the update learns on the first half")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--arms", type=parse_arms, default=parse_arms("heads@1e-3,heads@3e-4,heads@1e-4,full@2e-4,full@5e-5,full@1e-5"))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--cross", action="store_true",
                    help="also score each update on the other domains' later queries (traffic that shifts domain)")
    ap.add_argument("--amp", default="auto", choices=["auto", "bf16", "off"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "experiments/results/adapt_offline")
    args = ap.parse_args()
    quiet_transformers()
    torch.set_num_threads(args.threads)
    domains = args.domains.split(",")
    settings = AdaptSettings(window=10**9, amp=args.amp, buffer=args.prompts * len(domains))
    adapter, engine, tok = recording_adapter(args.target, args.dtype, settings)
    trainer, records, later, base = adapter.trainer, {}, {}, {}
    for domain in domains:
        prompts = load_prompts(domain, args.first + args.prompts)[args.first:]  # chat has 55 in all
        for p in prompts:
            engine.generate(encode_prompt(tok, p), args.max_new_tokens)
        records[domain] = list(adapter.buffer)[-len(prompts):]
        later[domain], _ = trainer.samples(records[domain][len(prompts) // 2:])
        base[domain] = chain_length(trainer.theta_0, later[domain])
    rows = []
    torch.set_num_threads(1)  # the worker's one thread
    for domain in domains:
        scored = domains if args.cross else [domain]
        row = {"domain": domain, "queries": len(records[domain]), "static": round(base[domain], 4), "amp": trainer.amp}
        for arm, lr in args.arms:
            trainer.cfg.lr_heads = trainer.cfg.lr_full = lr
            scores = {d: [] for d in scored}
            for seed in range(args.seeds):
                trainer._rng = np.random.default_rng(seed)
                state = trainer.step(arm, records[domain][: len(records[domain]) // 2], adapter.master, backbone=0)
                net = copy.deepcopy(trainer.theta_0)
                net.load_state_dict({**net.state_dict(), **state})
                for d in scored:
                    scores[d].append(chain_length(net, later[d]))
            for d in scored:
                row[f"{arm}@{lr:g}" + ("" if d == domain else f" on {d}")] = round(float(np.mean(scores[d])) / base[d], 4)
        rows.append(row)
        print(row, file=sys.stderr, flush=True)
    names = [f"{a}@{lr:g}" for a, lr in args.arms]
    lines = ["python experiments/adapt_offline.py " + " ".join(sys.argv[1:]), "",
             "Block-1 top-1 chain length on the later half of the queries after one update learned on the earlier half, "
             "relative to the weights it started from (mean of "
             f"{args.seeds} updates; {args.dtype} target, amp {args.amp}).", "",
             "| domain | static chain | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    lines += [f"| {r['domain']} | {r['static']:.3f} | " + " | ".join(f"{r[n]:.3f}" for n in names) + " |" for r in rows]
    if args.cross:
        lines += ["", "Each update scored on every domain's later queries (rows: learned on; columns: scored on).", ""]
        for n in names:
            lines += [f"| {n} | " + " | ".join(domains) + " |", "|---|" + "---|" * len(domains)]
            lines += [f"| {r['domain']} | " + " | ".join(f"{r[n if d == r['domain'] else f'{n} on {d}']:.3f}" for d in domains)
                      + " |" for r in rows] + [""]
    write_results(args.out, args, rows, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
