"""Issue 18's goal: the simulator's tau for a user's policy class against the tau measured live.

Per SpecBlock row of a bench JSON (the default rank-bucket widths and any ``--set
NAME:policy=...`` row) and per domain, the sim runs the row's own settings (budget, M, seeds, the
policy class and kwargs, K from the drafter's config; ``sim_fidelity.sim_method``) with
acceptance fitted from traces two ways:

* ``pred``: the *default policy's* traces (``--fit-traces``, a bench of plain ``specblock``, the
  traces step 1 of examples/README.md writes). This is the prediction a user has before running
  the class live: what the sweep optimised;
* ``self``: the row's own run-1 traces (``--traces``), as ``sim_fidelity.py`` judges every method.

and reports tau measured vs simulated (error = sim / measured - 1, goal |error| <= 5%), per
domain and for the mean over domains (the bench table's Mean column), with tree sizes beside.
Only tau is judged: the bench here may run at another dtype and thread count than the latency
JSON the sweep priced (simulated Spd is shown, not judged).

    .venv/bin/python experiments/custom_policy_fidelity.py --bench runs/bench_custom.json \\
        --traces runs/traces_custom --fit-traces runs/traces_default \\
        [--latency specblock/sim/data/latency_cpu.json] [--requests 40] [--n-seeds 3] [--tree-pool 2048] \\
        [--out experiments/results/custom_policy_fidelity]

Writes OUT.json and OUT.md. Missing inputs: one line on stderr, status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The bench ran with `python -m` from the working directory, so its policy names ("examples.x:Cls")
# resolve from there; a script's sys.path starts at its own folder instead.
sys.path.insert(1, str(Path.cwd()))
from sim_fidelity import read_generations, sim_method, trace_stats  # noqa: E402

from specblock.errors import SpecBlockError  # noqa: E402
from specblock.sim.config import SimConfig  # noqa: E402
from specblock.sim.sweep import run_config  # noqa: E402

TAU_TOL = 0.05


def _err(sim: float, meas: float) -> float:
    return round(sim / meas - 1, 4)


def simulate_tau(method_cfg: dict, traces: list[str], domain: str, tokens: int, prompt_len: int, latency: Path,
                 requests: int, n_seeds: int, seed: int, tree_pool: int) -> dict:
    sc = SimConfig.model_validate({
        "preset": "cpu-calibrated", "latency_file": str(latency), "method": method_cfg,
        "acceptance": {"kind": "traces", "traces": traces, "benchmark": domain},
        "workload": {"requests": requests, "tokens": tokens, "prompt_len": prompt_len},
        "seed": seed, "n_seeds": n_seeds, "tree_pool": tree_pool})
    return run_config(sc)


def compare(bench_path: Path, trace_dir: Path, fit_dir: Path, latency: Path, requests: int, n_seeds: int,
            tree_pool: int = 2048, seed: int = 0) -> dict:
    bench = json.loads(bench_path.read_text())
    cfg, prompts = bench.get("config", {}), int(bench.get("config", {}).get("prompts", 1))
    rows = []
    with tempfile.TemporaryDirectory(prefix="custom_fidelity_") as td:
        for r in bench["rows"]:
            method, domain = r["method"], r["domain"]
            if method.split("@")[0] != "specblock" or r.get("tau") is None:
                continue
            own = trace_dir / f"{method}.{domain}.jsonl"
            base = fit_dir / f"specblock.{domain}.jsonl"
            if not own.is_file() or not base.is_file():
                raise SystemExit(f"error: traces missing: {own if not own.is_file() else base}")
            lines, _ = read_generations(own, prompts)
            subset = Path(td) / own.name
            subset.write_text("\n".join(lines) + "\n")
            ts = trace_stats(lines)
            method_cfg, _ = sim_method(method, cfg)
            tokens = max(int(round(r["new_tokens"] / prompts)), 1)
            prompt_len = max(int(round(ts["ctx"] - tokens / 2)), 0)
            args = (domain, tokens, prompt_len, latency, requests, n_seeds, seed, tree_pool)
            pred = simulate_tau(method_cfg, [str(base)], *args)
            self_ = simulate_tau(method_cfg, [str(subset)], *args)
            rows.append({
                "method": method, "domain": domain, "policy": method_cfg.get("policy_class") or "rank-bucket widths",
                "policy_kwargs": method_cfg.get("policy_kwargs") or {"widths": method_cfg["widths"]},
                "budget": method_cfg["budget"], "tau_meas": r["tau"],
                "tau_pred": round(pred["tau"], 4), "tau_pred_err": _err(pred["tau"], r["tau"]),
                "tau_self": round(self_["tau"], 4), "tau_self_err": _err(self_["tau"], r["tau"]),
                "tau_pred_ci95": [round(x, 4) for x in pred.get("tau_ci95", [])],
                "tree_meas": r["mean_tree_size"], "tree_pred": round(pred["tree_size"], 2),
                "tree_self": round(self_["tree_size"], 2), "spd_meas": r["speedup"],
                "spd_decode_meas": r.get("speedup_decode"), "spd_pred": round(pred["speedup"], 4),
                "match_rate": r["match_rate"]})
    means = []
    for m in dict.fromkeys(x["method"] for x in rows):
        rs = [x for x in rows if x["method"] == m]
        tm, tp, tself = (float(np.mean([x[k] for x in rs])) for k in ("tau_meas", "tau_pred", "tau_self"))
        means.append({"method": m, "policy": rs[0]["policy"], "policy_kwargs": rs[0]["policy_kwargs"],
                      "budget": rs[0]["budget"], "tau_meas": round(tm, 4), "tau_pred": round(tp, 4),
                      "tau_pred_err": _err(tp, tm), "tau_self": round(tself, 4), "tau_self_err": _err(tself, tm),
                      "domains_pred_within": sum(abs(x["tau_pred_err"]) <= TAU_TOL for x in rs),
                      "domains_self_within": sum(abs(x["tau_self_err"]) <= TAU_TOL for x in rs), "domains": len(rs),
                      "match_rate": round(float(np.mean([x["match_rate"] for x in rs])), 4)})
    return {"inputs": {"bench": str(bench_path), "traces": str(trace_dir), "fit_traces": str(fit_dir),
                       "latency": str(latency), "requests": requests, "n_seeds": n_seeds, "tree_pool": tree_pool,
                       "seed": seed},
            "bench_config": cfg, "tau_tol": TAU_TOL, "means": means, "rows": rows}


def markdown(res: dict) -> str:
    pct = lambda x: f"{100 * x:+.1f}%"
    out = [f"Simulated vs measured tau (goal: within {100 * res['tau_tol']:.0f}%). pred: acceptance fitted from the "
           f"default policy's traces ({res['inputs']['fit_traces']}); self: from the row's own traces.", "",
           "| method | policy | budget | tau meas | tau pred | err | tau self | err | domains within (pred / self) | match |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for m in res["means"]:
        pol = m["policy"].split(":")[-1] + " " + json.dumps(m["policy_kwargs"], separators=(",", ":"))
        out.append(f"| {m['method']} | {pol} | {m['budget']} | {m['tau_meas']:.3f} | {m['tau_pred']:.3f} | "
                   f"{pct(m['tau_pred_err'])} | {m['tau_self']:.3f} | {pct(m['tau_self_err'])} | "
                   f"{m['domains_pred_within']} / {m['domains_self_within']} of {m['domains']} | {100 * m['match_rate']:.0f}% |")
    out += ["", "| method | domain | tau meas | tau pred | err | tau self | err | tree meas | tree pred |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        out.append(f"| {r['method']} | {r['domain']} | {r['tau_meas']:.3f} | {r['tau_pred']:.3f} | {pct(r['tau_pred_err'])} | "
                   f"{r['tau_self']:.3f} | {pct(r['tau_self_err'])} | {r['tree_meas']:.1f} | {r['tree_pred']:.1f} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench", type=Path, required=True)
    ap.add_argument("--traces", type=Path, required=True, help="the bench's --trace-dir")
    ap.add_argument("--fit-traces", type=Path, required=True, help="trace dir of a plain specblock bench (default policy)")
    ap.add_argument("--latency", type=Path, default=Path("specblock/sim/data/latency_cpu.json"))
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--n-seeds", type=int, default=3)
    # these trees' tau varies widely: 512 pooled trees moved a seed's tau by +-5%, 2048 by +-1.5%
    ap.add_argument("--tree-pool", type=int, default=2048)
    ap.add_argument("--out", type=Path, default=Path("experiments/results/custom_policy_fidelity"))
    a = ap.parse_args(argv)
    for p in (a.bench, a.traces, a.fit_traces, a.latency):
        if not p.exists():
            print(f"error: {p} not found", file=sys.stderr)
            return 2
    try:
        res = compare(a.bench, a.traces, a.fit_traces, a.latency, a.requests, a.n_seeds, a.tree_pool)
    except SpecBlockError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    a.out.with_suffix(".md").write_text(markdown(res))
    print(markdown(res), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
