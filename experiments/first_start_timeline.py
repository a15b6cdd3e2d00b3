"""A first start of the default compiled server, as a timeline: when each phase begins and ends
(imports, the C++ library builds, the model's load, inductor's vector-ISA check, the drafter, the
warm-up of the target's buckets and the drafter's graphs) and how busy the CPU was each second.
Why: whole first starts move by 15% between runs on this VM, more than most changes to them; a
timeline shows which phase a change moved and whether a core sat idle.

Each run does in-process what ``python -m specblock.serve --compile`` does before it listens (less
uvicorn), on an empty ``SPECBLOCK_HOME`` linking only the converted model, as ``first_start_ab.py``.
``--until open`` stops once the session is open (before any graph compiles: the phases the
vector-ISA check moves); ``--undo NAME`` runs a side with one of ``start_time.py``'s ``UNDO``
switches (in-process Python), interleaved with the other side; ``--baseline-rev REV`` instead runs
that side from a temporary worktree of the project at git revision ``REV`` (its working folder).

    python experiments/first_start_timeline.py --runs 1 --out experiments/results/first_start_timeline_s65
    python experiments/first_start_timeline.py --until open --undo normlast --runs 2 \\
        --out experiments/results/first_start_timeline_open_normlast_s65
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from first_start_ab import worktree  # noqa: E402
from start_time import UNDO  # noqa: E402

#: The child: wraps the functions a first start passes through, logs (seconds, event) as JSON lines.
CHILD = r"""
import functools, json, sys, threading, time
T0 = time.perf_counter()
undo, until, extra = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
events = []
def log(what):
    events.append((round(time.perf_counter() - T0, 2), what))
def busy():  # the whole machine's CPU use each second, from /proc/stat
    def read():
        v = [int(x) for x in open("/proc/stat").readline().split()[1:]]
        return sum(v), v[3] + v[4]
    prev = read()
    while True:
        time.sleep(1)
        cur = read()
        tot, idle = cur[0] - prev[0], cur[1] - prev[1]
        prev = cur
        log(f"cpu {100 * (tot - idle) / max(tot, 1):.0f}")
threading.Thread(target=busy, daemon=True).start()
if undo:
    exec(undo)
else:
    import specblock.gcstart as g; g.begin()
def wrap(owner, name, label):
    f = getattr(owner, name)
    @functools.wraps(f)
    def g(*a, **k):
        log(f"begin {label}")
        try:
            return f(*a, **k)
        finally:
            log(f"end {label}")
    setattr(owner, name, g)
from specblock.serve.cli import parse
from specblock.runtime import cext, drafters
from specblock.runtime.cli import Session
from specblock.runtime.target import TargetModel
from specblock.compiled import precompile, toolchain
from specblock.compiled.target import StaticTarget
from specblock.compiled.drafter import StaticSpecBlockDrafter
log("imports done")
_build = cext._build_now
def build_now(prefix, *a, **k):
    log(f"begin build {prefix}")
    try:
        return _build(prefix, *a, **k)
    finally:
        log(f"end build {prefix}")
cext._build_now = build_now
_load = TargetModel.load.__func__
def load(cls, *a, **k):
    log("begin load")
    try:
        return _load(cls, *a, **k)
    finally:
        log("end load")
TargetModel.load = classmethod(load)
if hasattr(toolchain, "_check_sets"):  # only at 96a499e (stop 65's try, reverted): --baseline-rev 96a499e
    wrap(toolchain, "_check_sets", "vector-ISA check (background)")
wrap(precompile, "remember_vec_isa", "remember_vec_isa")
wrap(drafters, "build", "drafter")
wrap(StaticTarget, "warm", "target warm")
wrap(StaticSpecBlockDrafter, "warm", "drafter graphs")
cfg, _ = parse(["--compile", "--port", "0", *extra])
s = Session.open(cfg, None)
log("session open")
if until != "open":
    s.warm_compiled()
    log("warmed")
print("EVENTS " + json.dumps(events))
"""


def run(model_dir: Path, name: str, undo: str | None, until: str, code: Path | None = None,
        extra: list[str] | None = None) -> list[tuple[float, str]]:
    """One first start's events; ``code``: a checkout whose ``specblock`` the child imports (its
    working folder: ``-c`` puts that first on ``sys.path``); ``extra``: more server flags."""
    home = Path(tempfile.mkdtemp(prefix="first_start_tl_"))
    try:
        (home / "models").mkdir()
        (home / "models" / name).symlink_to(model_dir)
        out = subprocess.run([sys.executable, "-c", CHILD, UNDO[undo] if undo else "", until, json.dumps(extra or [])], cwd=code,
                             env=dict(os.environ, SPECBLOCK_HOME=str(home)), capture_output=True, text=True, check=True)
        line = next(ln for ln in out.stdout.splitlines() if ln.startswith("EVENTS "))
        return [tuple(e) for e in json.loads(line[len("EVENTS "):])]
    finally:
        shutil.rmtree(home, ignore_errors=True)


def phases(events: list[tuple[float, str]]) -> list[str]:
    """Each wrapped phase as 'label: begin - end s', and the seconds when one core or less was busy."""
    rows, open_ = [], {}
    for t, what in events:
        if what.startswith("begin "):
            open_.setdefault(what[6:], []).append(t)
        elif what.startswith("end "):
            label = what[4:]
            rows.append(f"{label}: {open_[label].pop(0):.1f} - {t:.1f} s")
        elif not what.startswith("cpu "):
            rows.append(f"{what}: {t:.1f} s")
    cpu = [(t, float(w.split()[1])) for t, w in events if w.startswith("cpu ")]
    rows.append(f"seconds with at most one of two cores busy (under 60%): {sum(1 for _, c in cpu if c < 60)}"
                f" of {len(cpu)}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1, help="per side")
    ap.add_argument("--until", choices=("open", "warmed"), default="warmed")
    second = ap.add_mutually_exclusive_group()
    second.add_argument("--undo", choices=sorted(UNDO), default=None, help="a second side, interleaved")
    second.add_argument("--baseline-rev", default=None, help="a second side: the project at this git revision")
    ap.add_argument("--serve-args", default="", help="more flags for the server, both sides (e.g. '--dtype packed-q4')")
    ap.add_argument("--out", type=Path, default=Path("experiments/results/first_start_timeline"))
    args = ap.parse_args()
    extra = shlex.split(args.serve_args)
    from specblock.models import DEFAULT_TARGET_NAME, resolve_target

    model = Path(resolve_target(DEFAULT_TARGET_NAME)).resolve()
    other = args.undo or (f"at {args.baseline_rev}" if args.baseline_rev else None)
    sides = ["now"] + ([other] if other else [])
    timelines: dict[str, list] = {s: [] for s in sides}
    with worktree(args.baseline_rev) if args.baseline_rev else contextlib.nullcontext() as code:
        for i in range(args.runs):
            for side in (sides if i % 2 == 0 else sides[::-1]):
                now = side == "now"
                timelines[side].append(run(model, DEFAULT_TARGET_NAME, None if now else args.undo, args.until,
                                           None if now else code, extra))
                end = next(t for t, w in reversed(timelines[side][-1]) if not w.startswith("cpu "))
                print(side, i, end, flush=True)
    flag = [f"--undo {args.undo}"] if args.undo else [f"--baseline-rev {args.baseline_rev}"] if args.baseline_rev else []
    cmd = " ".join(["python experiments/first_start_timeline.py", f"--runs {args.runs}", f"--until {args.until}",
                    *flag, *([f"--serve-args '{args.serve_args}'"] if extra else []), f"--out {args.out}"])
    md = [f"First starts of the {'compiled server with ' + args.serve_args if extra else 'default compiled server'} as timelines (`{cmd}`), each on an empty home linking only "
          f"the converted model, sides interleaved; seconds from the child's start (imports included).", ""]
    for side, runs in timelines.items():
        last = "session open" if args.until == "open" else "warmed"
        ends = [next(t for t, w in tl if w == last) for tl in runs]
        label = "now" if side == "now" else side if args.baseline_rev else f"undone: {side}"
        md.append(f"## {label}: '{last}' at {', '.join(f'{e:.1f}' for e in ends)} s (median {statistics.median(ends):.1f})")
        md.append("")
        for j, tl in enumerate(runs):
            md.append(f"Run {j + 1}:")
            md += [f"- {r}" for r in phases(tl)]
            md.append("")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"command": cmd, "timelines": timelines}, indent=1) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
