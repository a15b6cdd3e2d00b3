"""Later starts with ``--compile`` (issue 16: under 10 s), as a user meets them: whole fresh
processes, Python's start and imports included, on this machine's cache of compiled graphs.

- ``cli``: ``python -m specblock.runtime --compile`` decoding a short answer (its warm-up request and
  16 new tokens included), until the process exits;
- ``serve``: ``python -m specblock.serve --compile --port 0``, until it prints that it listens
  (after loading or compiling every tree size its budget can meet and the drafter's steps).

The first start of each may compile what the cache lacks; it is reported apart, and the figures
are the medians of the later ones. Also printed: how many saved entries the graph cache holds, since
a later start once loaded all of them (``StaticTarget.step_fns``). ``--ab gc`` or ``--ab guards`` times
each later start a second time with one of stop 56's or 57's changes undone, interleaved (``UNDO``).

    python experiments/start_time.py --runs 3 --out experiments/results/start_time
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "Write a haiku about the sea."


#: ``--ab``: each later start also timed with one change of stop 56 or 57 undone, interleaved. ``guards``:
#: each saved graph's guards built twice at load, as dynamo does while ``caching_precompile`` is on
#: (``precompile._guards_built_once`` off); ``gc``: the collector at its default thresholds through
#: the start (``specblock/gcstart.py`` off). Not undone but tried: ``int8``, drafters' linears on the
#: int8 kernel beside the compiled packed-fp16 target as beside the eager one (``drafters.wants_int8``),
#: its library's build begun beside the target's load.
UNDO = {
    "guards": "import contextlib, specblock.gcstart as g; g.begin(); import specblock.compiled.precompile as p; "
              "p._guards_built_once = contextlib.nullcontext",
    "gc": "import specblock.gcstart as g; g.begin = lambda: None",
    "int8": "import specblock.gcstart as g; g.begin(); import specblock.runtime.drafters as d; "
            "d.wants_int8 = lambda t: True; b = d.start_int8_build; d.start_int8_build = lambda t, v, c: b(t, v, False)",
    "hfparts": "import os, specblock.gcstart as g; g.begin(); os.environ['SPECBLOCK_EXACT_PARTS'] = 'off'",
    "rotaryop": "import os, specblock.gcstart as g; g.begin(); os.environ['SPECBLOCK_ROTARY_OP'] = 'off'",
    "fp16kernel": "import os, specblock.gcstart as g; g.begin(); os.environ['SPECBLOCK_FP16_KERNEL'] = 'fbgemm'",
    "warmsizes": "import specblock.gcstart as g; g.begin(); import specblock.runtime.drafters as d; "
                 "d.warm_sizes = lambda opts: opts.pop('warm_sizes', None) and None",
    "tmpheaders": "import specblock.gcstart as g; g.begin(); import specblock.compiled.precompile as p; "
                  "p.keep_headers = lambda f: None",
    "normlast": "import specblock.gcstart as g; g.begin(); import specblock.compiled as c, specblock.runtime.exact_parts "
                "as e; p, s = c.prebuild, e.start_building\n"
                "def prebuild(d, v):\n e.start_building = lambda: None\n try: p(d, v)\n finally: e.start_building = s\n"
                "c.prebuild = prebuild",
}
UNDONE = {"guards": "each saved graph's guards built twice at load (as before)",
          "gc": "the collector at its default thresholds through the start (as before)",
          "int8": "drafters' linears on the int8 kernel beside the compiled packed-fp16 target too (stop 57's first try)",
          "hfparts": "HF's RMSNorm and rotary on the packed-fp16 target (before stop 62; no norm library to build)",
          "rotaryop": "HF's rotary application (before stop 63; the library is built either way, with rotary.cpp in it)",
          "fp16kernel": "fbgemm's fp16 GEMM in compiled graphs (before stop 66's fp16 kernel)",
          "warmsizes": "every tree size the drafter can propose warmed, serving.json's warm_sizes ignored (before stop 64)",
          "tmpheaders": "precompiled headers in /tmp/torchinductor_$USER as before stop 64 (there from earlier runs: "
                        "not built)",
          "normlast": "the norm library's build queued by the load, behind the attention and packed-linear builds "
                      "(before stop 65)"}


def python_m(module: str, undo: str | None) -> list[str]:
    if undo is None:
        return [sys.executable, "-m", module]
    run = f"; import runpy, sys; sys.argv[0] = {module!r}; runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
    return [sys.executable, "-c", UNDO[undo] + run]


def cli_start(extra: list[str], undo: str | None = None) -> float:
    t0 = time.perf_counter()
    subprocess.run([*python_m("specblock.runtime", undo), "--compile", "--max-new-tokens", "16", "--prompt", PROMPT,
                    *extra], check=True, capture_output=True, text=True)
    return time.perf_counter() - t0


def serve_start(extra: list[str], undo: str | None = None, cwd: Path | None = None) -> float:
    """Seconds until the server listens; ``cwd``: a checkout whose ``specblock`` it runs (``-m`` and
    ``-c`` put the working folder first on ``sys.path``, ahead of ``PYTHONPATH``)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([*python_m("specblock.serve", undo), "--compile", "--port", "0", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=cwd)
    try:
        for line in proc.stdout:
            if "listening on" in line:
                return time.perf_counter() - t0
        raise RuntimeError(f"the server exited with status {proc.wait()} before it listened")
    finally:
        proc.terminate()
        proc.wait()


def forget_vec_isa() -> None:
    """Remove the record that spares later processes inductor's vector-ISA check (``remember_vec_isa``)."""
    from specblock.models import specblock_home

    root = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or specblock_home() / "inductor")
    (root / "vec_isa.json").unlink(missing_ok=True)


def saved_entries() -> int:
    from specblock.models import specblock_home

    root = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or specblock_home() / "inductor") / "dynamo"
    return sum(1 for p in root.iterdir() if p.is_dir()) if root.is_dir() else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="later starts timed per command (after one first start)")
    ap.add_argument("--which", default="cli,serve")
    ap.add_argument("--extra", default="", help="more flags for both commands, e.g. '--method specblock'")
    ap.add_argument("--out", type=Path, default=Path("experiments/results/start_time"))
    ap.add_argument("--vec-isa-ab", action="store_true",
                    help="each later start also timed with the vector-ISA record removed first (inductor's check "
                         "runs again, as before the record), interleaved: what the record saves")
    ap.add_argument("--ab", choices=sorted(UNDO),
                    help="each later start also timed with one change undone, interleaved: what it saves (UNDO)")
    args = ap.parse_args()
    extra = args.extra.split()
    starts = {"cli": cli_start, "serve": serve_start}
    helpers = os.environ.get("SPECBLOCK_WARM_HELPERS", "").strip()  # compiled/warm_helpers.py: a first start's helpers
    res: dict = {"entries_before": saved_entries(), "extra": args.extra, "warm_helpers": helpers or "auto"}
    for name in args.which.split(","):
        first = starts[name](extra)
        later, checked, undone = [], [], []
        for _ in range(args.runs):
            if args.vec_isa_ab:
                forget_vec_isa()
                checked.append(starts[name](extra))  # checks, and records again for the next start
            if args.ab:
                undone.append(starts[name](extra, undo=args.ab))
            later.append(starts[name](extra))
        res[name] = {"first_s": round(first, 2), "later_s": [round(t, 2) for t in later],
                     "later_median_s": round(statistics.median(later), 2)}
        if checked:
            res[name].update(checked_s=[round(t, 2) for t in checked], checked_median_s=round(statistics.median(checked), 2))
        if undone:
            res[name].update(undone_s=[round(t, 2) for t in undone], undone_median_s=round(statistics.median(undone), 2))
        print(name, res[name], flush=True)
    res["entries_after"] = saved_entries()
    cmd = (f"SPECBLOCK_WARM_HELPERS={helpers} " if helpers else "") + f"python experiments/start_time.py --runs {args.runs} --which {args.which}" + \
        (f" --extra '{args.extra}'" if args.extra else "") + (" --vec-isa-ab" if args.vec_isa_ab else "") + \
        (f" --ab {args.ab}" if args.ab else "") + \
        f" --out {args.out}"
    lines = [f"Later starts with `--compile`, whole fresh processes (`{cmd}`); saved function entries in the graph "
             f"cache: {res['entries_before']} before, {res['entries_after']} after.", "",
             "| command | first start s | later starts s | median |", "|---|---|---|---|"]
    what = {"cli": "`python -m specblock.runtime --compile` (16 tokens)", "serve": "`python -m specblock.serve --compile` until it listens"}
    for name in args.which.split(","):
        r = res[name]
        lines.append(f"| {what[name]} | {r['first_s']} | {', '.join(map(str, r['later_s']))} | {r['later_median_s']} |")
        if "checked_s" in r:
            lines.append(f"| the same, vector-ISA check run again (record removed) | - | "
                         f"{', '.join(map(str, r['checked_s']))} | {r['checked_median_s']} |")
        if "undone_s" in r:
            lines.append(f"| the same, {UNDONE[args.ab]} | - | "
                         f"{', '.join(map(str, r['undone_s']))} | {r['undone_median_s']} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
