"""``python -m specblock.runtime bench``: methods x domains, same target, prompts and run.

Every method decodes every prompt once per run, in an order that rotates between runs, and plain
decoding (``ar``) is always among them, so each Spd divides by AR measured minutes apart on the
same machine. Per (method, domain) we report medians over runs of Spd (tokens/s ratio to AR in
that run), tokens/s, tau and T_D%, plus the match rate against AR's tokens. bf16 serving can
differ from plain decoding at near-ties (the shapes of the computation differ); every such
divergence is reported with the target's top-2 logit gap at the diverging position.

``specblock+adapt`` wraps the SpecBlock drafter in ``runtime/adapt.py``'s Adapter. It adapts
over the prompts of one run and starts every run from the pretrained weights (serving a prompt it
has already trained on would flatter it). An update still in flight when its query ends is
waited for, and the wait is charged to that query, so no other method's timing shares the CPU
with it. ``specblock+adapt+lookup`` adds prompt lookup's branch on top of the adapting drafter.

External peers (``runtime/peers.py``): ``hf-greedy``, ``hf-assisted`` and ``hf-lookup`` run
HuggingFace's own ``generate`` plain, with an assistant model or with prompt lookup on the same target, interleaved and timed
like the others; their tau, T_D% and tree sizes are not observable and are reported as null. A
peer that cannot run (no SpS draft model) is skipped with a note in the output.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import numpy as np
import torch
from tqdm import tqdm

from specblock.atomic import AtomicFiles, check_output
from specblock.cpu import cpu_kind
from specblock.errors import SpecBlockError
from specblock.flags import OneLineParser
from specblock.models.registry import DEFAULT_TARGET_NAME
from specblock.prompts import SPLITS, TUNE_PROMPTS
from specblock.runtime import chat, drafters, peers
from specblock.runtime.bench_config import check_bench_flags, method_options
from specblock.runtime.config import RunConfig, validate
from specblock.runtime.drafters import lookup_branch
from specblock.runtime.drafters.datastore import open_datastore
from specblock.runtime.engine import Engine
from specblock.runtime.metrics import DecodeStats
from specblock.runtime.target import DTYPE_CHOICES, DTYPE_HELP, TargetModel, read_generation_eos, resolve_dtype
from specblock.runtime.verify import GreedyVerifier


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="python -m specblock.runtime bench", description=__doc__.splitlines()[0])
    ap.add_argument("--target", help="a model name (see `models`) or an HF model directory (default: the real chat model)")
    ap.add_argument("--methods", default="ar,lookup,specblock", help="comma-separated; NAME@VARIANT for a second setting; specblock+adapt: serving-time adaptation (restarts from the pretrained drafter every run; specblock+adapt+lookup with the branch); hf-greedy, hf-assisted, hf-lookup: HF generate peers")
    ap.add_argument("--domains", default="code,math,chat,qa,mtbench")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per domain (the first N of each set)")
    ap.add_argument("--split", default="eval", choices=SPLITS,
                    help=f"eval: each set's first N; tune: the first N of its last {TUNE_PROMPTS}, which `tune` chooses "
                    "settings on")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    ap.add_argument("--budget", type=int, help="node budget of every tree method (default: each drafter's "
                    "serving.json, else 24); --set METHOD:budget=N for one method")
    ap.add_argument("--drafter-dir", type=Path, help="directory of trained drafters (default: the shipped assets)")
    ap.add_argument("--set", action="append", default=[], metavar="METHOD:KEY=VALUE",
                    help="per-method option, e.g. specblock:M=3, specblock:drafter=DIR, eagle3:budget=16 (engine node "
                    "budget); your own classes: specblock:policy=pkg.mod:Class, specblock:policy_kwargs=JSON, "
                    "seed_policy, adapt_policy, rollback_policy likewise (loading a class runs its code)")
    ap.add_argument("--trace-dir", type=Path, help="write per-iteration JSONL traces per method and domain (run 1)")
    ap.add_argument("--out", type=Path, default=Path("experiments/results/bench"))
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    ap.add_argument("--compile", action="store_true", help="static-shape target compiled per tree-size bucket")
    ap.add_argument("--compile-mode", default="whole", choices=["regions", "whole"],
                    help="--compile: one layer step shared by all layers, or the whole forward")
    return ap


@dataclass
class Cell:
    """One (method, domain): per-run aggregates and per-prompt tokens from run 1."""

    runs: list[DecodeStats] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)


ADAPT = "+adapt"  # "specblock+adapt": the SpecBlock drafter wrapped in runtime/adapt.py's Adapter
# "eagle3+lookup": prompt lookup's chain grafted onto the drafter's tree (drafters/lookup_branch.py)
LOOKUP = lookup_branch.SUFFIX


def _base(method: str) -> str:
    return method.split("@")[0].removesuffix(LOOKUP).removesuffix(ADAPT)


def _options(method: str, args) -> dict:
    base = RunConfig(method=_base(method)).drafter_options()
    if args.drafter_dir is not None:
        base["drafter"] = args.drafter_dir / _base(method)
    checked = getattr(args, "method_options", None)  # main() checks every --set item before the bench
    base.update((checked if checked is not None else method_options(args.set, [method])).get(method, {}))
    return base


def divergence(target: TargetModel, prompt: list[int], ar: list[int], other: list[int]) -> dict | None:
    """First position where ``other`` leaves ``ar``, with the target's top-2 gap there."""
    n = min(len(ar), len(other))
    diff = next((i for i in range(n) if ar[i] != other[i]), None)
    if diff is None:
        return None if len(ar) == len(other) else {"position": n, "gap": None}
    with torch.no_grad():
        logits = target.model(torch.tensor([prompt + ar[:diff]], device=target.device)).logits[0, -1].float()
    top = logits.topk(2).values
    return {"position": diff, "gap": round(float(top[0] - top[1]), 5)}


class Targets:
    """The eager target, and the compiled one built on first demand from the same model (weights
    shared): ``--compile`` puts every method on it, ``--set METHOD:compiled=true`` one method, so
    compiled and eager decoding can be timed interleaved in one run."""

    def __init__(self, eager: TargetModel, mode: str) -> None:
        self.eager, self.mode, self._compiled = eager, mode, None

    def compiled(self) -> TargetModel:
        if self._compiled is None:
            from specblock.runtime.cli import maybe_compile

            self._compiled = maybe_compile(self.eager, True, self.mode)
        return self._compiled


def build_engine(m: str, targets: Targets, args, eos: frozenset[int]) -> Engine:
    """The engine of bench method ``m`` (``METHOD[+lookup|+adapt][@label]`` with its ``--set`` items),
    as the bench runs it; ``experiments/drafter_cost.py`` builds its rows the same way, so the two
    never disagree on what a method name means."""
    opts = _options(m, args)
    # --compile: every method on the compiled target; --set METHOD:compiled=true: this one (HF peers
    # never: check_bench_flags refuses it, and they run HF's own loop on the eager target's model)
    compiled = bool(opts.pop("compiled", None) or args.compile)
    target = targets.compiled() if compiled else targets.eager
    drafter_compiled = opts.pop("drafter_compiled", None)  # --set's, over the drafter's serving.json
    int8 = opts.pop("drafter_int8", None)  # None: drafters.wants_int8 decides
    # "budget" is the engine's node budget: --set METHOD:budget, then --budget, then the drafter's
    # serving.json (its measured best), then the default
    if args.budget is not None and opts.get("budget") is None:  # RunConfig's options carry budget=None
        opts["budget"] = args.budget
    given = opts.get("budget") is not None  # the whole tree's, lookup's branch included
    nodes = opts.pop("lookup_nodes", None)  # check_bench_flags refused both on other methods
    on_top = bool(opts.pop("lookup_on_top", None))
    store_spec = opts.pop("lookup_datastore", None)
    opts = drafters.serving_settings(_base(m), target, opts)
    budget = int(opts.pop("budget", drafters.DEFAULT_BUDGET))
    warm = drafters.warm_sizes(opts)
    saved_compiled = drafters.drafter_compiled(opts, compiled)
    drafter_compiled = saved_compiled if drafter_compiled is None else drafter_compiled
    drafter = drafters.build(_base(m), target, opts, int8=int8)
    if drafter_compiled and ADAPT not in m:
        from specblock.runtime.cli import maybe_compile_drafter

        drafter = maybe_compile_drafter(drafter, target)
    if ADAPT in m:  # inside the branch (specblock+adapt+lookup): it adapts the drafter, lookup grafts on its trees
        from specblock.runtime.adapt import AdaptSettings, Adapter

        if _base(m) != "specblock":
            raise SpecBlockError(f"{m}: adaptation adapts the SpecBlock drafter; use specblock{ADAPT}")
        window = int(opts.get("adapt_window", RunConfig.model_fields["adapt_window"].default))
        user = {k: opts.get(o) for k, o in (("bandit_class", "adapt_policy"), ("bandit_kwargs", "adapt_policy_kwargs"),
                                             ("rollback_class", "rollback_policy"),
                                             ("rollback_kwargs", "rollback_policy_kwargs")) if opts.get(o)}
        chosen = {k: v for k in ("amp", "lr_heads", "lr_full") if (v := opts.get(f"adapt_{k}")) is not None}
        drafter = Adapter(drafter, AdaptSettings(window=window, **chosen, **user))  # the rest: AdaptSettings' defaults
    if lookup_branch.has_lookup(m):
        store = open_datastore(store_spec, args.target, targets.eager.vocab_size) if store_spec else None
        drafter, budget = lookup_branch.with_branch(drafter, budget, nodes or lookup_branch.DEFAULT_NODES, given, on_top,
                                                    store)
    return Engine(target, drafter, GreedyVerifier(), budget, eos, warm_sizes=warm)


def adapter_of(engine: Engine):
    """A ``+adapt`` method's Adapter: the engine's drafter, or the one inside its lookup branch."""
    return engine.drafter.inner if isinstance(engine.drafter, lookup_branch.LookupBranch) else engine.drafter


def run_bench(args, traces: AtomicFiles | None = None) -> dict:
    """``traces``: where run 1's per-iteration traces go (``--trace-dir``), committed by the caller."""
    from specblock.prompts import load_prompts
    from specblock.runtime.cli import load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = validate({"target": args.target, "dtype": args.dtype})
    path = cfg.target_dir
    args.dtype = resolve_dtype(args.dtype, "auto", path)  # the results' config records what ran, never "auto"
    args.target = args.target or DEFAULT_TARGET_NAME  # likewise the target: a blank one meant the lab model once
    targets = Targets(TargetModel.load(path, args.dtype, "auto"), args.compile_mode)
    target = targets.eager  # prompts' context check and divergences: the same model either way
    tok = load_tokenizer(path, False)
    eos = chat.stop_ids(tok, read_generation_eos(path))
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if "ar" not in methods:
        methods.insert(0, "ar")
    # "name@variant" runs method "name" with the options given for "name@variant" (e.g.
    # --methods specblock,specblock@m1 --set specblock@m1:M=1): two settings in one run.
    engines, skipped = {}, {}
    other_models: dict[str, TargetModel] = {}  # a peer's own dtype (--set hf-greedy@bf16:dtype=bfloat16), loaded once
    for m in methods:
        if peers.is_peer(m):
            opt = _options(m, args)
            own = resolve_dtype(opt["dtype"], "auto") if opt.get("dtype") else args.dtype  # args.dtype: resolved above
            if own != args.dtype and own not in other_models:
                other_models[own] = TargetModel.load(path, own, "auto")
            peer_target = other_models.get(own, target)
            try:
                engines[m] = peers.build(m, peer_target, opt, eos)
            except peers.PeerUnavailable as e:
                skipped[m] = str(e)
        else:
            engines[m] = build_engine(m, targets, args, eos)
    methods = [m for m in methods if m in engines]
    domains = [d.strip() for d in args.domains.split(",") if d.strip()]
    # A chat model gets each prompt as one user turn through its template (code framed by
    # data.code_instruction); the lab model its plain-text format. Same ids for every method.
    prompts = {d: [chat.encode_prompt(tok, p) for p in load_prompts(d, args.prompts, args.split)] for d in domains}
    for d, ps in prompts.items():
        for ids in ps:
            if len(ids) + args.max_new_tokens > target.max_context:
                raise SpecBlockError(f"a {d} prompt has {len(ids)} tokens: too long for {args.max_new_tokens} new ones")
    for m, eng in engines.items():  # untimed warm-up
        if isinstance(eng, Engine):  # compiled graphs of every shape it can meet, so no run times a compile
            eng.warm_compiled()
        eng.generate(prompts[domains[0]][0][-16:], 8)
        if ADAPT in m:
            adapter_of(eng).clear()  # the warm-up is no query to learn from

    cells = {(m, d): Cell() for m in methods for d in domains}
    total = args.runs * sum(len(p) for p in prompts.values()) * len(methods)
    bar = tqdm(total=total, desc="bench", dynamic_ncols=True)
    for r in range(args.runs):
        if r > 0:  # an adapting drafter starts every run from its pretrained weights: runs 2+ must
            for m in methods:  # not serve prompts it has already trained on
                if ADAPT in m:
                    adapter_of(engines[m]).close()
                    engines[m] = build_engine(m, targets, args, eos)
        order = methods[r % len(methods):] + methods[: r % len(methods)]  # rotate who goes first
        per_run = {k: DecodeStats() for k in cells}
        for d in domains:
            for i, ids in enumerate(prompts[d]):
                for m in order:
                    eng = engines[m]
                    trace = traces.get(f"{m}.{d}.jsonl") if traces is not None and r == 0 else None
                    eng.trace, eng.trace_domain = trace, d
                    res = eng.generate(ids, args.max_new_tokens)
                    if ADAPT in m:  # an update still running would share the CPU with the next method:
                        t0 = time.perf_counter()  # let it land, and charge the wait to this query
                        adapter_of(eng).wait()
                        waited = time.perf_counter() - t0
                        res.stats.wall_s += waited
                        res.stats.loop_s += waited
                    eng.trace = None
                    per_run[m, d] = per_run[m, d].merge(res.stats)
                    if r == 0:
                        cells[m, d].tokens.append(res.token_ids)
                    bar.update(1)
        for k, st in per_run.items():
            cells[k].runs.append(st)
    bar.close()
    adapt = {}
    for m in methods:
        if ADAPT in m:  # what the last run's adapter did (each run starts from theta_0)
            adapt[m] = adapter_of(engines[m]).summary()
            adapter_of(engines[m]).close()
    return {**summarize(cells, methods, domains, prompts, target, args), "skipped": skipped, "adapt": adapt}


def summarize(cells, methods, domains, prompts, target, args) -> dict:
    rows = []
    for m in methods:
        for d in domains:
            c, ar = cells[m, d], cells["ar", d]
            spd = [s.tokens_per_s / a.tokens_per_s for s, a in zip(c.runs, ar.runs)]
            # The decode loop alone (prefill excluded), the simulator's Spd: what sim_fidelity holds
            # the sim against. Same runs and medians as Spd; null for peers (no loop timing).
            dec = [(s.new_tokens / s.loop_s) / (a.new_tokens / a.loop_s)
                   for s, a in zip(c.runs, ar.runs) if s.loop_s > 0 and a.loop_s > 0]
            divs = [dv for ids, a, o in zip(prompts[d], ar.tokens, c.tokens) if (dv := divergence(target, ids, a, o))]
            seen = not peers.is_peer(m)  # HF's generate does not report acceptance or draft time
            rows.append({
                "method": m, "domain": d,
                "speedup": round(statistics.median(spd), 4),
                "speedup_decode": round(statistics.median(dec), 4) if dec and seen else None,
                # every run's decode Spd: the measurement's own spread (sim_fidelity shows it)
                "speedup_decode_runs": [round(x, 4) for x in dec] if dec and seen else None,
                "prefill_ms": round(1e3 * statistics.median(s.prefill_s for s in c.runs) / len(prompts[d]), 2) if seen else None,
                "tokens_per_s": round(statistics.median(s.tokens_per_s for s in c.runs), 3),
                "tau": round(statistics.median(s.tau for s in c.runs), 4) if seen else None,
                "draft_share": round(statistics.median(s.draft_share for s in c.runs), 4) if seen else None,
                "mean_tree_size": round(float(np.mean(c.runs[0].tree_size)), 2) if seen else None,
                "per_depth_acceptance": [round(x, 4) for x in c.runs[0].per_depth_acceptance()] if seen else None,
                "match_rate": round(1 - len(divs) / len(c.tokens), 4),
                "divergences": divs,
                "new_tokens": c.runs[0].new_tokens,
            })
    return {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "device": str(target.device), "cpu": cpu_kind(), "threads": torch.get_num_threads(), "rows": rows}


RESULT_SUFFIXES = (".json", ".csv", ".md", ".png")


def output_files(out: Path) -> list[Path]:
    """``--out`` is a stem whose own dots are kept: replacing its suffix made ``bench_v1.5`` and
    ``bench_v1.6`` write the same files. A result suffix (``bench.json``) is dropped."""
    stem = out.with_suffix("") if out.suffix in RESULT_SUFFIXES else out
    return [stem.with_name(stem.name + sfx) for sfx in RESULT_SUFFIXES]


def check_outputs(args) -> None:
    """Before the bench runs: a place it cannot write would lose every measurement at the end."""
    for f in output_files(args.out):
        check_output(f, "--out", make_parents=True)
    if args.trace_dir is not None:
        check_output(args.trace_dir / "probe.jsonl", "--trace-dir", make_parents=True)


def write_outputs(result: dict, out: Path) -> list[Path]:
    """All four files replace their old versions together, or none does (Ctrl-C, a full disk)."""
    rows = result["rows"]
    files = output_files(out)
    files[0].parent.mkdir(parents=True, exist_ok=True)
    with AtomicFiles(files[0].parent) as group:
        group.get(files[0].name).write(json.dumps(result, indent=1))
        w = csv.DictWriter(group.get(files[1].name, newline=""),
                           fieldnames=[k for k in rows[0] if k not in ("divergences", "per_depth_acceptance",
                                                                      "speedup_decode_runs")])
        w.writeheader()
        for r in rows:
            w.writerow({k: v for k, v in r.items() if k in w.fieldnames})
        group.get(files[2].name).write(markdown_table(rows) + "".join(f"\nNote: {why}\n" for why in result.get("skipped", {}).values()))
        plot(rows, group.get(files[3].name, "wb"))
    return files


def markdown_table(rows: list[dict]) -> str:
    """The paper's layout: "Spd / tau" per domain, the mean, and T_D% ("-" where not observable)."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    domains = list(dict.fromkeys(r["domain"] for r in rows))
    get = {(r["method"], r["domain"]): r for r in rows}
    lines = ["| method | " + " | ".join(domains) + " | Mean | T_D% | match |",
             "|---" * (len(domains) + 4) + "|"]
    fmt = lambda x, f: "-" if x is None else format(x, f)
    mean = lambda xs: None if any(x is None for x in xs) else float(np.mean(xs))
    for m in methods:
        cells = [f"{get[m, d]['speedup']:.2f}x / {fmt(get[m, d]['tau'], '.2f')}" for d in domains]
        spd = np.mean([get[m, d]["speedup"] for d in domains])
        tau = mean([get[m, d]["tau"] for d in domains])
        td = mean([get[m, d]["draft_share"] for d in domains])
        match = np.mean([get[m, d]["match_rate"] for d in domains])
        td_s = "-" if td is None else f"{100 * td:.0f}%"
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {spd:.2f}x / {fmt(tau, '.2f')} | {td_s} | {100 * match:.0f}% |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path | IO[bytes]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(r["method"] for r in rows))
    domains = list(dict.fromkeys(r["domain"] for r in rows))
    get = {(r["method"], r["domain"]): r["speedup"] for r in rows}
    ncols = min(4, len(methods))
    legend_rows = -(-len(methods) // ncols)
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(domains), 3.6 + 0.22 * legend_rows))
    w = 0.8 / len(methods)
    for i, m in enumerate(methods):
        xs = np.arange(len(domains)) + (i - (len(methods) - 1) / 2) * w
        ax.bar(xs, [get[m, d] for d in domains], w, label=m)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(np.arange(len(domains)), domains)
    ax.set_ylabel("speedup over AR (median)")
    # Above the axes, not inside: inside, a table of many methods covered the bars that matter (those above 1.0x).
    ax.legend(fontsize=8, ncols=ncols, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png", bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    args.method_options = check_bench_flags(args)  # one line naming the flag, before anything loads
    if args.runs < 1 or args.prompts < 1 or args.max_new_tokens < 1:
        raise SpecBlockError("--runs, --prompts and --max-new-tokens must be at least 1")
    check_outputs(args)
    with AtomicFiles(args.trace_dir) as traces:
        result = run_bench(args, traces)
        files = write_outputs(result, args.out)
    print(markdown_table(result["rows"]), end="")
    for why in result.get("skipped", {}).values():
        print(f"note: {why}")
    print("wrote " + ", ".join(str(f) for f in files))
    return 0
