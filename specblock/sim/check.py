"""Acceptance-side check of the sim against one runtime trace: tree sizes and tau, no timings.

``python -m specblock.sim check-traces T.jsonl [--method specblock|lookup] [--set method.K=4]``
fits the sim's acceptance model from the trace (or, for lookup, replays it), drafts ``trees``
synthetic trees with the same method settings, and puts the runtime's and the sim's tree size,
share of root-only trees and tau side by side. Nothing here depends on how busy the machine was
when the trace was taken, so it is the check to run when timings cannot be trusted.

Method settings default to the runtime's (``specblock/runtime/config.py``: M = 2, max_seeds = 2,
budget = 24, widths (2, 4, 10, 0)); K is the drafter's (4 for the shipped one). A bench variant
needs its own settings, e.g. ``--set method.widths=[2,2,2,2]`` for ``specblock@topk2``.
"""

from __future__ import annotations

import numpy as np

from specblock.sim.config import SimConfig, build_method
from specblock.sim.traces import read_traces

#: The runtime's SpecBlock serving defaults (RunConfig), kept here so the sim needs no runtime import.
RUNTIME_SPECBLOCK = {"K": 4, "M": 2, "max_seeds": 2, "budget": 24, "widths": [2, 4, 10, 0]}


def check_traces(paths: list[str], method: dict | None = None, trees: int = 20000, seed: int = 0) -> dict:
    """Runtime vs sim, per the module doc. ``method`` overrides the sim's method section."""
    from specblock.sim.engine import AcceptanceSource

    m = dict(method or {})
    if m.get("name", "specblock") == "specblock":
        m = {**RUNTIME_SPECBLOCK, **m, "name": "specblock"}
    cfg = SimConfig.model_validate({"method": m, "acceptance": {"kind": "traces", "traces": list(paths)},
                                    "tree_pool": 0, "seed": seed})
    source = AcceptanceSource(cfg, "none")
    model, drafter = source.base(cfg.acceptance.benchmark), build_method(cfg.method)
    rng = np.random.default_rng(seed)
    drafts = [drafter.draft(rng, model) for _ in range(trees)]
    recs = read_traces(paths)
    rt_size = np.array([r.tree_size for r in recs], dtype=float)
    rt_acc = np.array([r.accepted for r in recs], dtype=float)
    sim_size = np.array([d.tree.size for d in drafts], dtype=float)
    sim_acc = np.array([d.acceptance.accepted for d in drafts], dtype=float)
    side = lambda size, acc: {"iterations": int(size.size), "tree_size": round(float(size.mean()), 3),
                              "root_only": round(float((size == 1).mean()), 4), "tau": round(1 + float(acc.mean()), 4),
                              "accepted_hist": np.bincount(acc.astype(int), minlength=4)[:8].tolist()}
    rt, sim = side(rt_size, rt_acc), side(sim_size, sim_acc)
    return {"traces": list(paths), "method": cfg.method.model_dump(include=set(m)), "runtime": rt, "sim": sim,
            "tree_err": round(sim["tree_size"] / rt["tree_size"] - 1, 4), "tau_err": round(sim["tau"] / rt["tau"] - 1, 4),
            "notes": source.notes}
