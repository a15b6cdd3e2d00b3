"""``python -m specblock.training drafter``: train a drafter (SpecBlock or a baseline) for an HF target.

``--method`` picks the recipe (``training/recipes.py``): specblock (the default), eagle3, medusa,
sps, parallelspec, falcon. Each
recipe builds its network from the target's config and brings its own step and evaluation; the
loop below is shared.

Resumable (atomic checkpoints every ``--ckpt-every`` steps and on SIGTERM/SIGINT), a progress bar
with loss and tokens/s, held-out per-position acceptance logged to ``metrics.jsonl``, and
multi-process data parallel under ``torchrun`` (DDP; gloo on CPU, nccl on GPUs).

Data: windows of the lab corpus (the target's token cache, see ``training/target.py``) or any
JSONL file of ``{"text": ...}`` lines tokenized with the target's tokenizer. Soft targets and
features come from the target on the fly (a cache of V-sized distributions would dwarf it).
Teacher forcing runs on corpus text, not on the target's own generations: cheaper by far on a
CPU; ``eval`` measures acceptance on held-out text and the runtime benchmark measures the rest.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from pydantic import BaseModel, ConfigDict, Field

from specblock.errors import SpecBlockError
from specblock.flags import OneLineParser, check
from specblock.runtime.target import load_causal_lm, native_bf16
from specblock.training import recipes
from specblock.training.checkpoint import load_checkpoint, refuse_pickles, save_checkpoint
from specblock.training.exported import exported_start, fill_frozen, is_exported
from specblock.training.vocab import pick_draft_vocab
from specblock.training.windows import WindowSource

CKPT = "ckpt.safetensors"  # tensors + JSON header, never a pickle (training/checkpoint.py)


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="python -m specblock.training drafter", description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="specblock", choices=sorted(recipes.RECIPES), help="what to train")
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--run-dir", type=Path, required=True, help="checkpoints and logs (resumed when present)")
    ap.add_argument("--out", type=Path, help="export the drafter (safetensors + config) here when done")
    ap.add_argument("--data", default="lab", help="'lab' (the shipped corpus) or a JSONL file with a 'text' field")
    ap.add_argument("--features", type=Path, default=None,
                    help="train from a feature cache (python -m specblock.training featcache) "
                         "instead of running the target per step; --data is then unused")
    ap.add_argument("--draft-vocab", type=int, default=None,
                    help="every method but sps: LM-head rows = the N most frequent tokens of the training data "
                         "(default: all)")
    ap.add_argument("--vocab-corpus", type=float, default=0.0,
                    help="with --features: share of the shared-data corpus (human text of the same domains) in the "
                         "token frequencies behind --draft-vocab; the rest is the cached answers")
    ap.add_argument("--own-share", type=float, default=None,
                    help="with --features: share of training windows from the target's own answers (chatgen "
                         "shards) against reference answers (ref_* shards); default: by token count")
    ap.add_argument("--skip-loops", type=int, default=0, metavar="N",
                    help="with --features: leave out of the loss every position whose next token closes an N-gram "
                         "already seen in its window (greedy answers' repetition loops; 0: off). Held-out figures "
                         "keep every position")
    ap.add_argument("--window", type=int, default=257)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--max-steps", type=int, default=2000)
    ap.add_argument("--max-minutes", type=float, default=60.0)
    ap.add_argument("--rank-freeze", type=float, default=0.1, help="share of the run with the rank head frozen (paper: 2,000 steps)")
    ap.add_argument("--train-only", default=None, metavar="PART",
                    help="specblock: train one part alone, the rest frozen: rank-head (over a trained backbone from "
                         "--init-from or the run's own checkpoint; --rank-freeze does not apply)")
    ap.add_argument("--layers", type=int, default=2, help="specblock, parallelspec, falcon: drafter layers; sps: draft model layers")
    ap.add_argument("--K", type=int, default=4, help="specblock: block size; parallelspec: tokens per forward")
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--no-shift", dest="shift", action="store_false")
    ap.add_argument("--no-prefix-broadcast", dest="prefix_broadcast", action="store_false")
    ap.add_argument("--no-valid-prefix", dest="valid_prefix", action="store_false")
    ap.add_argument("--shared-norm", dest="per_k_norm", action="store_false",
                    help="specblock: divide every in-block position's loss by N_1, not the paper's N_k")
    ap.add_argument("--per-k-norm", dest="per_k_norm", action="store_true", default=True,
                    help="specblock: the paper's N_k (the default); after --shared-norm it wins, so a fine-tune can "
                         "switch back on top of a script's flags")
    ap.add_argument("--no-cross-block", dest="cross_block", action="store_false")
    # Off by default: on a 150-step target, 26-29 steps each, it changed block-1 acceptance by
    # nothing measurable and halved block 2's (runs/shake_a vs shake_b, see the issue note).
    ap.add_argument("--init-from-target", action="store_true",
                    help="start the backbone from the target's top layers instead of a random init")
    ap.add_argument("--init-from", type=Path, default=None,
                    help="start from this run directory's checkpoint (weights and draft vocabulary; a fresh "
                         "optimizer and schedule): fine-tuning on new data. Ignored once --run-dir has its own")
    ap.add_argument("--ttt-steps", type=int, default=6, help="eagle3: training-time-test depths")
    ap.add_argument("--heads", type=int, default=4, help="medusa: number of heads")
    ap.add_argument("--hard-labels", action="store_true", help="medusa: CE on the window's tokens, not the target's distribution")
    ap.add_argument("--draft-hidden", type=int, default=None, help="sps: draft model hidden size (default: the target's)")
    ap.add_argument("--tie-embeddings", action="store_true", help="sps: one matrix for the input embedding and the LM head")
    ap.add_argument("--block-size", type=int, default=2, help="falcon: tokens per drafter forward")
    ap.add_argument("--forwards", type=int, default=3, help="falcon: drafter forwards per tree (depth = block size x forwards)")
    ap.add_argument("--glance-start", type=float, default=1.0,
                    help="falcon: chance that a wrong drafted input is replaced by the true token, at the start")
    ap.add_argument("--glance-end", type=float, default=0.25, help="falcon: ... and at the end (linear in between)")
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--amp", default="auto", choices=["auto", "bf16", "off"],
                    help="bf16 autocast of the drafter's step; auto: on CUDA and on CPUs with bf16 instructions, "
                         "off elsewhere (on an AVX2 CPU bf16 products run ~50x slower than fp32)")
    ap.add_argument("--compile", action="store_true",
                    help="specblock, eagle3: compile the step's passes over the draft vocabulary (torch.compile: "
                         "a compile of under a minute first, then 1.2-1.3x the steps per minute on a 1-thread CPU run)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="auto: cuda:LOCAL_RANK when CUDA is available, else cpu")
    ap.add_argument("--seed", type=int, default=0)
    return ap


class TrainFlags(BaseModel):
    """The trainer's numeric flags: a zero or negative one used to surface as a ZeroDivisionError
    or an empty run after the target had loaded (issue 15)."""

    model_config = ConfigDict(extra="ignore")

    own_share: float | None = Field(None, ge=0, le=1)
    skip_loops: int = Field(0, ge=0)
    window: int = Field(ge=2)
    batch: int = Field(ge=1)
    lr: float = Field(gt=0, allow_inf_nan=False)
    warmup: int = Field(ge=0)
    max_steps: int = Field(ge=1)
    max_minutes: float = Field(gt=0, allow_inf_nan=False)
    rank_freeze: float = Field(ge=0, le=1)
    layers: int = Field(ge=1)
    K: int = Field(ge=1)
    intermediate: int = Field(ge=1)
    ttt_steps: int = Field(ge=1)
    heads: int = Field(ge=1)
    draft_hidden: int | None = Field(None, ge=1)
    block_size: int = Field(ge=1)
    forwards: int = Field(ge=1)
    glance_start: float = Field(ge=0, le=1)
    glance_end: float = Field(ge=0, le=1)
    ckpt_every: int = Field(ge=1)
    eval_every: int = Field(ge=1)
    threads: int = Field(ge=1)
    seed: int = Field(ge=0, lt=2**63)


def check_args(args) -> None:
    """Every flag and path before the target loads."""
    check(TrainFlags, vars(args))
    if args.run_dir.exists() and not args.run_dir.is_dir():
        raise SpecBlockError(f"--run-dir {args.run_dir} is a file; give a directory (created if missing)")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise SpecBlockError(f"--out {args.out} is a file; give a directory for the exported drafter")
    if args.init_from is not None and not (args.init_from / CKPT).is_file() and not is_exported(args.init_from):
        raise SpecBlockError(f"--init-from {args.init_from}: no {CKPT} there, nor an exported drafter (config.json and "
                             "model.safetensors); give the --run-dir of a finished training run or a drafter directory")
    if args.init_from is not None and args.init_from.resolve() == args.run_dir.resolve():
        raise SpecBlockError("--init-from is the --run-dir itself; a run resumes from its own checkpoint without it")
    if args.compile and recipes.get(args.method).compile is None:
        raise SpecBlockError(f"--compile is wired for {', '.join(n for n, r in recipes.RECIPES.items() if r.compile)} "
                             f"only so far; drop it for --method {args.method}")
    if args.train_only is not None:
        parts = recipes.get(args.method).parts
        if not parts:
            raise SpecBlockError(f"--train-only: no part of --method {args.method} trains alone; drop the flag")
        if args.train_only not in parts:
            raise SpecBlockError(f"--train-only {args.train_only}: --method {args.method} can train alone "
                                 f"{', '.join(parts)}; pick one of those")
        if args.init_from is None and not (args.run_dir / CKPT).is_file():
            raise SpecBlockError(f"--train-only {args.train_only} trains over a trained drafter; add --init-from "
                                 "RUN_DIR_OR_DRAFTER (the rest is frozen, so a fresh init would stay random)")
    if args.skip_loops and args.features is None:
        raise SpecBlockError("--skip-loops masks windows of a feature cache; add --features DIR or drop the flag")
    if args.data != "lab" and not Path(args.data).is_file():
        raise SpecBlockError(f"--data {args.data}: no such file; pass lab or a JSONL file with a 'text' field")


class StepModule(torch.nn.Module):
    """Wraps the recipe's step as a module call so DistributedDataParallel's gradient hooks see it."""

    def __init__(self, net: torch.nn.Module, recipe: recipes.Recipe, args) -> None:
        super().__init__()
        self.net, self.recipe, self.args = net, recipe, args

    def forward(self, batch, gen, progress: float) -> recipes.StepOut:
        return self.recipe.step(self.net, batch, gen, self.args, progress)


def lr_at(step: int, progress: float, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


DDP_TIMEOUT_S = 600  # any collective under torchrun


def train(args) -> None:
    check_args(args)
    refuse_pickles(args.run_dir / "ckpt.pt")  # before anything runs
    ddp = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if ddp:
        # A bounded wait: a rank that never reaches a collective fails the run in minutes, not
        # gloo's default half hour.
        dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl",
                                timeout=datetime.timedelta(seconds=DDP_TIMEOUT_S))
    rank = dist.get_rank() if ddp else 0
    main_proc = rank == 0
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if use_cuda else "cpu")
    amp = args.amp == "bf16" or (args.amp == "auto" and native_bf16(device))
    recipe = recipes.get(args.method)
    from specblock.models import resolve_target

    args.target = resolve_target(args.target)  # a registry name (smollm2-135m-instruct) or a directory
    if (args.features or args.draft_vocab) and recipe.cached is None:
        raise SpecBlockError(f"--features and --draft-vocab are wired for --method {', '.join(recipes.with_cache())} only so far")
    if args.draft_vocab and recipe.cached == "tokens":
        raise SpecBlockError(f"--draft-vocab: the {args.method} draft model is a whole HF LM over the target's vocabulary "
                             "(HF's assisted generation serves it as is); drop --draft-vocab")
    target = load_causal_lm(args.target, "bfloat16", str(device.type), "sdpa", False).to(device).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    if args.features:
        from specblock.training.cachewindows import CacheWindows
        from specblock.training.featcache import FeatureCache

        source = CacheWindows(FeatureCache(args.features, args.target), args.window, seed=args.seed + 1000 * rank,
                              feature=recipe.cached, own_share=args.own_share, skip_loops=args.skip_loops)
    else:
        source = WindowSource(args.data, args.target, args.window, seed=args.seed + 1000 * rank)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = args.run_dir / CKPT
    start = _start_state(args, ckpt_path)
    args.d2t = None
    if args.draft_vocab:
        # A checkpoint's own map first: the cache may have grown since, and new counts would pick
        # other head rows than the ones its weights were trained against.
        saved = start["net"].get("d2t") if start else None
        args.d2t = saved.numpy() if saved is not None else pick_draft_vocab(args, source, target.config.vocab_size)
    net = recipe.build(target, args).to(device)
    if args.train_only is not None:  # before DDP, which registers a gradient hook per trainable parameter
        prefix = recipe.parts[args.train_only]
        for name, p in net.named_parameters():
            p.requires_grad_(p.requires_grad and name.startswith(prefix))
    if args.compile:
        recipe.compile(net)
    model = StepModule(net, recipe, args)
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if use_cuda else None)
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    step, train_s, init = 0, 0.0, None
    if start is not None:
        resumed = ckpt_path.is_file()
        src = ckpt_path if resumed else args.init_from / (CKPT if not start.get("exported") else "model.safetensors")
        if start.get("method", "specblock") != args.method:
            raise SpecBlockError(f"{src.parent} holds a {start.get('method', 'specblock')} run; use another directory")
        try:
            net.load_state_dict(fill_frozen(net, start["net"]) if start.get("exported") and not resumed
                                else start["net"])
            if resumed:
                opt.load_state_dict(start["opt"])
        except (KeyError, RuntimeError, ValueError) as e:
            raise SpecBlockError(f"{src} was trained with other settings ({str(e).splitlines()[0][:160]}); "
                                 "use the same flags, or pass another directory") from e
        if resumed:
            step, train_s = start["step"], start["train_s"]
            init = start.get("init")
        else:  # what the fine-tune started from, for its model card
            init = {"from": str(args.init_from), "step": start["step"], "train_s": start["train_s"],
                    "args": {k: v for k, v in start["args"].items() if k != "d2t"},
                    **({"init": start["init"]} if start.get("init") else {}),  # the source's own lineage
                    **({"exported": True, "record": start["record"]} if start.get("exported") else {})}
        if main_proc:
            print(f"resumed from step {step}" if resumed else f"fine-tuning from {src} (step {start['step']})", flush=True)
    source.rng = np.random.default_rng(args.seed + 1000 * rank + step)  # a resumed run draws new windows
    heldout = (source.heldout(8, net) if args.features else source.heldout(8)).to(device)
    gen = torch.Generator(device=device).manual_seed(args.seed + rank + step)
    stop = {"flag": False}

    def on_signal(signum, _frame):
        stop["flag"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    def state() -> dict:
        return {"net": net.state_dict(), "opt": opt.state_dict(), "step": step, "train_s": train_s,
                "method": args.method, "args": vars(args), **({"init": init} if init else {})}

    def progress() -> float:
        """Share of the run done; under DDP every rank takes the largest, so all stop together
        and follow the same LR schedule (each rank times itself)."""
        p = torch.tensor([max(step / args.max_steps, train_s / (60 * args.max_minutes)), float(stop["flag"])])
        if ddp:
            dist.all_reduce(p, op=dist.ReduceOp.MAX)
        return 1.0 if p[1] > 0 else float(p[0])

    bar = tqdm(total=args.max_steps, initial=step, disable=not main_proc, dynamic_ncols=True)
    log = (args.run_dir / "metrics.jsonl").open("a") if main_proc else None
    net.train()
    while (done := progress()) < 1.0:
        t0 = time.perf_counter()
        lr = lr_at(step, done, args)
        for grp in opt.param_groups:
            grp["lr"] = lr
        if args.features:
            batch = source.batch(args.batch, net).to(device)
            tokens = batch.tokens
        else:
            tokens = source.batch(args.batch).to(device)
            with torch.no_grad():
                batch = recipe.prepare(target, tokens, net, args)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            res = model(batch, gen, done)
        opt.zero_grad(set_to_none=True)
        res.loss.backward()  # under DDP, gradients are averaged across processes here
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        dt = time.perf_counter() - t0
        train_s += dt
        if main_proc:
            bar.set_postfix(loss=f"{res.loss.item():.3f}", **res.postfix, lr=f"{lr:.1e}",
                            tok_s=f"{tokens.numel() / dt:.0f}")
            bar.update(1)
            if step % args.ckpt_every == 0:
                save_checkpoint(ckpt_path, state())
                if args.features:
                    source.refresh()  # shards featcache finished since the run started join the draw
            if step % args.eval_every == 0:
                rec = {"step": step, "train_s": round(train_s, 1), "loss": round(res.loss.item(), 4),
                       **recipe.evaluate(net, target, heldout, args)}
                log.write(json.dumps(rec) + "\n")
                log.flush()
                tqdm.write(json.dumps(rec))
    bar.close()
    if ddp:
        dist.barrier()  # every rank leaves the loop before rank 0's final evaluation
    if main_proc:
        save_checkpoint(ckpt_path, state())
        rec = {"step": step, "train_s": round(train_s, 1), "final": True, **recipe.evaluate(net, target, heldout, args)}
        log.write(json.dumps(rec) + "\n")
        log.close()
        print(json.dumps(rec), flush=True)
        if args.out and not stop["flag"]:
            net.save(args.out)
            print(f"drafter written to {args.out}", flush=True)
    if ddp:
        # Without this barrier, a rank that finished first and exited left rank 0 hanging in
        # gloo's teardown (seen in tests/test_ddp.py under load).
        dist.barrier()
        faulthandler.dump_traceback_later(60, exit=True)  # should destroy itself hang
        dist.destroy_process_group()
        _exit_worker()


def _exit_worker() -> None:
    """A torchrun worker ends here, its work written, without freeing ``train``'s locals.

    In a loaded CI run a worker hung after destroying its process group: every thread's stack,
    dumped a minute in, showed the main thread in ``main()`` with ``train``'s frame gone, i.e.
    in a destructor run while its locals (DDP model, autograd graph, gloo buffers) were freed.
    PyTorch knows this class of teardown race (pytorch/pytorch#75097, #190489). Nothing is left
    to do that freeing could finish, so the worker leaves at once; only the torchrun path comes
    here, a caller of ``train`` in one process returns as usual.
    """
    faulthandler.cancel_dump_traceback_later()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _start_state(args, ckpt_path: Path) -> dict | None:
    """The checkpoint a run starts from: its own (resume), else ``--init-from``'s, else none."""
    if ckpt_path.is_file():
        return load_checkpoint(ckpt_path)
    if args.init_from is not None:
        if (args.init_from / CKPT).is_file():
            return load_checkpoint(args.init_from / CKPT)
        return exported_start(args.init_from, args.method)
    return None


def main(argv: list[str] | None = None) -> int:
    train(build_parser().parse_args(argv))
    return 0
