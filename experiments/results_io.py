"""What the microbenchmark scripts write: ``OUT.json`` (their arguments and rows) and ``OUT.md``
(the command and a table), and the table printed. One place for the files' shape, which the
results' readers (docs, notes) rely on."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def write_results(out: Path, args: argparse.Namespace, rows: list[dict], lines: list[str]) -> str:
    """Write ``out`` with the suffixes .json and .md (folders made) and print the markdown; returns it."""
    md = "\n".join(lines) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args) | {"out": str(out)}, "rows": rows}, indent=1))
    out.with_suffix(".md").write_text(md)
    print(md)
    return md
