"""``python -m specblock.runtime tune``: measure ``--method auto``'s candidates on this machine and keep the fastest.

The shipped records (``best.json`` beside a model's drafters) were measured on a few CPUs, with
overrides per kind of CPU where one was measured (``specblock.cpu.CPU_KINDS``). On another CPU the
winner can differ: on a Zen 5 the Xeon's compiled choice ran at 0.94x compiled plain decoding. So
``tune`` runs the candidates as ``bench`` does (interleaved runs, medians, Spd against plain decoding
in the same run), drops any whose output differs from plain decoding on a prompt, and writes the
fastest to ``$SPECBLOCK_HOME/tuned/MODEL/best.json`` for this CPU (its kind and model name), dtype
and mode. ``--method auto`` reads it before the shipped record. Its bench
files lie beside it. Each candidate keeps its drafter's measured serving settings (``serving.json``).
It measures on the prompt sets' tune split (each set's last 8, ``prompts.TUNE_PROMPTS``), not on the
prompts the bench's tables report, so a choice it makes is not fitted to the figures it is judged by;
``--split eval`` measures on the bench's own, as the shipped records were chosen (from main tables).

``--budgets 1,2,3`` also tries each tree drafter at those node budgets (the lookup branch on top, as
with a measured budget): the winner's budget goes to ``$SPECBLOCK_HOME/tuned/MODEL/DRAFTER/serving.json``
for this CPU, dtype and mode, which the shipped drafter's settings read last (``serving_settings``).
On a Zen 5 EAGLE-3's best budget was 1 and on the AMX Xeon its worst, so a budget is a machine's too.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from specblock.atomic import write_atomic
from specblock.cpu import cpu_kind, cpu_model
from specblock.errors import SpecBlockError
from specblock.flags import OneLineParser
from specblock.models.registry import DEFAULT_TARGET_NAME, tuned_record
from specblock.prompts import SPLITS, TUNE_PROMPTS
from specblock.runtime import bench
from specblock.runtime.bench_config import check_bench_flags
from specblock.runtime.config import validate
from specblock.runtime.drafters import METHODS, TRAINED
from specblock.runtime.drafters.lookup_branch import SUFFIX as LOOKUP
from specblock.runtime.target import DTYPE_CHOICES, DTYPE_HELP

#: The candidates: every method that has won a main table somewhere (plain decoding included).
CANDIDATES = "ar,lookup,eagle3,eagle3+lookup,specblock,specblock+lookup"


def fastest(result: dict, compiled: bool = False) -> tuple[str, dict[str, float]]:
    """The method with the highest mean Spd over a bench's domains, among those the CLI runs by name
    (``METHOD+lookup`` too: ``--method auto`` runs it with ``--lookup-branch``; no ``@`` variants, no
    HF peers) and identical to plain decoding on every prompt; ``compiled``: among the ``METHOD@c``
    rows, named without it. Also each candidate's mean. (``best_method.py``'s rule for a main table.)"""
    names: dict[str, tuple[str, int | None]] = {}
    for r in result["rows"]:
        name = r["method"]
        method = (name.removesuffix("@c") if name.endswith("@c") else None) if compiled else name
        if method is not None and method.removesuffix(LOOKUP) in METHODS:
            names[name] = (method, None)
    means = {names[n][0]: v for n, v in means_of(result, names).items()}
    return max(means, key=means.get), means


def build_parser() -> OneLineParser:
    ap = OneLineParser(prog="python -m specblock.runtime tune", description=__doc__.splitlines()[0])
    ap.add_argument("--target", help="a model name (see `models`) or an HF model directory (default: the real chat model)")
    ap.add_argument("--methods", default=CANDIDATES, help=f"comma-separated candidates (default: {CANDIDATES})")
    ap.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    ap.add_argument("--compile", action="store_true", help="tune --method auto --compile: each candidate on the compiled target")
    ap.add_argument("--prompts", type=int, default=2,
                    help=f"prompts per domain (the split's first N, at most {TUNE_PROMPTS} for tune's)")
    ap.add_argument("--split", default="tune", choices=SPLITS,
                    help=f"tune (default): each set's last {TUNE_PROMPTS} prompts, which the bench's tables do not "
                    "report; eval: the bench's own first N, as the shipped records were chosen")
    ap.add_argument("--runs", type=int, default=3, help="interleaved runs (medians)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--domains", default="code,math,chat,qa,mtbench")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    ap.add_argument("--budgets", help="also tune the tree drafters' node budget over these, e.g. 1,2,3,4")
    return ap


def parse_budgets(text: str | None) -> list[int]:
    if not text:
        return []
    try:
        budgets = sorted({int(b) for b in text.split(",") if b.strip()})
    except ValueError:
        budgets = []
    if not budgets or not all(1 <= b <= 256 for b in budgets):
        raise SpecBlockError(f"--budgets {text!r}: give node budgets from 1 to 256, e.g. --budgets 1,2,3,4")
    return budgets


def candidates(args) -> dict[str, tuple[str, int | None]]:
    """The bench's row names, plain decoding's among them: each ``(method, budget)``, budget None at the
    drafter's own setting.
    Compiled rows are ``METHOD@c`` (``METHOD@cN`` at budget N), eager ones ``METHOD`` (``METHOD@bN``)."""
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods:
        raise SpecBlockError("--methods names no method; e.g. --methods ar,lookup,eagle3+lookup")
    methods = list(dict.fromkeys(["ar"] + methods))  # plain decoding is always a candidate: it can win
    budgets = parse_budgets(args.budgets)
    out: dict[str, tuple[str, int | None]] = {}
    for m in methods:
        tree = m.removesuffix(LOOKUP) in TRAINED
        for b in (budgets if budgets and tree else [None]):
            tag = ("c" if args.compile else "") + (f"{'' if args.compile else 'b'}{b}" if b else "")
            out[f"{m}@{tag}" if tag else m] = (m, b)
    return out


def bench_args(args, names: dict[str, tuple[str, int | None]], out: Path):
    """The bench's own arguments for these candidates (``candidates``): compiled ones beside eager plain
    decoding (every Spd against it, as the shipped records are)."""
    argv = ["--target", str(args.target or DEFAULT_TARGET_NAME), "--dtype", args.dtype, "--domains", args.domains,
            "--prompts", str(args.prompts), "--split", args.split, "--runs", str(args.runs),
            "--max-new-tokens", str(args.max_new_tokens),
            "--threads", str(args.threads), "--out", str(out)]
    for name, (m, budget) in names.items():
        sets = ["compiled=true"] * args.compile
        if budget is not None:
            sets += [f"budget={budget}"] + ["lookup_on_top=true"] * m.endswith(LOOKUP)
        argv += [a for kv in sets for a in ("--set", f"{name}:{kv}")]
    rows = (["ar"] if args.compile else []) + list(names)
    b = bench.build_parser().parse_args(argv + ["--methods", ",".join(rows)])
    b.method_options = check_bench_flags(b)
    return b


def means_of(result: dict, names: dict[str, tuple[str, int | None]]) -> dict[str, float]:
    """Mean Spd over the domains of each candidate row identical to plain decoding on every prompt."""
    spd: dict[str, list[float]] = defaultdict(list)
    inexact: set[str] = set()
    for r in result["rows"]:
        if r["method"] in names:
            spd[r["method"]].append(r["speedup"])
            if r.get("match_rate", 1.0) < 1.0:
                inexact.add(r["method"])
    means = {n: float(np.mean(v)) for n, v in spd.items() if n not in inexact}
    if not means:
        raise SpecBlockError("no candidate was identical to plain decoding on every prompt")
    return means


def record(f: Path, override: dict) -> dict:
    """``override`` into the tuned record ``f`` (a best-method or a serving one), replacing one for the
    same CPU, dtype and mode."""
    keys = ("cpu", "cpu_model", "dtype", "compiled")
    try:
        old = json.loads(f.read_text())["overrides"] if f.is_file() else []
        kept = [o for o in old if any(o.get(k) != override[k] for k in keys)]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise SpecBlockError(f"{f} is not a valid tuned record; delete it and tune again") from None
    rec = {"overrides": kept + [override]}
    f.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(f, json.dumps(rec, indent=1) + "\n")
    return rec


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.runs < 1 or args.prompts < 1 or args.max_new_tokens < 1:
        raise SpecBlockError("--runs, --prompts and --max-new-tokens must be at least 1")
    validate({"target": args.target, "dtype": args.dtype}).target_dir  # an unknown path: its one line first
    f = tuned_record(args.target)
    if f is None:
        raise SpecBlockError(f"--target {args.target}: tune records for a named model or a copy of one; "
                             "see `python -m specblock.runtime models`")
    mode = "compiled" if args.compile else "eager"
    names = candidates(args)
    b = bench_args(args, names, f.parent / f"bench_{args.dtype}_{mode}")
    bench.check_outputs(b)
    result = bench.run_bench(b)  # resolves b.dtype ("auto" to what ran)
    b.out = f.parent / f"bench_{b.dtype}_{mode}"
    files = bench.write_outputs(result, b.out)
    means = means_of(result, names)
    win = max(means, key=means.get)
    best, budget = names[win]
    here = {"cpu": cpu_kind(), "cpu_model": cpu_model(), "dtype": b.dtype, "compiled": args.compile}
    measured = f"{files[2]} ({args.split} prompts): the highest mean Spd of " + ", ".join(
        f"{n} {v:.2f}x" for n, v in sorted(means.items(), key=lambda kv: -kv[1]))
    print(bench.markdown_table(result["rows"]), end="")
    if budget is not None:  # first the winner's budget, then the record that points at it
        drafter = best.removesuffix(LOOKUP)
        g = f.parent / drafter / "serving.json"
        record(g, {**here, "budget": budget, "measured": measured})
        print(f"{drafter} now serves at node budget {budget} here; recorded in {g}")
    record(f, {**here, "method": best, "mean_speedup": round(means[win], 3), "measured": measured})
    print(f"--method auto{' --compile' if args.compile else ''} --dtype {b.dtype} now runs {best} on this machine "
          f"({cpu_model()}, {cpu_kind()}): mean Spd {means[win]:.2f}x; recorded in {f}")
    return 0
