"""A first start's C++ builds begun before the model loads (``compiled.prebuild``) against after it,
as before stop 56: the time to open the default compiled server's session (model loaded, libraries
built, target and drafter wrapped; no graph compiled yet), each in a fresh process with a fresh
``SPECBLOCK_HOME`` holding only the converted model (so every library builds), interleaved.

    python experiments/prebuild_overlap.py --runs 3 --out experiments/results/prebuild_overlap
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from results_io import interleaved, timing_table, write_results

CHILD = r"""
import json, sys, time
from specblock import gcstart
gcstart.begin()
import specblock.runtime.cli as cli
if sys.argv[1] == "after":
    cli.prebuild_compiled = lambda dtype, device: None
from specblock.serve.cli import parse
t0 = time.perf_counter()
cli.Session.open(parse(["--compile"])[0], None)
print(json.dumps({"open_s": time.perf_counter() - t0}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("experiments/results/prebuild_overlap"))
    args = ap.parse_args()
    from specblock.models import specblock_home

    model = specblock_home() / "models" / "smollm2-135m-instruct"
    if not model.is_dir():
        sys.exit(f"no converted model at {model}: run `make run` once first")
    def one(mode: str) -> float:
        with tempfile.TemporaryDirectory() as home:
            (Path(home) / "models").mkdir()
            (Path(home) / "models" / model.name).symlink_to(model)
            p = subprocess.run([sys.executable, "-c", CHILD, mode], env={**os.environ, "SPECBLOCK_HOME": home},
                               capture_output=True, text=True, check=True)
        return json.loads(p.stdout.strip().splitlines()[-1])["open_s"]

    times = interleaved(["prebuild", "after"], args.runs, one)
    cmd = f"python experiments/prebuild_overlap.py --runs {args.runs} --out {args.out}"
    what = {"prebuild": "begun before the model loads (now)", "after": "after the model loads (before)"}
    table, rows = timing_table(times, "open s", "C++ builds", what, key="open_s")
    lines = [f"Opening the default compiled server's session on a machine with no C++ library built (fresh "
             f"`SPECBLOCK_HOME`, the converted model linked in), fresh processes, interleaved (`{cmd}`):", "", *table]
    write_results(args.out, args, rows, lines)


if __name__ == "__main__":
    main()
