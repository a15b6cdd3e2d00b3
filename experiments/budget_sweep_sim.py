"""Node budgets swept in the simulator, from one bench's traces, before a real run tries the winners.

The workflow the simulator is for: a bench at the served settings writes traces; the sim, fitted on
them exactly as ``sim_fidelity.py`` fits it (acceptance from each (method, domain)'s traces, latency
from the other domains' traces, leave-one-domain-out, compiled rows against the compiled ``ar``
row), then predicts each method at other node budgets; a second real bench checks the predictions.
This is where a cheap sweep pays: the compiled target's trees cost relatively more than eager ones
(a 5-node tree 1.49x a 1-node one, against 1.17x eager), so the eager sweep's budgets need not
carry over, and budget 1 was never measured on it.

Each row is the sim's decode-loop Spd over the bench's plain decoding (for compiled rows, the
compiled ``ar`` row), mean over the domains, and tau. Budgets above the served one draft positions
the traces saw less often (or never, deeper than the served trees): the acceptance fit has fewer
observations there, so those predictions lean more on its prior. A ``METHOD+lookup`` row's budget
is the whole tree's, lookup's branch included (served: the drafter's budget plus the branch's 3
nodes); its chains are replayed from the row's traces (``specblock/sim/lookup.py``).
``--lookup-nodes`` also moves the branch's share: the row's own traces hold chains only as long as
the served branch, so longer ones need ``--chains-from lookup``, the chains of the bench's plain
``lookup`` row (the same n-gram rule and, the outputs being identical, the same text; up to its
depth, 8, and at the positions that method visited rather than the branch's).

    python experiments/budget_sweep_sim.py --bench experiments/results/bench_smollm2_packed_fastlookup.json \\
        --traces runs/traces_smollm2_packed --latency specblock/sim/data/latency_cpu_smollm2_packed_fp16.json \\
        --methods specblock+lookup,eagle3+lookup --budgets 3,4,6,8,10 --lookup-nodes 2,3,4,6,8 --chains-from lookup \\
        --out experiments/results/budget_sweep_sim_lookup_nodes

    python experiments/budget_sweep_sim.py --bench experiments/results/bench_smollm2_compiled_traced.json \\
        --traces runs/traces_smollm2_compiled --latency specblock/sim/data/latency_cpu_smollm2_packed_fp16_compiled.json \\
        --budgets 1,2,3,4,6 --out experiments/results/budget_sweep_sim_compiled
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sim_fidelity as sf  # noqa: E402

from specblock.sim.latency import load_measurements  # noqa: E402


def sweep(bench_path: Path, trace_dir: Path, latency_path: Path, budgets: list[int], requests: int,
          n_seeds: int, tree_pool: int, methods: list[str] | None = None, lookup_nodes: list[int] | None = None,
          chains_from: str | None = None) -> dict:
    bench = json.loads(bench_path.read_text())
    cfg = bench["config"]
    rows_in = {(r["method"], r["domain"]): r for r in bench["rows"]}
    meas_lat = load_measurements(latency_path)
    prompts, warnings = int(cfg.get("prompts", 1)), []
    jobs, skipped = sf._jobs(rows_in, cfg, trace_dir, meas_lat, prompts, warnings, True)
    sim = dict(requests=requests, n_seeds=n_seeds, tree_pool=tree_pool, seed=0)
    out = []
    with tempfile.TemporaryDirectory(prefix="budget_sweep_") as td:
        # every method's traces price the tree forward, lookup's too: its 1-node and 9-node trees are
        # what pins the cost per node (fitted on the served 3-5-node trees alone, larger trees came free)
        sf.trace_latencies(jobs, trace_dir, meas_lat, prompts, Path(td), warnings)
        jobs = [j for j in jobs if j["method_cfg"]["name"] != "lookup"]  # a replay: no budget to move
        if methods:
            jobs = [j for j in jobs if j["method"] in methods]
            if not jobs:
                raise ValueError(f"--methods {','.join(methods)}: no such row with traces in the bench")
        for method in dict.fromkeys(j["method"] for j in jobs):
            mine = [j for j in jobs if j["method"] == method]
            served, served_nodes = mine[0]["method_cfg"]["budget"], mine[0]["method_cfg"].get("lookup_nodes")
            if served_nodes and chains_from:
                mine = [dict(j, lookup_traces=[_chains(trace_dir, chains_from, j["domain"], prompts, Path(td))]) for j in mine]
            for nodes, b in itertools.product(lookup_nodes if served_nodes and lookup_nodes else [served_nodes], budgets):
                moved = [dict(j, method_cfg=dict(j["method_cfg"], budget=b, **({"lookup_nodes": nodes} if nodes else {})))
                         for j in mine]
                rows = sf._simulate(moved, rows_in, latency_path, meas_lat, Path(td), skipped, sim)
                out.append({"method": method, "lookup_nodes": nodes, "budget": b, "served": b == served and nodes == served_nodes,
                            "spd_sim": round(float(np.mean([r["spd_sim"] for r in rows])), 4),
                            "tau_sim": round(float(np.mean([r["tau_sim"] for r in rows])), 4),
                            "tree_sim": round(float(np.mean([r["tree_sim"] for r in rows])), 2),
                            "spd_meas_served": round(float(np.mean([r["spd_meas"] for r in rows])), 4),
                            "baseline": mine[0]["baseline"], "domains": [r["domain"] for r in rows]})
                print(f"{_label(out[-1])} budget {b}: Spd {out[-1]['spd_sim']:.3f}x tau {out[-1]['tau_sim']:.2f}", flush=True)
    return {"inputs": {"bench": str(bench_path), "traces": str(trace_dir), "latency": str(latency_path),
                       "budgets": budgets, "requests": requests, "n_seeds": n_seeds, "tree_pool": tree_pool,
                       "methods": methods, "lookup_nodes": lookup_nodes, "chains_from": chains_from},
            "rows": out, "warnings": warnings, "skipped": [s["method"] + "/" + s["domain"] for s in skipped]}


def _chains(trace_dir: Path, method: str, domain: str, prompts: int, tmp: Path) -> Path:
    """The last ``prompts`` generations of ``method``'s traces in ``domain`` (a bench appends)."""
    src = trace_dir / f"{method}.{domain}.jsonl"
    if not src.is_file():
        raise FileNotFoundError(f"--chains-from {method}: no traces at {src}")
    dst = tmp / f"chains.{method}.{domain}.jsonl"
    dst.write_text("\n".join(sf.read_generations(src, prompts)[0]) + "\n")
    return dst


def _label(r: dict) -> str:
    return r["method"] if not r.get("lookup_nodes") else f"{r['method']} ({r['lookup_nodes']} lookup nodes)"


def markdown(res: dict, cmd: str) -> str:
    budgets = res["inputs"]["budgets"]
    methods = list(dict.fromkeys(_label(r) for r in res["rows"]))
    get = {(_label(r), r["budget"]): r for r in res["rows"]}
    base = sorted({r["baseline"] for r in res["rows"]})
    lines = [f"Node budgets in the simulator, fitted on `{res['inputs']['bench']}`'s traces (`{cmd}`). Cells: simulated "
             f"decode-loop Spd over {', '.join(base)} / tau, mean of the domains; * the served budget, whose measured "
             "Spd is in the last column." + (f" Lookup's chains from the `{res['inputs']['chains_from']}` row's traces."
                                              if res["inputs"].get("chains_from") else ""), "",
             "| method | " + " | ".join(f"budget {b}" for b in budgets) + " | measured at the served budget |",
             "|---" * (len(budgets) + 2) + "|"]
    for m in methods:
        cells = []
        for b in budgets:
            r = get[m, b]
            cells.append(f"{r['spd_sim']:.2f}x / {r['tau_sim']:.2f}{' *' if r['served'] else ''}")
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {get[m, budgets[0]]['spd_meas_served']:.2f}x |")
    lines += [f"\nWarning: {w}" for w in res["warnings"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench", type=Path, required=True)
    ap.add_argument("--traces", type=Path, required=True)
    ap.add_argument("--latency", type=Path, required=True, help="calibrate's JSON (its SpecBlock drafter curve is used)")
    ap.add_argument("--budgets", default="1,2,3,4,6")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--n-seeds", type=int, default=3)
    ap.add_argument("--tree-pool", type=int, default=1024)
    ap.add_argument("--methods", default=None, help="only these bench methods (comma-separated)")
    ap.add_argument("--lookup-nodes", default=None, help="METHOD+lookup rows: also move the branch's share (comma-separated)")
    ap.add_argument("--chains-from", default=None, help="METHOD+lookup rows: lookup's chains from this bench method's "
                    "traces (e.g. lookup, whose chains run deeper than the branch's) instead of the row's own")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    budgets = [int(x) for x in a.budgets.split(",")]
    nodes = [int(x) for x in a.lookup_nodes.split(",")] if a.lookup_nodes else None
    try:
        res = sweep(a.bench, a.traces, a.latency, budgets, a.requests, a.n_seeds, a.tree_pool,
                    a.methods.split(",") if a.methods else None, nodes, a.chains_from)
    except (FileNotFoundError, KeyError, ValueError) as e:
        print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    cmd = (f"python experiments/budget_sweep_sim.py --bench {a.bench} --traces {a.traces} --latency {a.latency}"
           f"{f' --methods {a.methods}' if a.methods else ''} --budgets {a.budgets}"
           f"{f' --lookup-nodes {a.lookup_nodes}' if a.lookup_nodes else ''}"
           f"{f' --chains-from {a.chains_from}' if a.chains_from else ''} --out {a.out}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    a.out.with_suffix(".md").write_text(markdown(res, cmd))
    print(markdown(res, cmd), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
