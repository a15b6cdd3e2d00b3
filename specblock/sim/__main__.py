"""``python -m specblock.sim``: run one configuration, sweep a grid, list presets, fit presets.

    python -m specblock.sim run --preset paper --method specblock --json
    python -m specblock.sim run --preset a100-llama3.1-8b --method eagle3 --benchmark humaneval
    python -m specblock.sim run --config my.yaml --set method.K=6 --set workload.requests=50
    python -m specblock.sim sweep GRID.yaml [--workers 2] [--out DIR] [--ray ADDRESS]
    python -m specblock.sim presets
    python -m specblock.sim fit-digest          # refit data/digest_fit.json (minutes)
    python -m specblock.sim fit-traces T.jsonl  # summarise an acceptance model fitted from traces
    python -m specblock.sim check-traces T.jsonl [--method lookup] [--set method.widths=[2,2,2,2]]

A bad configuration (unknown preset, negative rate, missing file, ...) prints one line on stderr
and exits with status 2; no traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml
from pydantic import ValidationError

from specblock.atomic import atomic_open, check_output
from specblock.errors import SpecBlockError
from specblock.flags import OneLineParser
from specblock.sim.config import METHODS, SimConfig


class UsageError(Exception):
    pass


def _parse(argv):
    p = OneLineParser(prog="python -m specblock.sim", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="simulate one configuration")
    r.add_argument("--config", help="YAML/JSON SimConfig; flags below override it")
    r.add_argument("--preset", help="latency preset (see `presets`)")
    r.add_argument("--latency-file", help="latency JSON for cpu-calibrated")
    r.add_argument("--method", choices=METHODS)
    r.add_argument("--benchmark", help="digest benchmark / domain (humaneval, math500, alpaca, nq, mtbench, mean)")
    r.add_argument("--K", type=int)
    r.add_argument("--M", type=int)
    r.add_argument("--requests", type=int)
    r.add_argument("--tokens", type=int)
    r.add_argument("--seed", type=int)
    r.add_argument("--n-seeds", type=int)
    r.add_argument("--adapt", action="store_true", help="serving-time adaptation on")
    r.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                   help="override any field, e.g. method.widths=[2,4,6,4] or acceptance.kind=iid")
    r.add_argument("--trace-out", help="write the runtime's JSONL trace format here (first seed)")
    r.add_argument("--json", action="store_true", help="print one JSON object")
    s = sub.add_parser("sweep", help="run a grid of configurations")
    s.add_argument("grid")
    s.add_argument("--workers", type=int)
    s.add_argument("--out")
    s.add_argument("--ray", metavar="ADDRESS", help="run on a Ray cluster ('local' starts one)")
    s.add_argument("--no-progress", action="store_true")
    sub.add_parser("presets", help="list latency presets")
    f = sub.add_parser("fit-digest", help="refit the digest acceptance presets")
    f.add_argument("--iterations", type=int, default=2000)
    t = sub.add_parser("fit-traces", help="fit an acceptance model from runtime JSONL traces")
    t.add_argument("traces", nargs="+")
    t.add_argument("--method", choices=METHODS, default="specblock",
                   help="the drafter that wrote them (sps, medusa, eagle3 are keyed by depth)")
    c = sub.add_parser("check-traces", help="runtime trace vs sim: tree size and tau (no timings)")
    c.add_argument("traces", nargs="+")
    c.add_argument("--method", choices=["specblock", "lookup"], default="specblock")
    c.add_argument("--set", action="append", default=[], metavar="method.KEY=VALUE",
                   help="sim method settings (default: the runtime's), e.g. method.widths=[2,2,2,2]")
    c.add_argument("--trees", type=int, default=20000)
    c.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _config(a) -> SimConfig:
    d: dict = {}
    if a.config:
        p = Path(a.config)
        if not p.is_file():
            raise FileNotFoundError(f"config file {p} not found")
        try:
            d = (yaml.safe_load if p.suffix in (".yaml", ".yml") else json.loads)(p.read_text(encoding="utf-8")) or {}
        except (UnicodeDecodeError, ValueError, yaml.YAMLError) as e:
            raise SpecBlockError(f"config file {p} is not valid YAML or JSON ({' '.join(str(e).split())[:160]})") from None
    from specblock.sim.sweep import _set

    flags = {"preset": a.preset, "latency_file": a.latency_file, "method.name": a.method,
             "acceptance.benchmark": a.benchmark, "method.K": a.K, "method.M": a.M,
             "workload.requests": a.requests, "workload.tokens": a.tokens, "seed": a.seed, "n_seeds": a.n_seeds,
             "adapt.enabled": True if a.adapt else None}
    for k, v in flags.items():
        if v is not None:
            _set(d, k, v)
    for item in a.set:
        k, eq, v = item.partition("=")
        if not eq:
            raise UsageError(f"--set wants PATH=VALUE, got {item!r}")
        _set(d, k.strip(), yaml.safe_load(v))
    return SimConfig.model_validate(d)


def _run(a) -> int:
    from specblock.sim.engine import simulate
    from specblock.sim.sweep import run_config

    if a.trace_out:
        check_output(a.trace_out, "--trace-out")
    cfg = _config(a)
    if a.trace_out:
        with atomic_open(a.trace_out, "w", encoding="utf-8") as f:  # an existing trace survives a failed run
            simulate(cfg, cfg.seed, trace_out=f)
    res = run_config(cfg)
    if a.json:
        print(json.dumps(res))
    else:
        ci = lambda k: f" [{res[k + '_ci95'][0]:.3f}, {res[k + '_ci95'][1]:.3f}]" if k + "_ci95" in res else ""
        m = cfg.method.name + (f"+lookup ({cfg.method.lookup_nodes} nodes)" if cfg.method.lookup_nodes else "")
        print(f"{cfg.preset} {m} {cfg.acceptance.benchmark}: Spd {res['speedup']:.3f}x{ci('speedup')}  "
              f"tau {res['tau']:.3f}{ci('tau')}  T_D {100 * res['draft_share']:.1f}%  "
              f"{res['tokens_per_s']:.1f} tok/s  TPOT {res['tpot_ms']:.2f} ms  ({res['iterations']} iterations)")
        for n in res.get("notes", []):
            print(f"note: {n}")
    return 0


def main(argv=None) -> int:
    a = _parse(argv)
    try:
        if a.cmd == "run":
            return _run(a)
        if a.cmd == "sweep":
            from specblock.sim.sweep import sweep

            _, out, summary = sweep(a.grid, workers=a.workers, out=a.out, ray_address=a.ray,
                                    progress=not a.no_progress)
            print(f"{summary['configs']} configs ({summary['cached']} cached) in {summary['wall_s']:.1f} s, "
                  f"{summary['iterations_per_s']:.0f} simulated iterations/s -> {out}")
            return 0
        if a.cmd == "presets":
            from specblock.sim.presets import preset_names

            print("\n".join(preset_names()))
            return 0
        if a.cmd == "fit-digest":
            from specblock.sim.digest import FIT_PATH, fit_digest

            res = fit_digest(iterations=a.iterations)
            print(f"{len(res)} fits -> {FIT_PATH}")
            return 0
        if a.cmd == "check-traces":
            from specblock.sim.check import check_traces

            m: dict = {"name": a.method}
            for item in a.set:
                k, eq, v = item.partition("=")
                if not eq or not k.startswith("method."):
                    raise UsageError(f"--set wants method.KEY=VALUE, got {item!r}")
                m[k.strip()[len("method."):]] = yaml.safe_load(v)
            print(json.dumps(check_traces(a.traces, m, a.trees, a.seed), indent=1))
            return 0
        if a.cmd == "fit-traces":
            from specblock.sim.traces import describe, fit_traces

            print(json.dumps(describe(fit_traces(a.traces, a.method)), indent=1))
            return 0
    except ValidationError as e:
        errs = "; ".join(f"{'.'.join(map(str, x['loc'])) or 'config'}: {x['msg']}" for x in e.errors())
        print(f"error: invalid configuration: {errs}", file=sys.stderr)
    except (FileNotFoundError, KeyError, ValueError, TypeError, ImportError, UsageError, yaml.YAMLError,
            json.JSONDecodeError, SpecBlockError) as e:
        msg = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
        print(f"error: {msg.splitlines()[0] if msg else type(e).__name__}", file=sys.stderr)
    except KeyboardInterrupt:
        print("\ninterrupted (a sweep keeps every finished configuration in its cache: run it again to go on)",
              file=sys.stderr)
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
