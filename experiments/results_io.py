"""What the microbenchmark scripts write: ``OUT.json`` (their arguments and rows) and ``OUT.md``
(the command and a table), and the table printed. One place for the files' shape, which the
results' readers (docs, notes) rely on."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Callable


def write_results(out: Path, args: argparse.Namespace, rows: list[dict], lines: list[str]) -> str:
    """Write ``out`` with the suffixes .json and .md (folders made) and print the markdown; returns it."""
    md = "\n".join(lines) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args) | {"out": str(out)}, "rows": rows}, indent=1))
    out.with_suffix(".md").write_text(md)
    print(md)
    return md


def interleaved(modes: list[str], runs: int, one: Callable[[str], float]) -> dict[str, list[float]]:
    """Seconds of ``one(mode)`` for every mode in turn, ``runs`` rounds (a drift of the machine falls
    on every mode alike), each printed as it comes."""
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(runs):
        for m in modes:
            times[m].append(round(one(m), 2))
            print(m, times[m][-1], flush=True)
    return times


def timing_table(times: dict[str, list[float]], column: str, label: str, names: dict[str, str] | None = None,
                 key: str = "s") -> tuple[list[str], list[dict]]:
    """``interleaved``'s times as markdown rows (each run and the median) and as result rows."""
    lines = [f"| {label} | {column} | median |", "|---|---|---|"]
    for m, ts in times.items():
        lines.append(f"| {(names or {}).get(m, m)} | {', '.join(map(str, ts))} | {statistics.median(ts):.2f} |")
    rows = [{"mode": m, key: ts, "median_s": round(statistics.median(ts), 2)} for m, ts in times.items()]
    return lines, rows
