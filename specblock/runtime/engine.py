"""The one decode loop: draft, verify, commit, tell the drafter. Every method runs through it.

State between iterations: the target's cache holds every committed token but the last, which
is the next tree's root (the previous bonus token, or the last prompt token). Plain decoding is
the same loop with a root-only tree.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Callable, TextIO

import numpy as np
import torch

from specblock.errors import SpecBlockError
from specblock.policies.tree import DraftTree
from specblock.runtime.drafters.base import DraftRequest, Drafter
from specblock.runtime.metrics import DecodeStats
from specblock.runtime.target import TargetModel
from specblock.runtime.verify import GreedyVerifier, Verdict, Verifier


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens only
    stats: DecodeStats
    stopped: str  # "eos", "max_new_tokens", "context" or "cancelled" (on_tokens returned False)


@dataclass
class Engine:
    target: TargetModel
    drafter: Drafter
    verifier: Verifier = field(default_factory=GreedyVerifier)
    budget: int = 24  # draft nodes per tree (root excluded)
    eos_ids: frozenset[int] = frozenset()
    trace: TextIO | None = None  # per-iteration JSONL, when set
    trace_domain: str | None = None  # written into each trace record (the sim fits per domain)
    on_iteration: list[Callable[[DraftTree, Verdict], None]] = field(default_factory=list)
    #: The tree sizes a compiled target compiles before it serves, where measured (a drafter's
    #: ``serving.json``, ``warm_sizes``); None: every size the drafter can propose (``tree_sizes``).
    warm_sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        self._cuda = self.target.device.type == "cuda"

    def _now(self) -> float:
        if self._cuda:  # kernels are async: time what the GPU did, not what was queued
            torch.cuda.synchronize(self.target.device)
        return time.perf_counter()

    def _point_target(self) -> None:
        self.target.want_features = self.drafter.needs_features  # engines may share one target
        taps = getattr(self.drafter, "tap_layers", None)  # ... so each drafter's own taps, per generate
        if taps is not None:
            self.target.tap_layers = tuple(taps)

    def warm_compiled(self) -> list[int]:
        """Compile (or load) every shape this engine can meet at the first span, before anything is
        timed or served: the compiled target's buckets of the tree sizes the drafter proposes under
        the budget (``warm``, ``Drafter.tree_sizes``, or the measured ``warm_sizes``: other sizes pad
        up to the next one warmed) and a compiled drafter's steps (its ``warm``, under a lookup
        branch too). Duck-typed, so the runtime needs nothing from ``specblock.compiled``; an eager
        target and drafter warm nothing.
        Returns the target's buckets warmed."""
        inner = getattr(self.drafter, "inner", self.drafter)
        drafter_warm = inner.warm if callable(getattr(inner, "warm", None)) else None
        if not callable(getattr(self.target, "warm", None)):
            if drafter_warm is not None:
                drafter_warm()
            return []
        self._point_target()  # the graphs depend on the features and taps this drafter reads
        # the drafter's steps compile while the target's helper processes (if any) finish theirs
        top = self.drafter.max_tree(self.budget)
        # measured sizes, and the largest tree this budget allows (a user's larger budget): none outgrows them
        sizes = (*self.warm_sizes, top) if self.warm_sizes is not None else self.drafter.tree_sizes(self.budget)
        return self.target.warm(top, sizes, then=drafter_warm)

    def generate(
        self,
        prompt_ids: list[int] | np.ndarray,
        max_new_tokens: int,
        seed: int = 0,
        on_tokens: Callable[[list[int]], bool | None] | None = None,
    ) -> GenerationResult:
        prompt = np.asarray(prompt_ids, dtype=np.int64)
        if prompt.size == 0:
            raise SpecBlockError("the prompt is empty; give at least one token")
        if max_new_tokens < 1:
            raise SpecBlockError("max_new_tokens must be at least 1")
        limit = self.target.max_context
        if prompt.size >= limit:
            raise SpecBlockError(
                f"the prompt has {prompt.size} tokens but the model's context is {limit}; shorten the prompt"
            )
        self.verifier.reset(seed)
        self.drafter.reset()
        self._point_target()
        stats = DecodeStats()
        t0 = self._now()
        feats = self.target.prefill(prompt[:-1])
        self.drafter.prefill(prompt, feats)
        t1 = self._now()
        stats.prefill_s = t1 - t0

        tokens = list(prompt.tolist())
        new: list[int] = []
        stopped = "max_new_tokens"
        while True:
            ta = self._now()
            # The sequence may grow to `limit` tokens: accepted drafts plus the bonus fill the room
            # left, so no draft deeper than room - 1 can ever be used.
            room = limit - len(tokens)
            req = DraftRequest(tokens=np.asarray(tokens, dtype=np.int64), budget=self.budget, max_depth=room - 1)
            tree = self.drafter.propose(req)
            if tree.max_depth > room - 1 or tree.size - 1 > self.budget:
                tree = _fit(tree, room - 1, self.budget)
                tree.meta.pop("cuts", None)  # its node ids refer to the uncut tree
            tb = self._now()
            out = self.target.tree_forward(tree)
            verdict = self.verifier.verify(tree, out.logits)
            tc = self._now()
            self.target.commit(verdict.path)
            feats = out.rows(verdict.path) if self.drafter.needs_features else None
            self.drafter.accept(tree, verdict, feats)
            emitted = tree.tokens[verdict.path[1:]].tolist() + [verdict.bonus]
            td = self._now()
            for hook in self.on_iteration:
                hook(tree, verdict)

            stats.draft_s += tb - ta
            stats.verify_s += tc - tb
            stats.commit_s += td - tc
            stats.accepted.append(verdict.accepted)
            stats.tree_depth.append(tree.max_depth)
            stats.tree_size.append(tree.size)
            if self.trace is not None:
                self._write_trace(stats, tree, verdict, len(tokens) - 1, tb - ta, tc - tb, td - tc, out.logits)

            for i, tok in enumerate(emitted):
                if tok in self.eos_ids:
                    emitted, stopped = emitted[: i + 1], "eos"
                    break
            if len(new) + len(emitted) >= max_new_tokens:
                emitted, stopped = emitted[: max_new_tokens - len(new)], "max_new_tokens"
            emitted = emitted[:room]
            new.extend(emitted)
            tokens.extend(emitted)
            # The one cancellation seam: a caller that returns False (a client gone, a stop string
            # matched) ends the loop between iterations, leaving the engine ready for the next prompt.
            if on_tokens is not None and emitted and on_tokens(emitted) is False:
                stopped = "cancelled"
                break
            if stopped == "eos" or len(new) >= max_new_tokens:
                break
            if len(tokens) >= limit:
                stopped = "context"
                break
        t_end = self._now()
        stats.loop_s = t_end - t1
        stats.wall_s = t_end - t0
        stats.new_tokens = len(new)
        return GenerationResult(token_ids=new, stats=stats, stopped=stopped)

    def _write_trace(self, stats, tree: DraftTree, verdict: Verdict, ctx: int, ds, vs, cs, logits) -> None:
        rec = {
            "iter": stats.iterations - 1,
            "ctx": ctx,
            "tree_size": tree.size,
            "depth": tree.max_depth,
            "accepted": verdict.accepted,
            "draft_s": ds,
            "verify_s": vs,
            "commit_s": cs,
            "domain": self.trace_domain,
            "nodes": {
                "parent": tree.parent.tolist(),
                "depth": tree.depth.tolist(),
                "rank": tree.rank.tolist(),
                "bucket": tree.bucket.tolist(),
                "block": tree.block.tolist(),
                "correct": None if verdict.correct is None else verdict.correct.astype(int).tolist(),
            },
        }
        if "cuts" in tree.meta:  # positions the drafter's rank head ended (not on the tree)
            rec["cuts"] = tree.meta["cuts"]
        pos = tree.meta.get("positions")
        if pos is not None and len(pos["node"]):  # the target's rank among each expanded node's candidates
            node = np.asarray(pos["node"], dtype=np.int64)
            rows = logits[torch.as_tensor(node, device=logits.device)]
            target = rows.max(-1).indices.cpu().numpy()  # the verifier's tie rule
            hit = np.asarray(pos["ids"]) == target[:, None]
            rec["positions"] = {"node": node.tolist(),
                                "logp": np.round(np.asarray(pos["logp"], np.float64), 4).tolist(),
                                "target_rank": np.where(hit.any(1), hit.argmax(1), -1).tolist()}
            for key in ("block", "pos", "bucket"):  # SpecBlock: which in-block position, the rank head's bucket
                if key in pos:
                    rec["positions"][key] = np.asarray(pos[key]).tolist()
        self.trace.write(json.dumps(rec) + "\n")


def _fit(tree: DraftTree, max_depth: int, budget: int) -> DraftTree:
    """Cut a drafter's tree to the context limit and the node budget (lowest indices win,
    which keeps the drafter's own order and ancestor closure)."""
    keep = tree.depth <= max_depth
    keep &= np.cumsum(keep) <= budget + 1
    keep = ~(tree.ancestor_mask & ~keep[None, :]).any(axis=1)
    return tree.subtree(keep)[0]
