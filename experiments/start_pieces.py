"""A later start of the compiled server in pieces (imports, loading, the saved graphs), under several
garbage-collector thresholds: what ``specblock/gcstart.py`` was chosen from.

Each setting runs in fresh processes, interleaved with the others, doing what ``python -m
specblock.serve --compile`` does before it listens (less uvicorn). ``off`` disables the collector;
its child also times the full collection that ``gcstart.done`` does not run, and how much resident
memory it gives back.

    python experiments/start_pieces.py --runs 3 --out experiments/results/start_pieces
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

SETTINGS = {"default": (700, 10, 10), "10k": (10_000, 10, 10), "50k": (50_000, 20, 20),
            "100k": (100_000, 50, 100), "off": None}

CHILD = r"""
import gc, json, sys, time
setting = json.loads(sys.argv[1])
if setting is None:
    gc.disable()
else:
    gc.set_threshold(*setting)
t0 = time.perf_counter()
from specblock.runtime.cli import Session
from specblock.serve.cli import WARMUP_TEXT, parse, quiet_transformers
import specblock.serve.app, uvicorn  # the server's own imports
quiet_transformers()
t1 = time.perf_counter()
cfg, _ = parse(sys.argv[2:])
s = Session.open(cfg, None)
t2 = time.perf_counter()
s.warm_compiled()
s.warmup(list(s.tokenizer(WARMUP_TEXT)["input_ids"]))
t3 = time.perf_counter()
out = {"imports_s": t1 - t0, "load_s": t2 - t1, "graphs_s": t3 - t2, "total_s": t3 - t0}
if setting is None:
    rss = lambda: int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) // 1024
    before = rss()
    t = time.perf_counter()
    out["unreachable"] = gc.collect()
    out.update(collect_s=time.perf_counter() - t, rss_freed_mb=before - rss())
# Then as the server goes on (gcstart.done, where the thresholds were raised): how many collections
# a 128-token answer runs
if setting != [700, 10, 10]:
    gc.enable()
    gc.freeze()
    gc.set_threshold(700, 10, 10)
runs = [0]
gc.callbacks.append(lambda phase, info: runs.__setitem__(0, runs[0] + (phase == "start")))
s.engine.generate(s.encode({"prompt": "Write a short story about a robot who learns to paint."}), 128, seed=0)
out["decode_collections"] = runs[0]
print(json.dumps(out))
"""


def child(setting, flags: list[str]) -> dict:
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(setting), *flags], capture_output=True, text=True, check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--extra", default="", help="more server flags, e.g. '--method eagle3'")
    ap.add_argument("--out", type=Path, default=Path("experiments/results/start_pieces"))
    args = ap.parse_args()
    names = args.settings.split(",")
    flags = ["--compile", *args.extra.split()]
    child(SETTINGS["100k"], flags)  # a first start may compile: not timed
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for _ in range(args.runs):
        for n in names:
            runs[n].append(child(SETTINGS[n], flags))
            print(n, runs[n][-1], flush=True)
    med = {n: {k: round(statistics.median(r[k] for r in rs), 2) for k in rs[0]} for n, rs in runs.items()}
    cmd = f"python experiments/start_pieces.py --runs {args.runs} --settings {args.settings}" + \
        (f" --extra '{args.extra}'" if args.extra else "") + f" --out {args.out}"
    lines = [f"A later start of `serve --compile` in pieces, fresh processes, settings interleaved, medians of {args.runs} "
             f"(`{cmd}`). Thresholds: {', '.join(f'{n} {SETTINGS[n]}' for n in names)}.", "",
             "| collector | imports s | loading s | saved graphs + warm-up s | total s |", "|---|---|---|---|---|"]
    for n in names:
        m = med[n]
        lines.append(f"| {n} | {m['imports_s']} | {m['load_s']} | {m['graphs_s']} | {m['total_s']} |")
    lines += ["", "Collections during a 128-token answer after the start (thresholds back to the default, the start frozen "
                 "unless the setting is the default): " + ", ".join(f"{n} {med[n]['decode_collections']:.0f}" for n in names) + "."]
    if "off" in med:
        m = med["off"]
        lines += ["", f"With the collector off, a full collection after the start found {m['unreachable']:.0f} unreachable "
                  f"objects, took {m['collect_s']} s and freed {m['rss_freed_mb']:.0f} MB of resident memory (medians)."]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"runs": runs, "medians": med, "command": cmd}, indent=1))
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
