"""Runs and sweeps: seeds with confidence intervals, one process per configuration, a cache by
config hash and the contents of the files the config reads, a progress bar, CSV + JSON + PNG
outputs, and an optional Ray backend.

A sweep file (YAML or JSON)::

    base: {preset: paper, method: {name: specblock}, workload: {requests: 200, tokens: 256}}
    grid: {method.K: [2, 4, 6], method.M: [1, 2, 3]}     # cartesian product over dotted paths
    configs: [{method: {name: eagle3}}]                    # optional extra points, merged on base
    out: experiments/results/sweeps/km                     # default: sweeps/<file stem>
    workers: 2
"""

from __future__ import annotations

import copy
import csv
import hashlib
import itertools
import json
import os
import signal
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import IO

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specblock.atomic import AtomicFiles, check_output, write_atomic
from specblock.errors import SpecBlockError
from specblock.sim.config import SimConfig, config_hash

SCALARS = ("speedup", "speedup_iter", "tau", "draft_share", "tokens_per_s", "tpot_ms", "tree_size", "t_iter_ms",
           "t_draft_ms", "t_verify_ms")


def run_config(cfg: SimConfig) -> dict:
    """Run ``cfg.n_seeds`` seeds (seed, seed + 1, ...); means with 95% t-intervals over seeds."""
    from scipy import stats

    from specblock.sim.engine import simulate

    t0 = time.perf_counter()
    runs = [simulate(cfg, cfg.seed + i) for i in range(cfg.n_seeds)]
    out: dict = {}
    for k in SCALARS:
        v = np.array([r[k] for r in runs], dtype=float)
        out[k] = float(v.mean())
        if len(v) > 1:
            h = float(stats.t.ppf(0.975, len(v) - 1) * v.std(ddof=1) / np.sqrt(len(v)))
            out[f"{k}_ci95"] = [out[k] - h, out[k] + h]
    depth = max(len(r["per_depth_acceptance"]) for r in runs)
    pad = [r["per_depth_acceptance"] + [np.nan] * (depth - len(r["per_depth_acceptance"])) for r in runs]
    out["per_depth_acceptance"] = [None if np.isnan(x) else round(float(x), 5) for x in np.nanmean(pad, axis=0)] \
        if depth else []
    out["iterations"] = int(sum(r["iterations"] for r in runs))
    for k in ("adapt_arms", "adapt_rollbacks", "adapt_skill", "notes"):
        if k in runs[0]:
            out[k] = runs[0][k] if cfg.n_seeds == 1 else [r[k] for r in runs]
    out["ar_tpot_ms"] = runs[0]["ar_tpot_ms"]
    out["wall_s"] = time.perf_counter() - t0
    out["config"] = cfg.model_dump(mode="json")
    out["config_hash"] = config_hash(cfg)
    return out


# --------------------------------------------------------------------------- sweeps
class SweepSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    base: dict = Field(default_factory=dict)
    grid: dict[str, list] = Field(default_factory=dict)
    configs: list[dict] = Field(default_factory=list)
    out: str | None = None
    workers: int = Field(2, ge=1)


def _set(d: dict, dotted: str, value) -> None:
    keys = dotted.split(".")
    for k in keys[:-1]:
        d = d.setdefault(k, {})
    d[keys[-1]] = value


def _merge(a: dict, b: dict) -> dict:
    out = copy.deepcopy(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def expand(spec: SweepSpec) -> list[tuple[dict, SimConfig]]:
    """All points of the sweep as (grid values, validated config). Validates before running."""
    points = []
    keys = list(spec.grid)
    for values in itertools.product(*(spec.grid[k] for k in keys)) if keys else [()]:
        d = copy.deepcopy(spec.base)
        for k, v in zip(keys, values):
            _set(d, k, v)
        points.append((dict(zip(keys, values)), SimConfig.model_validate(d)))
    for extra in spec.configs:
        points.append(({"config": json.dumps(extra, sort_keys=True)}, SimConfig.model_validate(_merge(spec.base, extra))))
    return points


def load_spec(path: str | Path) -> SweepSpec:
    """Parse and validate a sweep file; every fault is one line naming the file (and line)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"sweep file {p} not found")
    try:
        text = p.read_text(encoding="utf-8")
        data = yaml.safe_load(text) if p.suffix in (".yaml", ".yml") else json.loads(text)
        return SweepSpec.model_validate(data or {})
    except UnicodeDecodeError as e:
        raise SpecBlockError(f"{p}: not a UTF-8 text file (byte {e.start})") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        raise SpecBlockError(f"{p}:{mark.line + 1 if mark else '?'}: not valid YAML ({e.problem or e.context})") from None
    except yaml.YAMLError as e:
        raise SpecBlockError(f"{p}: not valid YAML ({str(e).splitlines()[0]})") from None
    except json.JSONDecodeError as e:
        raise SpecBlockError(f"{p}:{e.lineno}: not valid JSON ({e.msg})") from None
    except ValidationError as e:
        raise SpecBlockError(f"{p}: {_errors(e)}") from None


def _errors(e: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, x['loc'])) or 'sweep'}: {x['msg']}" for x in e.errors()[:3])


def _cached(f: Path) -> dict | None:
    """A cache entry, or None when absent or unreadable (a run killed mid-write by an older
    version, a disk fault): it is a cache, so the configuration simply runs again."""
    try:
        res = json.loads(f.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        print(f"note: ignoring the unreadable sweep cache entry {f} ({type(e).__name__}); running it again",
              file=sys.stderr)
        return None
    return res if isinstance(res, dict) and "config_hash" in res and "iterations" in res else None


def _ignore_sigint() -> None:
    """Workers leave Ctrl-C to the parent, which stops them (one message, no traceback per worker)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _stop(ex: ProcessPoolExecutor) -> None:
    """Stop the workers now and wait for the executor's manager thread to see them gone.
    Why wait: on CPython 3.11 the interpreter's exit hook (`_python_exit`) wakes that thread through
    a pipe the thread closes when it finds its workers dead; if the thread is still running at exit
    the two race and the exit prints an `OSError` traceback under the one-line message (seen once in
    CI; `tests/test_sim_files.py` widens that race, and failed 6 runs in 6 without this join)."""
    manager = getattr(ex, "_executor_manager_thread", None)  # shutdown() forgets it
    for proc in list((getattr(ex, "_processes", None) or {}).values()):
        proc.terminate()
    ex.shutdown(wait=False, cancel_futures=True)
    if manager is not None:
        try:
            manager.join(timeout=30)
        except KeyboardInterrupt:  # a second Ctrl-C: leave now, as the first one asked
            pass


def cache_key(cfg: SimConfig) -> str:
    """The config's hash plus a digest of the files it reads (acceptance traces, the latency JSON,
    a user's policy modules). Why: the config names files, not their contents, so re-tracing a
    drafter or editing a policy class under the same name would otherwise serve stale results."""
    from specblock.policies.loading import source_file

    m, a = cfg.method, cfg.adapt
    paths = [Path(p) for p in cfg.acceptance.traces] + ([Path(cfg.latency_file)] if cfg.latency_file else [])
    paths += [f for spec in (m.policy_class, m.seed_class, a.policy_class, a.rollback_class)
              if spec and (f := source_file(spec)) is not None]
    h = hashlib.sha256()
    for p in sorted(set(paths)):
        h.update(str(p).encode())
        h.update(p.read_bytes() if p.is_file() else b"<missing>")
    return f"{config_hash(cfg)}-{h.hexdigest()[:12]}" if paths else config_hash(cfg)


def _run_json(cfg_json: str) -> dict:
    return run_config(SimConfig.model_validate_json(cfg_json))


def sweep(path: str | Path, workers: int | None = None, out: str | None = None, ray_address: str | None = None,
          progress: bool = True) -> tuple[list[dict], Path, dict]:
    """Run a sweep file; cached results (``out/cache/<hash>.json``) are reused, not rerun."""
    from tqdm import tqdm

    spec = load_spec(path)
    try:
        points = expand(spec)
    except ValidationError as e:
        raise SpecBlockError(f"{path}: a configuration of the sweep is invalid: {_errors(e)}") from None
    out_dir = Path(out or spec.out or Path("experiments/results/sweeps") / Path(path).stem)
    cache = out_dir / "cache"
    check_output(cache / "probe.json", "--out", make_parents=True)  # before any configuration runs
    results: dict[int, dict] = {}
    todo = []
    keys = [cache_key(cfg) for _, cfg in points]
    for i, (_, cfg) in enumerate(points):
        if (res := _cached(cache / f"{keys[i]}.json")) is not None:
            results[i] = res
        else:
            todo.append(i)
    bar = tqdm(total=len(points), initial=len(points) - len(todo), disable=not progress, desc="sweep", unit="cfg")
    t0 = time.perf_counter()

    def done(i: int, res: dict) -> None:
        results[i] = res
        write_atomic(cache / f"{keys[i]}.json", json.dumps(res))
        bar.update(1)

    if ray_address:
        from specblock.sim.ray_backend import run_on_ray

        for i, res in run_on_ray(ray_address, [(i, points[i][1].model_dump_json()) for i in todo]):
            done(i, res)
    elif todo:
        n = min(workers or spec.workers, len(todo), os.cpu_count() or 1)
        ex = ProcessPoolExecutor(max_workers=n, initializer=_ignore_sigint)
        try:
            futs = {ex.submit(_run_json, points[i][1].model_dump_json()): i for i in todo}
            for f in as_completed(futs):
                done(futs[f], f.result())
        except BaseException:  # Ctrl-C or a failed configuration: what finished stays cached
            _stop(ex)
            raise
        ex.shutdown()
    bar.close()
    rows = [dict(points[i][0], **{k: results[i].get(k) for k in SCALARS}, iterations=results[i]["iterations"],
                 config_hash=results[i]["config_hash"]) for i in range(len(points))]
    write_outputs(out_dir, rows, [results[i] for i in range(len(points))], list(spec.grid))
    summary = {"configs": len(points), "ran": len(todo), "cached": len(points) - len(todo),
               "wall_s": time.perf_counter() - t0,
               "sim_iterations": int(sum(results[i]["iterations"] for i in todo))}
    summary["iterations_per_s"] = summary["sim_iterations"] / max(summary["wall_s"], 1e-9)
    write_atomic(out_dir / "summary.json", json.dumps(summary, indent=1) + "\n")
    return rows, out_dir, summary


def write_outputs(out_dir: Path, rows: list[dict], full: list[dict], grid_keys: list[str]) -> None:
    """results.csv (a table), results.json (every result with its full config), speedup.png."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with AtomicFiles(out_dir) as group:  # the three files replace their old versions together
        w = csv.DictWriter(group.get("results.csv", newline=""), fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
        group.get("results.json").write(json.dumps(full, indent=1) + "\n")
        plot_sweep(group.get("speedup.png", "wb"), rows, grid_keys)


def plot_sweep(path: Path | IO[bytes], rows: list[dict], grid_keys: list[str]) -> None:
    """Speedup against the first grid axis, one line per combination of the others."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.4, 4.6))
    gk = [k for k in grid_keys if all(k in r for r in rows)]
    if gk:
        x, rest = gk[0], gk[1:]
        groups: dict = {}
        for r in rows:
            if x in r:
                groups.setdefault(tuple(str(r[k]) for k in rest), []).append(r)
        for g, rs in sorted(groups.items()):
            xs = [str(r[x]) for r in rs]
            ax.plot(xs, [r["speedup"] for r in rs], marker="o", label=", ".join(f"{k}={v}" for k, v in zip(rest, g)) or None)
        ax.set_xlabel(x)
        if 1 < len(groups) <= 30:
            ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5), ncol=1 + len(groups) // 16)
    else:
        ax.bar(range(len(rows)), [r["speedup"] for r in rows])
        ax.set_xlabel("configuration")
    ax.set_ylabel("simulated speedup (Spd)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)
