"""Serving-time adaptation on a shifted domain (issue 6): static vs +adapt and its ablations.

The shipped SpecBlock drafter serves one stream of prompts from the domain it does worst on
(``--domain auto``: a quick static scan of every domain picks the lowest tau), four times, each
from the pretrained weights:

- ``static``: the same wrapper with the skip arm only (it records the signal, never trains);
- ``adapt``: the cost-aware bandit over skip / heads / full (the shipped setting);
- ``always_full``: no bandit, every window that finds the worker idle starts a full update;
- ``no_heads``: the bandit over skip / full only.

Greedy outputs are identical across runs (checked), so per-query tau lines up query by query;
chunks of ``--chunk`` queries compare each run with static. Reported: tau and tokens/s per
adaptation window and per chunk, N (queries served before +adapt's chunk tau first reaches
1.1x static's, and the ratio over every query after that), arm counts and each arm's measured
update time, rollbacks, and the worst chunk ratio against static (theta_0's own weights).

    .venv/bin/python experiments/adapt_shift.py            # defaults: the run in results/
    .venv/bin/python experiments/adapt_shift.py --prompts 80 --max-new-tokens 48 --window 128 \\
        --domain auto --scan 6 --out experiments/results/adapt_shift

Writes ``adapt_shift.json`` and ``adapt_shift.png``. About 10-15 minutes on 2 shared CPU cores.
tokens/s on a shared machine measure the neighbours too: the JSON records the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from specblock.policies.bandit import ARMS
from specblock.models import resolve_target
from specblock.prompts import DOMAINS, load_prompts
from specblock.runtime import drafters
from specblock.runtime.adapt import Adapter, AdaptSettings
from specblock.runtime.chat import encode_prompt
from specblock.runtime.cli import load_tokenizer, quiet_transformers
from specblock.runtime.config import DEFAULT_TARGET
from specblock.runtime.engine import Engine
from specblock.runtime.target import TargetModel, read_generation_eos

CONFIGS = {"static": ("skip",), "adapt": ARMS, "always_full": ("full",), "no_heads": ("skip", "full")}


def load(name: str | None, dtype: str):
    path = resolve_target(name) if name else DEFAULT_TARGET  # default: the lab model, as before
    target = TargetModel.load(path, dtype, "cpu", "sdpa", False)
    tok = load_tokenizer(path, False)
    eos = frozenset(read_generation_eos(path) or {tok.eos_token_id})
    return target, tok, eos


def specblock(target, budget: int | None):
    """The shipped SpecBlock drafter at its measured serving settings (``serving.json``: budget, M,
    widths), the node budget overridden by ``budget`` where given. Returns (drafter, budget)."""
    opts = drafters.serving_settings("specblock", target, {})
    measured = int(opts.pop("budget", drafters.DEFAULT_BUDGET))
    return drafters.build("specblock", target, opts), budget or measured


def scan(target, tok, eos, n: int, max_new: int, budget: int | None) -> dict[str, float]:
    """Static tau per domain on the first ``n`` prompts (the plain drafter, no wrapper)."""
    drafter, budget = specblock(target, budget)
    eng = Engine(target, drafter, budget=budget, eos_ids=eos)
    out = {}
    for dom in DOMAINS:
        acc = []
        for p in load_prompts(dom, n):
            acc += eng.generate(encode_prompt(tok, p), max_new).stats.accepted
        out[dom] = round(float(np.mean(np.asarray(acc) + 1)), 4)
        print(f"scan {dom}: tau {out[dom]:.3f}", file=sys.stderr, flush=True)
    return out


def serve(name: str, arms: tuple[str, ...], target, eos, encoded: list[list[int]], args) -> dict:
    settings = AdaptSettings(window=args.window, lam=args.lam, arms=arms, steps=args.steps, seed=args.seed,
                             lr_heads=args.lr_heads, lr_full=args.lr_full)
    drafter, budget = specblock(target, args.budget)
    adapter = Adapter(drafter, settings)
    eng = Engine(target, adapter, budget=budget, eos_ids=eos)
    load0 = os.getloadavg()[0]
    eng.generate(encoded[0][-16:], 4)  # warm-up, then forget it
    adapter.clear()
    query = [0]
    adapter.on_window = lambda w: w.update(query=query[0])
    queries = []
    t0 = time.perf_counter()
    for i, ids in enumerate(encoded):
        query[0] = i
        res = eng.generate(ids, args.max_new_tokens)
        s = res.stats
        queries.append({"tau": round(s.tau, 4), "iterations": s.iterations, "new_tokens": s.new_tokens,
                        "wall_s": round(s.wall_s, 4), "token_ids": res.token_ids})
        if (i + 1) % 10 == 0:
            print(f"  {name}: {i + 1} queries, load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
    wall = time.perf_counter() - t0
    adapter.wait(120)
    adapter.close()
    summ = adapter.summary()
    it = sum(q["iterations"] for q in queries)
    tau = sum(q["tau"] * q["iterations"] for q in queries) / it
    tps = sum(q["new_tokens"] for q in queries) / wall
    print(f"{name}: tau {tau:.3f}, {tps:.1f} tokens/s, arms {summ['adapt_arms']}, update s {summ['adapt_update_s']}, "
          f"rollbacks {summ['adapt_rollbacks']}", file=sys.stderr, flush=True)
    return {"arms": list(arms), "tau": round(tau, 4), "tokens_per_s": round(tps, 3), "wall_s": round(wall, 2),
            "loadavg_start_end": [round(load0, 2), round(os.getloadavg()[0], 2)],
            "summary": summ, "windows": adapter.windows, "queries": queries}


def chunks(queries: list[dict], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Iteration-weighted tau and tokens/s per chunk of ``size`` consecutive queries."""
    tau, tps = [], []
    for a in range(0, len(queries), size):
        q = queries[a : a + size]
        it = sum(x["iterations"] for x in q)
        tau.append(sum(x["tau"] * x["iterations"] for x in q) / it)
        tps.append(sum(x["new_tokens"] for x in q) / sum(x["wall_s"] for x in q))
    return np.asarray(tau), np.asarray(tps)


def analyse(runs: dict, size: int) -> dict:
    static = runs["static"]["queries"]
    st_tau, st_tps = chunks(static, size)
    out = {}
    for name, run in runs.items():
        q = run["queries"]
        tau, tps = chunks(q, size)
        ratio = tau / st_tau
        hit = np.flatnonzero(ratio >= 1.1)
        n = int((hit[0] + 1) * size) if hit.size else None
        after = None
        if n is not None and n < len(q):
            t_a, _ = chunks(q[n:], len(q))
            t_s, _ = chunks(static[n:], len(q))
            after = round(float(t_a[0] / t_s[0]), 4)
        played = run["summary"]["adapt_arms"]
        updates = played["heads"] + played["full"]
        judged = {a: [w["cost"] for w in run["windows"] if w["judged"] == a] for a in ("heads", "full")}
        out[name] = {
            "queries_identical_to_static": sum(a["token_ids"] == b["token_ids"] for a, b in zip(q, static)),
            "chunk_tau": np.round(tau, 4).tolist(), "chunk_tokens_per_s": np.round(tps, 3).tolist(),
            "chunk_tau_ratio": np.round(ratio, 4).tolist(),
            "tau_ratio_all": round(run["tau"] / runs["static"]["tau"], 4),
            "tps_ratio_all": round(run["tokens_per_s"] / runs["static"]["tokens_per_s"], 4),
            "N_queries_to_1.1x": n, "tau_ratio_after_N": after,
            "heads_share_of_updates": round(played["heads"] / updates, 3) if updates else None,
            "arm_cost": {a: {"update_s": run["summary"]["adapt_update_s"].get(a),
                             "window_fraction": round(float(np.mean(c)), 4) if c else None} for a, c in judged.items()},
            "worst_chunk_ratio": round(float(ratio.min()), 4),
            "chunks_below_static": int((ratio < 1.0).sum()),
        }
    return out


def plot(runs: dict, size: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax3, ax2) = plt.subplots(1, 3, figsize=(16, 4.2))
    st_tau, _ = chunks(runs["static"]["queries"], size)
    for name, run in runs.items():
        tau, _ = chunks(run["queries"], size)
        x = (np.arange(len(tau)) + 1) * size
        ax1.plot(x, tau, marker="o", ms=3, label=name)
        ax3.plot(x, tau / st_tau, marker="o", ms=3, label=name)
        w = run["windows"]
        ax2.plot([v["query"] for v in w], [v["tau"] for v in w], lw=1, label=name)
        rb = [v for v in w if v["rollback"] == "rollback"]
        ax2.scatter([v["query"] for v in rb], [v["tau"] for v in rb], marker="x", color="k", zorder=3)
    ax1.set(xlabel="queries served", ylabel=f"tau (chunks of {size} queries)", title="tau over the stream")
    ax2.set(xlabel="query at window close", ylabel="tau per adaptation window", title="windows (x: rollback)")
    ax3.axhline(1.1, color="grey", ls="--", lw=1)
    ax3.set(xlabel="queries served", ylabel="tau / static tau (same queries)", title="against the static drafter")
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--domain", default="auto", help=f"one of {', '.join(DOMAINS)}, or auto (worst static tau)")
    ap.add_argument("--scan", type=int, default=6, help="prompts per domain for --domain auto")
    ap.add_argument("--prompts", type=int, default=80)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--lam", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lr-heads", type=float, default=AdaptSettings.lr_heads, help="1e-3 before stop 53")
    ap.add_argument("--lr-full", type=float, default=AdaptSettings.lr_full, help="2e-4 before stop 53")
    ap.add_argument("--chunk", type=int, default=5)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", default=None, help="a model name or directory (default: the lab model)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--budget", type=int, default=None,
                    help="draft nodes per tree (default: the drafter's measured serving.json; 24 before stop 53)")
    ap.add_argument("--out", type=Path, default=Path("experiments/results/adapt_shift"))
    args = ap.parse_args(argv)
    names = args.configs.split(",")
    if "static" not in names or any(n not in CONFIGS for n in names):
        ap.error(f"--configs must include static; choose from {', '.join(CONFIGS)}")
    quiet_transformers()
    target, tok, eos = load(args.target, args.dtype)
    scanned = scan(target, tok, eos, args.scan, args.max_new_tokens, args.budget) if args.domain == "auto" else None
    domain = min(scanned, key=scanned.get) if scanned else args.domain
    prompts = load_prompts(domain, args.prompts)
    encoded = [encode_prompt(tok, p) for p in prompts]  # a chat model's template, as the bench does
    print(f"domain {domain}: {len(encoded)} prompts x {args.max_new_tokens} new tokens", file=sys.stderr, flush=True)
    runs = {n: serve(n, CONFIGS[n], target, eos, encoded, args) for n in names}
    result = {
        "command": "python experiments/adapt_shift.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "domain": domain, "domain_scan_tau": scanned, "prompts": len(encoded),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "adapt_defaults": AdaptSettings().__dict__,
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "loadavg": os.getloadavg()},
        "analysis": analyse(runs, args.chunk),
        "runs": {n: {k: v for k, v in r.items() if k != "queries"} | {"queries": [
            {k: v for k, v in q.items() if k != "token_ids"} for q in r["queries"]]} for n, r in runs.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=list))
    plot(runs, args.chunk, args.out.with_suffix(".png"))
    print(json.dumps(result["analysis"], indent=1), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
