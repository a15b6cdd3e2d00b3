"""``python -m specblock.runtime``: decode live, optionally against plain decoding.

Every user error ends as one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from specblock import gcstart
from specblock.atomic import atomic_open, check_output
from specblock.errors import SpecBlockError
from specblock.runtime import chat, drafters
from specblock.runtime.config import RunConfig, read_prompt_file, validate
from specblock.runtime.engine import Engine, GenerationResult
from specblock.runtime.metrics import DecodeStats, speedup
from specblock.runtime.target import DTYPE_CHOICES, DTYPE_HELP, TargetModel, read_generation_eos, resolve_dtype
from specblock.runtime.verify import GreedyVerifier, SamplingVerifier

#: What ``make run`` asks when no prompt is given: a chat question for a chat model, code otherwise.
DEMO_CHAT = "Write a Python function that returns the n-th Fibonacci number, with a short docstring."
DEMO_PROMPT = "def fibonacci(n):\n    "

def _bench(argv: list[str]) -> int:
    from specblock.runtime.bench import main as bench_main

    return bench_main(argv)


def _calibrate(argv: list[str]) -> int:
    from specblock.runtime.calibrate import main as calibrate_main

    return calibrate_main(argv)


def _tune(argv: list[str]) -> int:
    from specblock.runtime.tune import main as tune_main

    return tune_main(argv)


def _models(argv: list[str]) -> int:
    from specblock.models.cli import main as models_main

    return models_main(argv)


#: Subcommands: name -> main(argv) -> exit status (imported lazily: decoding needs none of them).
SUBCOMMANDS: dict[str, Callable[[list[str]], int]] = {"bench": _bench, "calibrate": _calibrate, "models": _models,
                                                      "tune": _tune}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, status 2, no usage dump
        print(f"error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m specblock.runtime", description="Lossless speculative decoding with an HF causal LM.")
    p.add_argument("--target", help="a model name (see `models`: smollm2-135m-instruct, the default, built on first "
                   "use; lab, the small model) or an HF model directory")
    p.add_argument("--method", default="auto",
                   help=f"drafting method: {', '.join(sorted(drafters.METHODS))}, or auto (the fastest measured for "
                   "the target, dtype and this CPU: `tune`'s record, else the shipped best.json)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", type=Path, help="JSONL with a 'prompt' or OpenAI-style 'messages' per line")
    p.add_argument("--system", help="system message before the prompt (models with a chat template)")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the model's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_out", action="store_true", help="print JSON objects instead of text")
    p.add_argument("--compare", choices=["ar"], help="also decode with plain decoding; report speedup and identity")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument("--budget", type=int, help="draft nodes per tree, root excluded (default: the drafter's measured "
                   "best, from serving.json beside it; else 24)")
    p.add_argument("--trace", type=Path, help="write a per-iteration JSONL trace here")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the model directory's own Python code")
    p.add_argument("--ngram", type=int, default=3, help="lookup: longest n-gram to match")
    p.add_argument("--min-ngram", type=int, default=1,
                   help="lookup: shortest n-gram to match (higher: fewer, surer drafts, for targets whose tree rows cost)")
    p.add_argument("--lookup-depth", type=int, default=8, help="lookup: tokens proposed per match")
    p.add_argument("--branches", type=int, default=1, help="lookup: distinct continuations merged into a tree")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the untimed warm-up decode")
    p.add_argument("--compile", action="store_true",
                   help="static-shape target compiled per tree-size bucket, and SpecBlock's block forward (specblock/compiled; "
                   "first use compiles)")
    p.add_argument("--compile-mode", default="whole", choices=["regions", "whole"],
                   help="--compile: the whole forward per bucket (fastest per token), or one layer step shared by all "
                   "layers (regions: several times faster to compile)")
    p.add_argument("--drafter", type=Path, help="trained drafter directory (default: the shipped one for --method)")
    p.add_argument("--M", type=int, help="specblock: block iterations per step (default: serving.json, else 2)")
    p.add_argument("--max-seeds", type=int, help="specblock: seeds that start each later block (default 2)")
    p.add_argument("--widths", type=_widths, help="specblock: siblings per bucket b0,b1,b2,b3 (default 2,4,10,0)")
    p.add_argument("--lookup-branch", type=int, metavar="N",
                   help="graft prompt lookup's chain of up to N tokens onto the drafter's tree; the node budget grows "
                        "by N on top of the drafter's measured one unless --budget is given (drafters/lookup_branch.py)")
    p.add_argument("--lookup-on-top", action="store_true",
                   help="with --lookup-branch and --budget: the budget stays the drafter's own and the chain comes on top, "
                        "instead of the whole tree's and shared (its measured budget always stays its own)")
    p.add_argument("--lookup-datastore", metavar="shipped|PATH",
                   help="with --lookup-branch: where the prompt has no match, the branch's chain is what the target "
                        "wrote after the same n-gram in its own answers to training instructions ('shipped': the "
                        "target's own store; drafters/datastore.py)")
    p.add_argument("--eager-drafter", action="store_true",
                   help="keep the drafter's step eager where its serving.json names drafter_compiled (measured faster "
                        "compiled on this kind of CPU; the first use compiles) or --compile would compile it")
    p.add_argument("--adapt", action="store_true", help="specblock: adapt the drafter while serving (runtime/adapt.py)")
    p.add_argument("--adapt-window", type=int, default=128, help="adapt: decoding iterations per window")
    p.add_argument("--adapt-lambda", type=float, default=0.1, help="adapt: weight of the KL anchor to the pretrained drafter")
    p.add_argument("--adapt-arms", type=lambda t: tuple(a.strip() for a in t.split(",")), default=("skip", "heads", "full"),
                   help="adapt: arms the bandit picks from, e.g. skip,heads,full (one arm: always that one)")
    field = RunConfig.model_fields  # one set of defaults (tests/test_adapt.py checks AdaptSettings' agree)
    p.add_argument("--adapt-lr-heads", type=float, default=field["adapt_lr_heads"].default,
                   help="adapt: Adam's learning rate in a heads update")
    p.add_argument("--adapt-lr-full", type=float, default=field["adapt_lr_full"].default,
                   help="adapt: Adam's learning rate in a full update")
    p.add_argument("--adapt-amp", choices=["auto", "bf16", "off"], default=field["adapt_amp"].default,
                   help="adapt: bf16 autocast of each update (auto: where bf16 products are native, e.g. AMX; "
                        "about half an update's time there)")
    user = p.add_argument_group(
        "your own policies", "CLASS is package.module:Class (importable from here) or path/to/file.py:Class; "
        "KWARGS a JSON object for its constructor. Loading a class runs its module's code: name only code you trust. "
        "The simulator takes the same classes (method.policy_class, method.seed_class, adapt.policy_class, "
        "adapt.rollback_class); README: Write your own policy")
    user.add_argument("--policy", metavar="CLASS", help="a TreePolicy subclass: widths per parent (replaces --widths)")
    user.add_argument("--policy-kwargs", type=_json_object, default={}, metavar="KWARGS")
    user.add_argument("--seed-policy", metavar="CLASS", help="a SeedPolicy subclass: which nodes start the next block")
    user.add_argument("--seed-policy-kwargs", type=_json_object, default={}, metavar="KWARGS")
    user.add_argument("--adapt-policy", metavar="CLASS", help="with --adapt: a CostAwareBandit subclass picking the arm")
    user.add_argument("--adapt-policy-kwargs", type=_json_object, default={}, metavar="KWARGS")
    user.add_argument("--rollback-policy", metavar="CLASS", help="with --adapt: a ThreeWindowRollback subclass")
    user.add_argument("--rollback-policy-kwargs", type=_json_object, default={}, metavar="KWARGS")
    return p


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg}); give an object, e.g. '{{\"threshold\": 0.2}}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("give a JSON object of keyword arguments, e.g. '{\"threshold\": 0.2}'")
    return value


def _widths(text: str) -> tuple[int, int, int, int]:
    parts = text.split(",")
    if len(parts) != 4 or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError("--widths takes four non-negative integers, e.g. 2,4,10,0")
    return tuple(int(p) for p in parts)


@dataclass
class Session:
    """Models loaded once, reused for every prompt."""

    cfg: RunConfig
    target: TargetModel
    tokenizer: object
    engine: Engine
    baseline: Engine | None
    adapter: object | None = None  # runtime.adapt.Adapter with --adapt (the engine's drafter, or the branch's inner one)

    @classmethod
    def open(cls, cfg: RunConfig, trace) -> "Session":
        path = cfg.target_dir
        dtype = resolve_dtype(cfg.dtype, cfg.device, path)  # what the load resolves too: the builds begun below are its
        if cfg.compile:
            prebuild_compiled(dtype, cfg.device)
        if cfg.method in drafters.TRAINED:
            drafters.start_int8_build(dtype, cfg.device, cfg.compile)
        target = maybe_compile(TargetModel.load(path, cfg.dtype, cfg.device, cfg.attn, cfg.trust_remote_code), cfg.compile,
                               cfg.compile_mode)
        tokenizer = load_tokenizer(path, cfg.trust_remote_code)
        eos = chat.stop_ids(tokenizer, read_generation_eos(path))

        def verifier():
            if cfg.temperature == 0:
                return GreedyVerifier()
            return SamplingVerifier(cfg.temperature, cfg.top_p, cfg.seed)

        opts = drafters.serving_settings(cfg.method, target, cfg.drafter_options())
        budget = int(opts.pop("budget", drafters.DEFAULT_BUDGET))
        warm = drafters.warm_sizes(opts)
        drafter_compiled = drafters.drafter_compiled(opts, cfg.compile, cfg.eager_drafter)
        drafter, adapter = drafters.build(cfg.method, target, opts), None
        if drafter_compiled and not cfg.adapt:  # an adapting drafter's weights change while it serves
            drafter = maybe_compile_drafter(drafter, target)
        if cfg.adapt:  # inside the branch: it adapts the drafter, and the lookup chain is grafted on its trees
            from specblock.runtime.adapt import AdaptSettings, Adapter

            drafter = adapter = Adapter(drafter, AdaptSettings(**cfg.adapt_settings()))
        if cfg.lookup_branch:
            from specblock.runtime.drafters.lookup_branch import with_branch

            store = None
            if cfg.lookup_datastore:
                from specblock.runtime.drafters.datastore import open_datastore

                store = open_datastore(cfg.lookup_datastore, str(cfg.target_dir), target.vocab_size)
            drafter, budget = with_branch(drafter, budget, cfg.lookup_branch, cfg.budget is not None, cfg.lookup_on_top,
                                          store)
        engine = Engine(target, drafter, verifier(), budget, eos, trace, warm_sizes=warm)
        baseline = Engine(target, drafters.ARDrafter(), verifier(), 0, eos) if cfg.compare else None
        return cls(cfg, target, tokenizer, engine, baseline, adapter)

    def encode(self, row: dict) -> list[int]:
        """One prompt-file row (or ``--prompt``) through the chat template unless ``--raw``."""
        req = chat.ChatRequest(prompt=row.get("prompt"), messages=row.get("messages"), system=self.cfg.system,
                               raw=self.cfg.raw)
        return chat.encode(self.tokenizer, req)

    def warmup(self, ids: list[int]) -> None:
        for eng in filter(None, (self.engine, self.baseline)):
            eng.generate(ids[-16:], 4, seed=self.cfg.seed)

    def warm_compiled(self) -> list[int]:
        """``--compile`` in a server: every tree size the engine can meet, and a compiled drafter's
        steps, compiled (or loaded) before it listens, not in the middle of a request. The CLI stays
        lazy (a short run meets few sizes) unless ``--compare`` times it: loading saved graphs at
        first use cost the method's run about 1.5 s and plain decoding's nothing (SpecBlock with the
        branch meets six sizes: "0.42x vs ar" over 128 tokens). Both engines warm, as in ``warmup``:
        a warmed target pads every step up to a warmed size, so plain decoding needs bucket 1 among
        them. Returns the target's buckets warmed; none on an eager target."""
        warmed: set[int] = set()
        for eng in filter(None, (self.engine, self.baseline)):
            warmed |= set(eng.warm_compiled())
        return sorted(warmed)


def maybe_compile(target: TargetModel, compile: bool, mode: str = "whole") -> TargetModel:
    """The hook into ``specblock.compiled`` for the target (imported only when asked: it sits above runtime)."""
    if not compile:
        return target
    from specblock.compiled import compile_target

    return compile_target(target, mode)


def prebuild_compiled(dtype: str, device: str) -> None:
    """``--compile``: the C++ libraries the compiled target calls start building now, beside the
    model's load (``compiled.prebuild``)."""
    from specblock.compiled import prebuild

    prebuild(dtype, device)


def maybe_compile_drafter(drafter, target: TargetModel):
    """``--compile``'s drafter side (``compiled.compile_drafter``: SpecBlock's block 1, EAGLE-3's steps, Medusa's heads)."""
    from specblock.compiled import compile_drafter

    return compile_drafter(drafter, target)


def load_tokenizer(path: Path, trust_remote_code: bool):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise SpecBlockError(f"no usable tokenizer in {path}: {str(e).splitlines()[0]}") from None


class Streamer:
    """Prints text as tokens are accepted; holds back a trailing partial UTF-8 character."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.ids, self.shown = tokenizer, [], 0

    def __call__(self, new: list[int]) -> None:
        self.ids.extend(new)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            text = text.rstrip("\ufffd")
        sys.stdout.write(text[self.shown :])
        sys.stdout.flush()
        self.shown = max(self.shown, len(text))


def branch_fields(cfg: RunConfig) -> dict:
    """Prompt lookup's branch as a record names it (each prompt's and the summary's): only what was set."""
    return {k: v for k, v in (("lookup_branch", cfg.lookup_branch), ("lookup_on_top", cfg.lookup_on_top),
                              ("lookup_datastore", cfg.lookup_datastore)) if v}


def result_record(s: Session, res: GenerationResult, base: GenerationResult | None) -> dict:
    rec = {
        "method": s.cfg.method,
        **branch_fields(s.cfg),
        "token_ids": res.token_ids,
        "text": s.tokenizer.decode(res.token_ids, skip_special_tokens=True),
        "stopped": res.stopped,
        **res.stats.summary(),
    }
    if base is not None:
        rec["ar_tokens_per_s"] = round(base.stats.tokens_per_s, 3)
        rec["speedup"] = round(speedup(res.stats, base.stats), 4)
        rec["identical_to_ar"] = res.token_ids == base.token_ids
    return rec


def run(cfg: RunConfig) -> int:
    if cfg.trace:
        check_output(cfg.trace, "--trace")
    rows = read_prompt_file(cfg.prompt_file) if cfg.prompt_file else [{"prompt": cfg.prompt}]
    with contextlib.ExitStack() as stack:
        # A failed or interrupted run leaves an existing trace file as it was.
        trace = stack.enter_context(atomic_open(cfg.trace, "w", encoding="utf-8")) if cfg.trace else None
        s = Session.open(cfg, trace)
        if not cfg.prompt_file and cfg.prompt is None:  # no prompt given: the demo question
            rows[0]["prompt"] = DEMO_CHAT if chat.has_template(s.tokenizer) and not cfg.raw else DEMO_PROMPT
        encoded = [s.encode(r) for r in rows]
        for i, ids in enumerate(encoded):
            if len(ids) >= s.target.max_context:
                where = f"prompt {i + 1}" if cfg.prompt_file else "the prompt"
                raise SpecBlockError(f"{where} has {len(ids)} tokens, the model's context is {s.target.max_context}; shorten it")
        if cfg.warmup:
            if cfg.compare:  # a timed comparison: every shape loaded (or compiled) first, as a server does
                s.warm_compiled()
            s.warmup(encoded[0])
        gcstart.done()  # loaded and warmed: the collector's usual thresholds for decoding (specblock/gcstart.py)
        windows = watch_adaptation(s)
        total, total_base, identical = DecodeStats(), DecodeStats(), True
        for row, ids in zip(rows, encoded):
            stream = None if cfg.json_out else Streamer(s.tokenizer)
            res = s.engine.generate(ids, cfg.max_new_tokens, seed=cfg.seed, on_tokens=stream)
            base = s.baseline.generate(ids, cfg.max_new_tokens, seed=cfg.seed) if s.baseline else None
            total = total.merge(res.stats)
            if base is not None:
                total_base = total_base.merge(base.stats)
                identical &= res.token_ids == base.token_ids
            rec = result_record(s, res, base)
            rec.update({k: row[k] for k in ("id", "domain") if k in row})
            if s.adapter is not None and cfg.json_out:
                rec["adapt_windows"], windows[:] = list(windows), []
            if cfg.json_out:
                print(json.dumps(rec), flush=True)
            else:
                print("\n" + summary_line(rec), flush=True)
        if cfg.prompt_file:
            summary = {"summary": True, "method": cfg.method, "prompts": len(rows), **total.summary(),
                       **branch_fields(cfg)}
            if s.baseline:
                summary.update(speedup=round(speedup(total, total_base), 4), identical_to_ar=identical)
            if s.adapter is not None:
                summary.update(s.adapter.summary())
            print(json.dumps(summary) if cfg.json_out else "total: " + summary_line(summary), flush=True)
        if s.adapter is not None:
            s.adapter.close()
    return 0


def watch_adaptation(s: Session) -> list[dict]:
    """Adaptation windows as they close: one line each on stderr, or held for the JSON records."""
    held: list[dict] = []
    if s.adapter is not None:
        s.adapter.clear()  # the warm-up decode is not part of the measurement
        s.adapter.on_window = held.append if s.cfg.json_out else lambda w: print(window_line(w), file=sys.stderr, flush=True)
    return held


def window_line(w: dict) -> str:
    line = f"[adapt] window {w['window']}: tau {w['tau']:.2f}, {w['tokens_per_s']:.1f} tokens/s"
    if w["judged"]:
        line += f", {w['judged']} gain {w['gain']:+.3f} cost {w['cost']:.3f}"
    if w["rollback"] != "keep":
        line += f", {w['rollback']}"
    return line + (f", next arm: {w['arm']}" if w["arm"] else "")


def summary_line(rec: dict) -> str:
    line = (
        f"[{rec['method']}{' + lookup branch' if rec.get('lookup_branch') else ''}] {rec['new_tokens']} tokens, "
        f"{rec['tokens_per_s']:.1f} tokens/s, "
        f"tau {rec['tau']:.2f}, T_D% {100 * rec['draft_share']:.1f}"
    )
    if "speedup" in rec:
        line += f", {rec['speedup']:.2f}x vs ar, identical to ar: {rec['identical_to_ar']}"
    return line


def quiet_transformers() -> None:
    """HF's weight-loading bars and advisory warnings would bury our one-line messages."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    quiet_transformers()
    try:
        if argv and argv[0] in SUBCOMMANDS:
            gcstart.done()  # imports done; a bench or sweep runs with the collector's usual thresholds
            return SUBCOMMANDS[argv[0]](argv[1:])
        ns = build_parser().parse_args(argv)
        return run(validate(vars(ns)))
    except SpecBlockError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
