"""Training recipes: what ``python -m specblock.training drafter --method NAME`` trains.

A recipe says how to build a method's network from the target (and the CLI's arguments), how to
turn a batch of token windows into the step's inputs with the frozen target (no gradient), one
training step (loss plus progress-bar fields), and a held-out evaluation. The trainer in
``drafter.py`` owns everything shared: data, optimiser, schedule, checkpoints, DDP, logging.
Add a method with :func:`register`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from specblock.errors import SpecBlockError
from specblock.runtime.target import default_taps


@dataclass
class StepOut:
    loss: torch.Tensor
    postfix: dict[str, str] = field(default_factory=dict)  # shown after the loss in the progress bar


@dataclass
class Recipe:
    name: str
    build: Callable[[Any, argparse.Namespace], torch.nn.Module]  # (target model, args) -> net with .save(path)
    prepare: Callable[[Any, torch.Tensor, torch.nn.Module, argparse.Namespace], Any]  # no grad
    step: Callable[[torch.nn.Module, Any, torch.Generator, argparse.Namespace, float], StepOut]
    evaluate: Callable[[torch.nn.Module, Any, torch.Tensor, argparse.Namespace], dict]
    # The feature-cache array the step reads in place of a target pass ("taps", "top", or "tokens":
    # the top-k alone; the cache's top-k gives the soft targets), None: no --features for this method.
    cached: str | None = None
    # ``--compile``: compiles in place the part of the step that runs over the draft vocabulary (the
    # head, its log-normaliser, softmax statistics), None: the method has no such hook yet.
    compile: Callable[[torch.nn.Module], None] | None = None
    # ``--train-only PART``: the parameter-name prefix of each part that can train alone over the
    # rest, frozen (the rest's loss terms still run, without gradients).
    parts: dict[str, str] = field(default_factory=dict)


RECIPES: dict[str, Recipe] = {}


def register(recipe: Recipe) -> None:
    RECIPES[recipe.name] = recipe


def get(name: str) -> Recipe:
    if name not in RECIPES:
        raise SpecBlockError(f"unknown training method {name!r}; choose one of {', '.join(sorted(RECIPES))}")
    return RECIPES[name]


def with_cache() -> list[str]:
    """Methods that train from a feature cache (all but SpS also with a draft vocabulary)."""
    return sorted(name for name, r in RECIPES.items() if r.cached is not None)


def _draft_vocab(net, args):
    """Set the draft vocabulary (``args.d2t``, computed by the trainer) before the head is tied."""
    if net.cfg.draft_vocab is not None:
        net.set_vocab(torch.as_tensor(args.d2t))
    return net


def _rope_theta(tcfg) -> float:
    return float(getattr(tcfg, "rope_theta", 10000.0) or 10000.0)


# --------------------------------------------------------------------------- specblock
def _specblock_build(target, args):
    from specblock.runtime.drafters.specblock_net import SpecBlockConfig, SpecBlockNet

    tcfg = target.config
    cfg = SpecBlockConfig(
        vocab_size=tcfg.vocab_size, hidden_size=tcfg.hidden_size, num_layers=args.layers,
        num_heads=tcfg.num_attention_heads, intermediate_size=args.intermediate, K=args.K,
        tap_layers=default_taps(tcfg.num_hidden_layers), rope_theta=_rope_theta(tcfg), shift=args.shift,
        prefix_broadcast=args.prefix_broadcast, draft_vocab=getattr(args, "draft_vocab", None),
    )
    net = _draft_vocab(SpecBlockNet(cfg), args)
    net.tie_to_target(target)
    return net


def _taps_pass(target, tokens, net, args):
    from specblock.training.specblock_step import target_pass

    return target_pass(target, tokens, tuple(net.cfg.tap_layers), net)


def _specblock_step(net, tp, gen, args, progress):
    from specblock.training.specblock_step import specblock_step

    # The rank head is frozen early (paper: 2,000 steps), unless it is the one part that trains (--train-only).
    rank_w = 0.0 if args.train_only != "rank-head" and progress < args.rank_freeze else 1.0
    res = specblock_step(net, tp, gen, rank_w, args.valid_prefix, args.cross_block, getattr(args, "per_k_norm", True))
    b0 = res.blocks[0]
    acc1 = float((b0.mask * b0.top1).sum() / b0.mask[..., 0].sum())
    return StepOut(res.loss, {"acc_len": f"{acc1:.2f}"})


@torch.no_grad()
def _specblock_evaluate(net, target, windows, args) -> dict:
    """Held-out acceptance per in-block position (chain acceptance under the valid-prefix rule)
    and rank-head accuracy, for block 1 and block 2."""
    from specblock.training.specblock_step import TargetPass, specblock_step, target_pass

    net.eval()
    gen = torch.Generator().manual_seed(0)
    masks, ranks = [[], []], [[], []]
    # windows: token windows (the target runs here) or a TargetPass already read from a feature cache
    passes = windows.split(4) if isinstance(windows, TargetPass) else [
        target_pass(target, chunk, tuple(net.cfg.tap_layers), net) for chunk in windows.split(4)]
    for tp in passes:
        res = specblock_step(net, tp, gen, 1.0)
        for i, bl in enumerate(res.blocks):
            # Acceptance at k = block reaches k and is right there: m_{k+1} in the paper's notation.
            acc = bl.mask * bl.top1.float()
            # Block 1 over every position: one whose target token has no draft-vocabulary row is a
            # miss, as when serving and in EAGLE-3's chain_acceptance (its mask[..., 0] is off there,
            # so dividing by it left such positions out and overstated block 1 by the coverage gap).
            # Block 2 stays conditional on being reached (its mask[..., 0]: block 1 right to the seed).
            reach = bl.mask[..., 0].numel() if i == 0 else bl.mask[..., 0].sum().clamp_min(1)
            masks[i].append(acc.flatten(0, -2).sum(0) / reach)
            ranks[i].append((bl.rank_correct.float() * bl.mask).sum() / bl.mask.sum().clamp_min(1))
    net.train()
    out = {}
    for i in range(len(res.blocks)):
        out[f"block{i + 1}_acc"] = [round(float(x), 4) for x in torch.stack(masks[i]).mean(0)]
        out[f"block{i + 1}_rank_acc"] = round(float(torch.stack(ranks[i]).mean()), 4)
    return out


def _compile_heads(net) -> None:
    """Why: on a CPU the step's cost is its passes over [positions x K x draft vocabulary] floats
    (logits, log-normaliser and its backward, rank statistics), each one op in eager mode; inductor
    fuses them. Static shapes: training windows have one shape (held-out evaluation another)."""
    net.heads = torch.compile(net.heads, dynamic=False)


# Why the rank head can train alone: it reads the backbone's state detached (``SpecBlockNet.heads``),
# so over a trained backbone its labels (the target token's rank bucket) no longer move, and a step
# without the backbone's backward costs a fraction of a full one (our addition; the paper only
# delays it, freezing it for the first 2,000 steps).
register(Recipe("specblock", _specblock_build, _taps_pass, _specblock_step, _specblock_evaluate, "taps",
                compile=_compile_heads, parts={"rank-head": "rank_head."}))


# --------------------------------------------------------------------------- eagle3
def _eagle3_build(target, args):
    from specblock.runtime.drafters.eagle3 import Eagle3Config, Eagle3Net

    tcfg = target.config
    cfg = Eagle3Config(
        vocab_size=tcfg.vocab_size, hidden_size=tcfg.hidden_size, num_heads=tcfg.num_attention_heads,
        intermediate_size=args.intermediate, tap_layers=default_taps(tcfg.num_hidden_layers),
        rope_theta=_rope_theta(tcfg), draft_vocab=getattr(args, "draft_vocab", None),
    )
    net = _draft_vocab(Eagle3Net(cfg), args)
    net.tie_to_target(target)
    return net


def _eagle3_step(net, tp, gen, args, progress):
    from specblock.training.eagle3_step import eagle3_step

    res = eagle3_step(net, tp, args.ttt_steps, getattr(net, "step_ce", None))
    d1 = float(res.top1[0].float().mean())
    return StepOut(res.loss, {"top1_d1": f"{d1:.2f}"})


@torch.no_grad()
def _eagle3_evaluate(net, target, windows, args) -> dict:
    """Held-out chain acceptance per depth (top-1 right at every depth up to d)."""
    from specblock.training.eagle3_step import chain_acceptance, eagle3_step
    from specblock.training.specblock_step import TargetPass, target_pass

    net.eval()
    accs = []
    # windows: token windows (the target runs here) or a TargetPass already read from a feature cache
    passes = windows.split(4) if isinstance(windows, TargetPass) else [
        target_pass(target, chunk, tuple(net.cfg.tap_layers), net) for chunk in windows.split(4)]
    for tp in passes:
        accs.append(chain_acceptance(eagle3_step(net, tp, args.ttt_steps)))
    net.train()
    return {"chain_acc": [round(float(x), 4) for x in torch.tensor(accs).mean(0)]}


def _compile_depth_ce(net) -> None:
    """The head and soft cross-entropy of each TTT depth, compiled (why: as ``_compile_heads``)."""
    from specblock.training.eagle3_step import depth_ce

    net.step_ce = torch.compile(depth_ce, dynamic=False)


register(Recipe("eagle3", _eagle3_build, _taps_pass, _eagle3_step, _eagle3_evaluate, "taps", compile=_compile_depth_ce))


# --------------------------------------------------------------------------- medusa
def _medusa_build(target, args):
    from specblock.runtime.drafters.medusa import MedusaConfig, MedusaNet

    tcfg = target.config
    cfg = MedusaConfig(vocab_size=tcfg.vocab_size, hidden_size=tcfg.hidden_size, heads=args.heads,
                       draft_vocab=getattr(args, "draft_vocab", None))
    net = _draft_vocab(MedusaNet(cfg), args)
    net.tie_to_target(target)
    return net


def _medusa_prepare(target, tokens, net, args):
    from specblock.training.medusa_step import medusa_pass

    return medusa_pass(target, tokens, net)


def _medusa_step(net, mp, gen, args, progress):
    from specblock.training.medusa_step import medusa_step

    res = medusa_step(net, mp, args.hard_labels)
    h0 = float(res.top1[..., 0][res.valid[..., 0]].float().mean())
    return StepOut(res.loss, {"top1_h0": f"{h0:.2f}"})


@torch.no_grad()
def _medusa_evaluate(net, target, windows, args) -> dict:
    """Per-head top-1 on held-out text, and the per-(head, rank) accuracy table that calibrates
    the static tree: written into the network's config, so the exported drafter carries it."""
    from specblock.training.medusa_step import MedusaPass, medusa_pass, medusa_step, rank_accuracy

    net.eval()
    tables = []
    # windows: token windows (the target runs here) or a MedusaPass already read from a feature cache
    passes = windows.split(4) if isinstance(windows, MedusaPass) else [
        medusa_pass(target, chunk, net) for chunk in windows.split(4)]
    for mp in passes:
        tables.append(rank_accuracy(medusa_step(net, mp, args.hard_labels), net.cfg.top_k))
    net.train()
    acc = torch.stack(tables).mean(0)
    net.cfg.rank_acc = [[round(float(x), 5) for x in row] for row in acc]
    return {"head_top1": [round(float(x), 4) for x in acc[:, 0]], "head_top5": [round(float(x), 4) for x in acc[:, :5].sum(1)]}


register(Recipe("medusa", _medusa_build, _medusa_prepare, _medusa_step, _medusa_evaluate, "top"))


# --------------------------------------------------------------------------- sps
def _sps_build(target, args):
    from specblock.training.sps_step import build_draft

    return build_draft(target, args.layers, args.intermediate, args.draft_hidden, args.tie_embeddings)


def _sps_prepare(target, tokens, net, args):
    from specblock.training.sps_step import sps_pass

    return sps_pass(target, tokens)


def _sps_step(net, sp, gen, args, progress):
    from specblock.training.sps_step import sps_step

    res = sps_step(net, sp)
    return StepOut(res.loss, {"top1": f"{float(res.top1.float().mean()):.2f}"})


@torch.no_grad()
def _sps_evaluate(net, target, windows, args) -> dict:
    """Held-out top-1 agreement with the target (alpha, the chain acceptance rate per token)."""
    from specblock.training.sps_step import sps_pass, sps_step

    from specblock.training.sps_step import SpsTopkPass

    net.eval()
    # windows: token windows (the target runs here) or the cached top-k of a feature cache
    passes = windows.split(4) if isinstance(windows, SpsTopkPass) else [sps_pass(target, c) for c in windows.split(4)]
    agree = [float(sps_step(net, sp).top1.float().mean()) for sp in passes]
    net.train()
    return {"alpha": round(sum(agree) / len(agree), 4)}


register(Recipe("sps", _sps_build, _sps_prepare, _sps_step, _sps_evaluate, "tokens"))


# --------------------------------------------------------------------------- parallelspec / falcon
def _feature_cfg(target, args) -> dict:
    """What the EAGLE-style front end of ParallelSpec and Falcon takes from the target and the CLI."""
    tcfg = target.config
    return dict(vocab_size=tcfg.vocab_size, hidden_size=tcfg.hidden_size, num_heads=tcfg.num_attention_heads,
                num_layers=args.layers, intermediate_size=args.intermediate,
                tap_layers=default_taps(tcfg.num_hidden_layers), rope_theta=_rope_theta(tcfg),
                draft_vocab=getattr(args, "draft_vocab", None))


def _depth_top1(res) -> list[float]:
    """Per-depth top-1 agreement with the target over valid rows."""
    v = res.valid.float()[None]
    acc = (res.top1.float() * v).sum((0, 1)) / (v.sum((0, 1)) * res.top1.shape[0]).clamp_min(1)
    return [round(float(x), 4) for x in acc]


@torch.no_grad()
def _depth_evaluate(net, target, windows, run) -> dict:
    """Held-out chain acceptance per depth (top-1 right at every depth up to d, teacher-forced
    context) and per-depth top-1, averaged over chunks of 4 windows."""
    from specblock.training.parallelspec_step import chain_acceptance
    from specblock.training.specblock_step import TargetPass, target_pass

    net.eval()
    chains, tops = [], []
    # windows: token windows (the target runs here) or a TargetPass already read from a feature cache
    passes = windows.split(4) if isinstance(windows, TargetPass) else [
        target_pass(target, chunk, tuple(net.cfg.tap_layers), net) for chunk in windows.split(4)]
    for tp in passes:
        res = run(net, tp)
        chains.append(chain_acceptance(res))
        tops.append(_depth_top1(res))
    net.train()
    mean = lambda rows: [round(float(x), 4) for x in torch.tensor(rows).mean(0)]
    return {"chain_acc": mean(chains), "top1": mean(tops)}


def _parallelspec_build(target, args):
    from specblock.runtime.drafters.parallelspec import ParallelSpecConfig, ParallelSpecNet

    net = _draft_vocab(ParallelSpecNet(ParallelSpecConfig(**_feature_cfg(target, args), k=max(args.K, 2))), args)
    net.tie_to_target(target)
    return net


def _parallelspec_step(net, tp, gen, args, progress):
    from specblock.training.parallelspec_step import parallelspec_step

    res = parallelspec_step(net, tp)
    return StepOut(res.loss, {"top1_d1": f"{_depth_top1(res)[0]:.2f}"})


def _parallelspec_evaluate(net, target, windows, args) -> dict:
    from specblock.training.parallelspec_step import parallelspec_step

    return _depth_evaluate(net, target, windows, parallelspec_step)


register(Recipe("parallelspec", _parallelspec_build, _taps_pass, _parallelspec_step, _parallelspec_evaluate, "taps"))


def _falcon_build(target, args):
    from specblock.runtime.drafters.falcon import FalconConfig, FalconNet

    net = _draft_vocab(FalconNet(FalconConfig(**_feature_cfg(target, args), block_size=args.block_size,
                                              forwards=args.forwards)), args)
    net.tie_to_target(target)
    return net


def _falcon_step(net, tp, gen, args, progress):
    from specblock.training.falcon_step import falcon_step, glance_at

    glance = glance_at(progress, args.glance_start, args.glance_end)
    res = falcon_step(net, tp, net.cfg.forwards, glance, gen)
    return StepOut(res.loss, {"top1_d1": f"{_depth_top1(res)[0]:.2f}", "glance": f"{glance:.2f}"})


def _falcon_evaluate(net, target, windows, args) -> dict:
    """Evaluated as served: blocks >= 2 read the drafter's own predictions (no glancing)."""
    from specblock.training.falcon_step import falcon_step

    return _depth_evaluate(net, target, windows, lambda n, tp: falcon_step(n, tp, n.cfg.forwards, 0.0))


register(Recipe("falcon", _falcon_build, _taps_pass, _falcon_step, _falcon_evaluate, "taps"))
