"""The digest's results table, and the ``digest`` acceptance presets fitted to its tau.

For each (target, method, benchmark) the preset keeps the method's parametric shape
(``acceptance.METHOD_SHAPES``, our assumptions) and fits one number, the top-1 acceptance ``a1``
of the first drafted position, so that the simulated tau of the method's default tree equals the
digest's tau. The fit inverts a simulated tau(a1) curve per method (see :func:`fit_digest`);
``python -m specblock.sim fit-digest`` rewrites ``data/digest_fit.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from specblock.sim.acceptance import METHOD_SHAPES

BENCHMARKS = ("humaneval", "math500", "alpaca", "nq", "mtbench", "mean")

# (Spd, tau) per benchmark in BENCHMARKS order, then T_D% (A100-80GB, batch 1, T = 0).
# None = not reported. Method keys follow the sim where it models the method.
DIGEST: dict[str, dict[str, tuple[list, float]]] = {
    "llama3.1-8b": {
        "sps": ([(1.55, 2.91), (1.17, 2.29), (1.48, 2.70), (1.06, 2.09), (1.38, 2.45), (1.27, 2.39)], 0.38),
        "medusa": ([(2.16, 2.70), (1.53, 2.30), (2.01, 2.44), (1.44, 2.00), (1.88, 2.59), (1.73, 2.35)], 0.06),
        "parallelspec": ([(2.50, 3.16), (1.89, 2.64), (2.39, 3.28), (1.78, 2.63), (2.36, 3.21), (2.10, 2.87)], 0.08),
        "falcon": ([(3.06, 4.69), (2.30, 3.74), (2.86, 4.23), (2.12, 3.38), (2.66, 4.31), (2.48, 3.95)], 0.26),
        "eagle3": ([(3.59, 6.98), (2.66, 5.93), (3.35, 6.27), (2.42, 5.39), (3.22, 6.16), (2.92, 5.89)], 0.31),
        "specblock": ([(3.92, 5.16), (3.07, 4.03), (3.40, 4.66), (3.00, 4.40), (3.10, 4.46), (3.21, 4.41)], 0.16),
        "specblock+adapt": ([None, (3.14, 4.23), (3.47, 4.72), (3.51, 5.41), None, (3.24, 4.54)], 0.15),
    },
    "qwen3-8b": {
        "eagle3": ([(2.45, 4.53), (1.94, 4.46), (2.35, 4.29), (2.50, 4.20), (2.40, 4.23), (2.24, 4.14)], 0.29),
        "specblock": ([(2.50, 3.59), (2.53, 3.71), (2.58, 3.73), (2.26, 3.21), (2.33, 3.32), (2.42, 3.47)], 0.14),
        "specblock+adapt": ([None, (2.61, 3.90), (2.64, 3.78), (2.69, 3.75), None, (2.56, 3.70)], 0.17),
    },
    "qwen3-32b": {
        "eagle3": ([(2.54, 4.36), (1.82, 4.27), (2.28, 4.09), (2.38, 3.96), (2.18, 4.09), (2.15, 3.96)], 0.24),
        "specblock": ([(2.61, 3.47), (2.48, 3.53), (2.48, 3.54), (2.17, 3.07), (2.21, 3.21), (2.37, 3.33)], 0.11),
        "specblock+adapt": ([None, (2.55, 3.73), (2.51, 3.61), (2.57, 3.61), None, (2.47, 3.54)], 0.13),
    },
}

FIT_PATH = Path(__file__).parent / "data" / "digest_fit.json"
SIM_METHODS = ("sps", "medusa", "eagle3", "specblock")


def digest_row(target: str, method: str, benchmark: str) -> tuple[float, float, float] | None:
    """(Spd, tau, T_D) from the digest, or None where it reports nothing."""
    rows, td = DIGEST.get(target, {}).get(method, (None, None))
    if rows is None:
        return None
    cell = rows[BENCHMARKS.index(benchmark)]
    return None if cell is None else (cell[0], cell[1], td)


def fitted_a1(target: str, method: str, benchmark: str) -> tuple[float, str]:
    """Fitted a1 and a note. Targets without a row for this method fall back to Llama-3.1-8B's
    (the digest compares only EAGLE-3 and SpecBlock on Qwen3); missing fits say so."""
    if benchmark not in BENCHMARKS:
        raise KeyError(f"unknown benchmark {benchmark!r}; known: {', '.join(BENCHMARKS)}")
    table = json.loads(FIT_PATH.read_text()) if FIT_PATH.is_file() else {}
    key = f"{target}/{method}/{benchmark}"
    if key in table:
        return table[key]["a1"], ""
    alt = f"llama3.1-8b/{method}/{benchmark}"
    if alt in table:
        return table[alt]["a1"], f"no digest row for {key}; used {alt}"
    raise KeyError(f"no fitted digest acceptance for {key}; run `python -m specblock.sim fit-digest`")


def simulated_tau(target: str, method: str, a1: float, iterations: int, seed: int = 0) -> float:
    """tau of ``method``'s default tree under the method's shape with top-1 scale ``a1``."""
    from specblock.sim.config import MethodCfg, build_method

    model = build_method(MethodCfg(name=method))
    rm = METHOD_SHAPES[method].rank_model(a1)
    rng = np.random.default_rng(seed)
    acc = sum(model.draft(rng, rm).acceptance.accepted for _ in range(iterations))
    return 1.0 + acc / iterations


def _tau_at(job: tuple[str, float, int]) -> float:
    method, a1, iterations = job
    return simulated_tau("", method, a1, iterations)


def fit_digest(iterations: int = 2000, grid: int = 30, out: Path = FIT_PATH, workers: int = 2) -> dict:
    """Invert tau(a1) for every (target, sim method, benchmark) the digest reports.

    The shape is per method, so tau(a1) is one curve per method: simulate it on a grid of a1
    (one process per point, a fixed seed for common random numbers), make it monotone, and
    interpolate the digest's tau on it. Cheaper and smoother than a bisection per table cell.
    """
    from concurrent.futures import ProcessPoolExecutor

    a1s = np.linspace(0.05, 0.99, grid)
    jobs = [(m, float(a), iterations) for m in SIM_METHODS for a in a1s]
    with ProcessPoolExecutor(max_workers=workers) as ex:
        taus = list(ex.map(_tau_at, jobs))
    curves = {m: np.maximum.accumulate(np.array(taus[i * grid:(i + 1) * grid])) for i, m in enumerate(SIM_METHODS)}
    result: dict = {"_curves": {m: {"a1": np.round(a1s, 4).tolist(), "tau": np.round(c, 4).tolist(),
                                    "iterations": iterations} for m, c in curves.items()}}
    for t in DIGEST:
        for m in SIM_METHODS:
            for b in BENCHMARKS:
                row = digest_row(t, m, b)
                if row is None:
                    continue
                c = curves[m]
                if not c[0] <= row[1] <= c[-1]:
                    raise ValueError(f"digest tau {row[1]} for {t}/{m}/{b} outside the reachable {c[0]:.2f}..{c[-1]:.2f}")
                a1 = float(np.interp(row[1], c, a1s))
                result[f"{t}/{m}/{b}"] = {"a1": round(a1, 5), "tau_digest": row[1]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    return result
