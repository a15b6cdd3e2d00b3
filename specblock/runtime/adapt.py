"""Serving-time adaptation of the SpecBlock drafter (paper: "Serving-time adaptation"; issue 6).

The signal is free: ``Drafter.accept`` already receives the target's taps *and* logits at the
root, every accepted node and the node after them (the bonus: the first rejected position). Per
query we keep the committed tokens, the taps at every committed position and the target's top-k
log-probs at every generated one: all that teacher-forcing the drafter's first block needs, with
no extra target forward. A query's error signal ``s = sum_iterations (max_depth - accepted)``
counts the drafted depths past the accepted path (acceptance r = 0 there; under sampling, the
realised indicator) and sets how often the query is replayed.

:class:`Adapter` wraps a :class:`SpecBlockDrafter` and is itself the engine's drafter:
``theta_inf`` (the wrapped net) serves, ``theta_train`` (float32) trains in a background thread
(on CUDA in its own stream), ``theta_0`` is the frozen pretrained net for the anchor
``L = L_draft + rank_weight * L_rank + lam * KL(p_theta || p_theta0)`` on the supervised positions
(the update itself: ``adapt_update.py``).
The serving thread swaps a finished update in *between* iterations (a non-blocking queue poll;
the worker never touches ``theta_inf``) and rebuilds the drafter's KV cache from the query's
taps, so new weights never attend to keys the old ones wrote. Serving never waits for training.

Arms: ``skip``; ``heads``: the output side, i.e. the drafter's *private copy* of the LM head
(copied from the target's frozen head at load, so training it never touches the target), the
final norm and the rank head, with the frozen backbone's states cached per query; ``full``: all
but the input embedding (frozen and shared with the target, as in pretraining). Every ``window``
iterations a window closes with its tau and tokens/s. The bandit's gain for an arm is the
relative change of the metric (tau by default: on a shared CPU tokens/s measures the neighbours
too, and the update's price enters as its cost) from the mean of the three windows before the
choice to the first whole window after the update landed; its cost is the update's wall time
over that window's wall time. :class:`ThreeWindowRollback` judges every landed update on window
tau and restores the last good weights when it says so.

Cores (our choice; the paper trains on a GPU beside serving): on a CPU the worker's threads and
serving's share the cores. With more threads than cores, the OpenMP teams of both spin at their
barriers and serving's forwards take about three times as long (real model, 2 cores, packed-fp16: T(1) 19.7 ms
alone at two threads, 56.6 ms beside a one-thread training loop at two, 29.4 ms at one;
``experiments/adapt_cores.py``, ``experiments/results/adapt_cores.md``).
So while an update is in flight serving drops to the cores the worker leaves it, and gets its
threads back when the update lands.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from specblock.policies import loading
from specblock.policies.bandit import ARMS, CostAwareBandit, FixedArm
from specblock.policies.rollback import ThreeWindowRollback
from specblock.policies.tree import DraftTree
from specblock.runtime.drafters.base import DraftRequest, Drafter
from specblock.runtime.drafters.specblock import SpecBlockDrafter
from specblock.runtime.adapt_signal import QueryRecord
from specblock.runtime.adapt_update import UpdateTrainer
from specblock.runtime.packed import served, unpack_linears
from specblock.runtime.target import TargetOutput
from specblock.runtime.verify import Verdict

log = logging.getLogger(__name__)


@dataclass
class AdaptSettings:
    window: int = 128  # decoding iterations per window
    lam: float = 0.1  # weight of KL(p_theta || p_theta0)
    arms: tuple[str, ...] = ARMS  # one arm: always play it (the ablations)
    steps: int = 4  # optimiser steps per update
    batch: int = 4  # queries per step
    # One update must not make the next queries' drafts worse. On the real model's drafter, chat-templated
    # queries, 1e-3 / 2e-4 shortened the next queries' chains by 3% on average and 1e-4 / 1e-5 did not
    # (experiments/adapt_offline.py, adapt_offline_s53.md; README "Serving-time adaptation")
    lr_heads: float = 1e-4
    lr_full: float = 1e-5
    buffer: int = 32  # queries kept
    top_k: int = 32  # target log-probs kept per position (renormalised: the soft label)
    max_ctx: int = 192  # last tokens of a query that one training block sees
    rank_weight: float = 0.2
    tolerance: float = 0.05  # rollback: relative tau drop that restores the last good weights
    explore: float = 0.5
    # An update's gain lasts while its cost is paid once: weighing a one-window gain against the
    # whole cost never pays on a slow machine, so the cost is amortised over 1/cost_weight windows.
    cost_weight: float = 0.25
    gain: str = "tau"  # "tau" or "tps": the metric whose relative change is the bandit's gain
    threads: int = 1  # torch threads of the worker (OpenMP: per thread; serving keeps its own)
    amp: str = "auto"  # bf16 autocast of an update: "auto" (where bf16 products are native), "bf16", "off"
    seed: int = 0
    # A user's bandit / rollback rule ("package.module:Class", CostAwareBandit / ThreeWindowRollback
    # subclasses; --adapt-policy / --rollback-policy), built by the loader the simulator uses too.
    bandit_class: str | None = None
    bandit_kwargs: dict = field(default_factory=dict)
    rollback_class: str | None = None
    rollback_kwargs: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.arms or set(self.arms) - set(ARMS) or self.gain not in ("tau", "tps") or self.window < 1 \
                or self.amp not in ("auto", "bf16", "off"):
            raise ValueError(f"bad adaptation settings: arms {self.arms} (of {ARMS}), gain {self.gain!r}, "
                             f"window {self.window}, amp {self.amp!r} (auto, bf16 or off)")


def available_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def adaptation_policies(c: AdaptSettings) -> tuple[CostAwareBandit, ThreeWindowRollback]:
    """The bandit and rollback rule for ``c``: the user's classes when named (the settings here
    are their defaults, their kwargs override them), else ours."""
    arms = tuple(c.arms)
    if c.bandit_class:
        bandit = loading.build(c.bandit_class, c.bandit_kwargs, CostAwareBandit, "--adapt-policy",
                               defaults={"arms": arms, "seed": c.seed, "explore": c.explore, "cost_weight": c.cost_weight})
    elif len(arms) == 1:
        bandit = FixedArm(arms=arms, arm=arms[0], seed=c.seed)
    else:
        bandit = CostAwareBandit(arms=arms, explore=c.explore, cost_weight=c.cost_weight, seed=c.seed)
    if c.rollback_class:
        rollback = loading.build(c.rollback_class, c.rollback_kwargs, ThreeWindowRollback, "--rollback-policy",
                                 defaults={"tolerance": c.tolerance})
    else:
        rollback = ThreeWindowRollback(tolerance=c.tolerance)
    return bandit, rollback


@dataclass
class _Pending:
    arm: str
    before: float  # mean metric of the three windows before the arm was chosen
    cost_s: float = 0.0
    applied_at: int | None = None  # window index in progress when the update landed


@dataclass
class _Result:
    arm: str
    generation: int
    seconds: float
    state: dict | None = None  # trained tensors (float32), None when the update failed
    error: str | None = None


class Adapter(Drafter):
    """A SpecBlock drafter that adapts itself while serving. Lossless like any drafter: only
    the proposals change, never the verification."""

    needs_features = True

    def __init__(self, drafter: SpecBlockDrafter, settings: AdaptSettings | None = None,
                 on_window: Callable[[dict], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        """``clock`` times windows and updates (the bandit's cost); a test passes a virtual one
        so that the bandit's choices do not depend on how fast the machine is."""
        self.inner, self.cfg, self.on_window = drafter, settings or AdaptSettings(), on_window
        self.clock = clock
        self.name = f"{drafter.name}+adapt"
        self.tap_layers = drafter.tap_layers
        self.theta_inf = drafter.net  # packed beside a packed-fp16 target; repacked when an update lands
        base = copy.deepcopy(self.theta_inf)
        unpack_linears(base)  # training needs gradients, which a packed forward has not
        self.trainer = UpdateTrainer(base.float().eval().requires_grad_(False), self.cfg)
        self.theta_0, self.theta_train = self.trainer.theta_0, self.trainer.theta_train
        self.master = self.trainer.start_weights()  # the serving weights, as the worker starts from them
        c = self.cfg
        self.bandit, self.rollback = adaptation_policies(c)
        self.buffer: deque[QueryRecord] = deque(maxlen=c.buffer)
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self.generation = 0  # bumped by every rollback: updates trained before it are stale
        self._serve_threads: int | None = None  # serving's threads while an update holds a core
        self.backbone_version = 0  # bumped whenever the serving backbone changes
        self._depth: int | None = None  # the depth of the drafter's own last tree (``propose``)
        self.clear()

    # ------------------------------------------------------------------ bookkeeping
    def clear(self) -> None:
        """Forget measurements and signal (e.g. after the CLI's warm-up); weights stay."""
        if getattr(self, "busy", False):
            self.wait()  # an update in flight would land on the cleared bookkeeping
        self.buffer.clear()
        self.record: QueryRecord | None = None
        self.windows: list[dict] = []
        self.win = 0
        self._w_iters = self._w_tokens = 0  # tokens = sum of (accepted + 1): tau's numerator
        self._t_win: float | None = None
        self.pending: _Pending | None = None
        self.busy = False
        self.played = {a: 0 for a in ARMS}
        self.update_s = {a: [] for a in ARMS}
        self.failures = self.swaps = self.stale = 0
        self._rebuild = False

    def summary(self) -> dict:
        cost = {a: round(float(np.mean(v)), 4) for a, v in self.update_s.items() if v}  # mean seconds
        return {"adapt_windows": self.win, "adapt_arms": dict(self.played), "adapt_update_s": cost,
                "adapt_swaps": self.swaps, "adapt_rollbacks": self.rollback.rollbacks,
                "adapt_commits": self.rollback.commits, "adapt_failures": self.failures, "adapt_stale": self.stale}

    # ------------------------------------------------------------------ Drafter API
    def reset(self) -> None:
        self.inner.reset()

    def prefill(self, prompt: np.ndarray, features: TargetOutput | None) -> None:
        self._poll()  # a query boundary: the best moment to swap, nothing to rebuild
        self._rebuild = False
        self.record = QueryRecord(prompt, None if features is None else features.taps)
        with self._lock:
            self.buffer.append(self.record)
        if self._t_win is None:
            self._t_win = self.clock()
        self.inner.prefill(prompt, features)

    def max_tree(self, budget: int) -> int:
        return self.inner.max_tree(budget)  # adapting changes weights, never the trees' shapes

    def tree_sizes(self, budget: int) -> tuple[int, ...]:
        return self.inner.tree_sizes(budget)

    def propose(self, req: DraftRequest) -> DraftTree:
        if self._poll() or self._rebuild:
            self._rebuild_cache()
        tree = self.inner.propose(req)
        # The drafter's own depth: a lookup branch above (drafters/lookup_branch.py) may graft a
        # deeper chain onto this tree, and its misses are not the drafter's (the signal's ``s``)
        self._depth = tree.max_depth
        return tree

    def accept(self, tree: DraftTree, verdict: Verdict, features: TargetOutput | None) -> None:
        self.inner.accept(tree, verdict, features)
        path = verdict.path
        lg = features.logits.float()
        top = lg.topk(min(self.cfg.top_k, lg.shape[-1]), dim=-1)
        lps = top.values - torch.logsumexp(lg, dim=-1, keepdim=True)
        nxt = np.append(tree.tokens[path[1:]], verdict.bonus).astype(np.int64)
        own = tree.max_depth if self._depth is None else self._depth
        s = max(0, own - verdict.accepted)
        self.record.chunks.append((nxt, features.taps, top.indices.int(), lps, float(s)))
        self._w_iters += 1
        self._w_tokens += verdict.accepted + 1
        if self._w_iters >= self.cfg.window:
            self._close_window()

    def wait(self, timeout: float = 60.0) -> bool:
        """Let the update in flight land and swap it in (tests, benchmarks, shutdown; serving
        never calls it). True when nothing is left in flight."""
        if self.busy:
            try:
                self._results.put(self._results.get(timeout=timeout))  # peek: _poll takes it
            except queue.Empty:
                return False
            self._poll()
        return not self.busy

    def close(self) -> None:
        """Stop the worker (an update in flight finishes first)."""
        if self._worker is not None:
            self._jobs.put(None)
            self._worker.join(timeout=60)
            self._worker = None
        self._give_back_cores()

    # ------------------------------------------------------------------ serving side
    def _rebuild_cache(self) -> None:
        """Re-run the committed context through the new weights (as a prefill does)."""
        self._rebuild = False
        if self.record is None:
            return
        tokens, taps = self.record.tokens_and_taps()
        self.inner.prefill(tokens, None if taps is None else TargetOutput(torch.empty(0), taps=taps))

    def _load_inf(self, state: dict) -> None:
        params = dict(self.theta_inf.named_parameters())
        with torch.no_grad():
            for n, t in state.items():
                params[n].copy_(t)
        for name, mod in self.theta_inf.named_modules():
            if served(mod) and (f"{name}.weight" in state or f"{name}.bias" in state):
                mod.repack()
        self._rebuild = True

    def _poll(self) -> bool:
        """Swap in a finished update, if any (never waits). True when the weights changed."""
        try:
            res: _Result = self._results.get_nowait()
        except queue.Empty:
            return False
        self.busy = False
        self._give_back_cores()
        self.update_s[res.arm].append(res.seconds)
        p = self.pending
        if res.error is not None:
            self.failures += 1
            log.warning("adaptation: the %s update failed (%s); serving goes on with the current drafter",
                        res.arm, res.error)
        elif res.generation != self.generation:  # trained from weights a rollback has since removed
            self.stale += 1
            self.pending = None  # not the arm's fault: the bandit learns nothing from it
            return False
        else:
            previous = self.master
            with self._lock:
                self.master = {**previous, **res.state}
                self.backbone_version += res.arm == "full"
            self._load_inf(res.state)
            self.rollback.on_update(previous=previous)
            self.swaps += 1
            if p is not None:
                p.cost_s, p.applied_at = res.seconds, self.win
            return True
        if p is not None:  # a failed update: its cost was paid, nothing gained
            wall = self.windows[-1]["wall_s"] if self.windows else 1.0
            self.bandit.update(p.arm, 0.0, res.seconds / max(wall, 1e-9))
            self.pending = None
        return False

    def _close_window(self) -> None:
        now = self.clock()
        wall = now - (self._t_win or now)
        tau, tps = self._w_tokens / self._w_iters, self._w_tokens / max(wall, 1e-9)
        metric = tau if self.cfg.gain == "tau" else tps
        rec = {"window": self.win, "tau": round(tau, 4), "tokens_per_s": round(tps, 3), "wall_s": round(wall, 4),
               "iterations": self._w_iters, "swaps": self.swaps, "judged": None, "gain": None, "cost": None}
        p = self.pending
        decision = self.rollback.observe(tau)
        # An arm is judged on the first whole window after its update landed, or at once when
        # the rollback condemns it (after that the restored drafter serves, not the update).
        if p is not None and p.applied_at is not None and (p.applied_at < self.win or decision == "rollback"):
            gain, cost = (metric - p.before) / max(p.before, 1e-9), p.cost_s / max(wall, 1e-9)
            rec.update(judged=p.arm, gain=round(gain, 5), cost=round(cost, 5))
            self.bandit.update(p.arm, gain, cost)
            self.pending = None
        rec["rollback"] = decision
        if decision == "rollback":
            with self._lock:
                self.master = self.rollback.good_version
                self.generation += 1
                self.backbone_version += 1
            self._load_inf(self.master)
        rec["arm"] = None
        if self.pending is None and not self.busy:
            hist = [w["tau" if self.cfg.gain == "tau" else "tokens_per_s"] for w in self.windows[-2:]]
            ref = float(np.mean(hist + [metric]))
            arm = rec["arm"] = self.bandit.select()
            self.played[arm] += 1
            if arm == "skip":
                self.pending = _Pending(arm, ref, 0.0, applied_at=self.win)
            else:
                self.pending = _Pending(arm, ref)
                self.busy = True
                self._share_cores()
                if self._worker is None:
                    self._worker = threading.Thread(target=self._work, name="specblock-adapt", daemon=True)
                    self._worker.start()
                self._jobs.put((arm, self.generation))
        self.windows.append(rec)
        self.win += 1
        self._w_iters = self._w_tokens = 0
        self._t_win = now
        if self.on_window is not None:
            self.on_window(rec)

    def _share_cores(self) -> None:
        """Serving's threads down to the cores the worker leaves, for the update about to start
        (CPU only: a CUDA update runs on its own stream)."""
        if next(self.theta_train.parameters()).device.type != "cpu":
            return
        n, cores = torch.get_num_threads(), available_cores()
        if n + self.cfg.threads > cores and n > 1:
            self._serve_threads = n
            torch.set_num_threads(max(1, cores - self.cfg.threads))

    def _give_back_cores(self) -> None:
        if self._serve_threads is not None:
            torch.set_num_threads(self._serve_threads)
            self._serve_threads = None

    # ------------------------------------------------------------------ training side
    def _work(self) -> None:
        torch.set_num_threads(self.cfg.threads)  # OpenMP: this thread only
        dev = next(self.theta_train.parameters()).device
        stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        while (job := self._jobs.get()) is not None:
            arm, generation = job
            t0 = self.clock()
            try:
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    state = self.train_step(arm)
                    if stream is not None:
                        stream.synchronize()  # the worker waits for its kernels, never serving
                self._results.put(_Result(arm, generation, self.clock() - t0, state))
            except Exception as e:  # noqa: BLE001 - any failure must leave serving running
                self._results.put(_Result(arm, generation, self.clock() - t0, error=f"{type(e).__name__}: {e}"))

    def train_step(self, arm: str) -> dict:
        """One update of ``arm`` (``adapt_update.UpdateTrainer.step``) on a snapshot of the buffer
        and the serving weights; the lock only covers copying references."""
        with self._lock:
            records, master, bb = list(self.buffer), self.master, self.backbone_version
        return self.trainer.step(arm, records, master, bb)
