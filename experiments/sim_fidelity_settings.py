"""What the bench's engine ran, in the simulator's terms, for ``experiments/sim_fidelity.py``: each
method's settings (the bench's ``--set`` items, then the drafter's ``serving.json`` and config,
from the drafters shipped for the bench's target), whether a row ran compiled, and the plain
decoding its Spd is judged against."""

from __future__ import annotations

import json
from pathlib import Path

from specblock.models.registry import MODELS, drafters_dir
from specblock.runtime.config import DEFAULT_DRAFTERS
from specblock.runtime.drafters import DEFAULT_BUDGET, over_serving
from specblock.runtime.drafters.lookup_branch import DEFAULT_NODES, SUFFIX, has_lookup
from specblock.sim.lookup import chain_of, drafter_part
from specblock.sim.traces import TraceRecord

#: runtime method -> sim method model name = drafter key in the latency JSON (calibrate writes
#: "specblock"; lookup has no drafter forward). Methods absent here have no sim model.
SIM_METHOD = {"specblock": "specblock", "eagle3": "eagle3", "medusa": "medusa", "sps": "sps", "lookup": "lookup"}


def sim_name(method: str) -> str | None:
    """The sim's model of a bench method, None if it has none: ``specblock@m1`` (a label) is
    SpecBlock's, ``eagle3+lookup`` EAGLE-3's with the lookup branch (``method.lookup_nodes``)."""
    base = method.split("@")[0]
    return SIM_METHOD.get(base.removesuffix(SUFFIX) if has_lookup(method) else base)


def bench_sets(cfg: dict, method: str) -> dict:
    """The bench's ``--set METHOD:KEY=VALUE`` items for ``method``, parsed as ``bench._options`` does."""
    out = {}
    for item in cfg.get("set") or []:
        m, _, kv = item.partition(":")
        k, _, v = kv.partition("=")
        if m == method and k:
            out[k] = tuple(int(x) for x in v.split(",")) if k == "widths" else (int(v) if v.lstrip("-").isdigit() else v)
    return out


def compiled(cfg: dict, method: str) -> bool:
    """Whether the bench ran ``method`` on the compiled target (``--compile``, or ``--set M:compiled=true``)."""
    return bool(cfg.get("compile")) or bool(((cfg.get("method_options") or {}).get(method) or {}).get("compiled"))


def baseline(cfg: dict, methods: list[str], method: str) -> str:
    """The plain decoding ``method`` is judged against: ``ar``, except for a compiled method in a
    bench that ran ``ar`` eager and also a compiled ``ar`` row (``ar@c``): that row. Why: the sim
    prices plain decoding and a 1-node tree by one target, so a compiled method judged against
    eager ``ar`` was charged ``ar``'s eager 16 ms for each of its compiled 8 ms one-node trees
    (prompt lookup finds no match for half its iterations: Spd -17% to -22%)."""
    if compiled(cfg, method) and not compiled(cfg, "ar"):
        for m in methods:
            if m.split("@")[0] == "ar" and m != "ar" and compiled(cfg, m):
                return m
    return "ar"


def drafter_root(cfg: dict) -> Path:
    """Where the bench's engine found its drafters: ``--drafter-dir``, else those shipped for its
    target. Why not always the lab's: a real-model bench read the lab drafters' serving.json and
    config.json, and the sim grew EAGLE-3 trees of 41 nodes where the runtime served 3. A bench
    JSON without a target is from before the real model was the default: the lab model's."""
    if cfg.get("drafter_dir"):
        return Path(cfg["drafter_dir"])
    target = cfg.get("target")
    if target is None:
        return DEFAULT_DRAFTERS
    if str(target) in MODELS:
        return MODELS[str(target)].drafters
    return drafters_dir(Path(target)) if Path(target).is_dir() else DEFAULT_DRAFTERS


def sim_method(method: str, cfg: dict) -> tuple[dict, list[str]]:
    """The sim's ``method`` section with the settings the runtime engine used, and notes. With
    lookup's branch, as the bench's engine set it (``lookup_branch.with_branch``): the drafter's
    measured budget stays its own and the chain comes on top; a budget the bench gave is the whole
    tree's, shared, unless ``lookup_on_top`` was set."""
    d, notes = _drafter_method(method, cfg)
    if has_lookup(method):
        sets = bench_sets(cfg, method)
        d["lookup_nodes"] = int(sets.get("lookup_nodes") or DEFAULT_NODES)
        on_top = ((cfg.get("method_options") or {}).get(method) or {}).get("lookup_on_top")  # as the bench parsed it
        if on_top or not (sets.get("budget") or cfg.get("budget")):
            d["lookup_on_top"] = True
    return d, notes


def _drafter_method(method: str, cfg: dict) -> tuple[dict, list[str]]:
    name, sets, notes = sim_name(method), bench_sets(cfg, method), []
    root = drafter_root(cfg)
    served = serving(sets.get("drafter") or root / name, cfg.get("dtype"), compiled(cfg, method))
    # the engine's order: --set METHOD:budget, --budget, the drafter's serving.json, the default
    budget = int(sets.get("budget") or cfg.get("budget") or served.get("budget") or DEFAULT_BUDGET)
    if name == "lookup":  # the replay carries the runtime's ngram / lookup_depth / branches as run
        return {"name": "lookup"}, notes
    if name != "specblock":  # the runtime's serving settings: bench --set, else the drafter's config
        d = {"name": name, "budget": budget, **{k: v for k, v in sets.items() if k in ("depth", "top_k", "gamma")}}
        if name == "sps":
            d.setdefault("gamma", 4)  # the runtime's default (a chain: top_k 1)
        else:
            ddir = sets.get("drafter") or root / name
            conf = Path(ddir) / "config.json"
            raw = json.loads(conf.read_text()) if conf.is_file() else {}
            if not raw:
                notes.append(f"{conf} not found: the sim's defaults for {name}")
            if name == "eagle3":  # the drafter's serving settings, else Eagle3Config's defaults
                from specblock.runtime.drafters.eagle3 import Eagle3Config

                for k in ("depth", "top_k"):
                    d.setdefault(k, int(raw.get(k, Eagle3Config.model_fields[k].default)))
            elif name == "medusa":  # the static tree the runtime verified: its heads, top-k and table
                if "heads" in raw:
                    d["heads"] = int(raw["heads"])
                if "top_k" in raw:
                    d["medusa_top_k"] = int(raw["top_k"])
                if raw.get("rank_acc") is not None:
                    d["rank_acc"] = raw["rank_acc"]
                elif raw:  # the runtime then ranks paths by its prior table: the sim must verify that tree too
                    from specblock.runtime.drafters.medusa import MedusaConfig

                    table = MedusaConfig.model_validate({k: v for k, v in raw.items() if k != "kind"}).accuracy_table()
                    d["rank_acc"] = table.tolist()
                    notes.append(f"{conf} has no rank_acc: the runtime's prior table, as the runtime ran it")
        return d, notes
    ddir = sets.get("drafter") or root / "specblock"
    conf = Path(ddir) / "config.json"
    k = json.loads(conf.read_text()).get("K", 4) if conf.is_file() else 4
    if not conf.is_file():
        notes.append(f"{conf} not found: K=4 assumed")
    return {"name": "specblock", "K": int(k), "M": int(sets.get("M", served.get("M", 2))),
            "max_seeds": int(sets.get("max_seeds", served.get("max_seeds", 2))),
            "widths": list(sets.get("widths", served.get("widths", (2, 4, 10, 0)))), "budget": budget, "branching": "rank",
            "seeds": "deepest-confident", "use_rank_head": True, **user_policies(over_serving(served, sets))}, notes


def serving(drafter_dir: str | Path, dtype: str | None = None, compiled_target: bool = False) -> dict:
    """The drafter's measured best serving settings (serving.json beside it), as the engine reads
    them: its ``overrides`` for the bench's dtype and compiled target applied
    (``drafters.serving_settings``)."""
    from types import SimpleNamespace

    from specblock.runtime.drafters import read_serving

    return read_serving(Path(drafter_dir) / "serving.json", SimpleNamespace(dtype_name=dtype, compiled=compiled_target))


def user_policies(sets: dict) -> dict:
    """A bench row's own classes (``--set M:policy=pkg.mod:Class``, ``policy_kwargs=JSON``, likewise
    ``seed_policy``) in the sim's spelling: the sim then grows the trees the runtime grew."""
    out = {}
    for key, cls_key, kw_key in (("policy", "policy_class", "policy_kwargs"), ("seed_policy", "seed_class", "seed_kwargs")):
        if sets.get(key):
            kw = sets.get(f"{key}_kwargs") or {}
            out.update({cls_key: sets[key], kw_key: json.loads(kw) if isinstance(kw, str) else dict(kw)})
    return out


def drafter_share(rec: TraceRecord, method_cfg: dict) -> tuple[TraceRecord, dict]:
    """The drafter's part of an iteration and its settings for it: with lookup's branch, the
    record without the chain's nodes, and the drafter's own budget (on top) or the whole budget
    less the chain (shared; ``sim/lookup.py``)."""
    if not method_cfg.get("lookup_nodes"):
        return rec, method_cfg
    size = min(chain_of(rec)[0], method_cfg["lookup_nodes"])
    own = method_cfg["budget"] if method_cfg.get("lookup_on_top") else method_cfg["budget"] - size
    return drafter_part(rec), {**method_cfg, "budget": own, "lookup_nodes": 0, "lookup_on_top": False}


def depthwise_forwards(rec: TraceRecord, method_cfg: dict) -> int:
    """Drafter forwards of one iteration of a depth-by-depth drafter, by the runtime's rule:
    Medusa's heads run one forward in all; SpS one per depth of its chain (the trace's depth);
    EAGLE-3 one per depth it expands, however deep the tree is after its final rerank (the trace's
    depth, which the rerank cut to 3-5 of 6 here, overstated its ms per forward by a third)."""
    if method_cfg["name"] == "medusa":
        return 1
    rec, method_cfg = drafter_share(rec, method_cfg)
    if method_cfg.get("budget") is not None and method_cfg["budget"] < 1:  # lookup's chain took every node
        return 0
    if method_cfg["name"] == "eagle3" and method_cfg.get("depth"):
        return expanded_depth(method_cfg)
    return max(int(rec.depth), 1)


def expanded_depth(method_cfg: dict) -> int:
    """The depths EAGLE-3 expands per iteration: its configured depth, cut to the node budget
    where the final rerank could keep nothing deeper (``policies.branching.rerank_limits``, the
    runtime's and the sim's rule). Why: counting the configured 6 at the served budget of 2, where
    both expand 2, priced each forward at a third of its cost, and the sim's EAGLE-3 drafted for
    1.1 ms where the runtime took 3.2-4.4 (a real-model bench, Spd +7% to +19%)."""
    from specblock.policies.branching import rerank_limits
    from specblock.sim.config import MethodCfg, build_method

    d = build_method(MethodCfg(**{k: v for k, v in method_cfg.items() if k in MethodCfg.model_fields}))
    return int(rerank_limits(d.policy, d.seeds, d.budget, d.depth)[0])
