"""First starts of the default compiled server (issue 16: under 2 minutes) with one change undone
or tried, interleaved: what a change costs or saves where everything compiles.

Each start runs on an empty ``SPECBLOCK_HOME`` of its own that links only the converted model
(``models/NAME``), so the C++ libraries build and every graph compiles, as on a fresh machine
that has fetched and converted the model once. The variants are ``start_time.py``'s
``UNDO`` (e.g. ``int8``: drafters beside the compiled packed-fp16 target on the int8 kernel, whose
library then builds too, as ``drafters.wants_int8`` chose not to).

    python experiments/first_start_ab.py --ab int8 --pairs 2 --out experiments/results/first_start_ab_int8

``--baseline-rev REV`` instead of ``--ab``: the variant is the whole project as it stood at git
revision ``REV`` (a temporary worktree, the server's working folder: ``python -m`` puts that first
on ``sys.path``, so it imports that ``specblock``; helper processes inherit it), for a change no
switch can undo, such as a C++ op's signature. (Its first version set ``PYTHONPATH`` only, which
``-m`` puts behind the working folder: both sides ran this checkout.)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_io import timing_table, write_results  # noqa: E402
from start_time import UNDO, UNDONE, serve_start  # noqa: E402


ROOT = Path(__file__).resolve().parents[1]


def first_start(model_dir: Path, name: str, undo: str | None, code: Path | None = None) -> float:
    """One first start on an empty home; ``code``: a checkout whose ``specblock`` the server runs."""
    home = Path(tempfile.mkdtemp(prefix="first_start_"))
    try:
        (home / "models").mkdir()
        (home / "models" / name).symlink_to(model_dir)
        with mock.patch.dict(os.environ, SPECBLOCK_HOME=str(home)):  # the server's process inherits it
            return serve_start([], undo, cwd=code)
    finally:
        shutil.rmtree(home, ignore_errors=True)


@contextlib.contextmanager
def worktree(rev: str):
    """The repository at ``rev`` in a temporary folder, removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="first_start_rev_")) / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", str(path), rev], cwd=ROOT, check=True, capture_output=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT, capture_output=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--ab", choices=sorted(UNDO))
    which.add_argument("--baseline-rev", help="the variant: the project at this git revision")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("experiments/results/first_start_ab"))
    args = ap.parse_args()
    from specblock.models import DEFAULT_TARGET_NAME, resolve_target

    model = Path(resolve_target(DEFAULT_TARGET_NAME)).resolve()
    times: dict[str, list[float]] = {"now": [], "variant": []}
    with worktree(args.baseline_rev) if args.baseline_rev else contextlib.nullcontext() as code:
        for i in range(args.pairs):  # the order alternates within pairs: neither side always goes first
            for side in (("now", "variant") if i % 2 == 0 else ("variant", "now")):
                now = side == "now"
                times[side].append(round(first_start(model, DEFAULT_TARGET_NAME, None if now else args.ab,
                                                     None if now else code), 2))
                print(side, times[side][-1], flush=True)
    report(args, times)


def report(args: argparse.Namespace, times: dict[str, list[float]]) -> None:
    flag = f"--ab {args.ab}" if args.ab else f"--baseline-rev {args.baseline_rev}"
    cmd = f"python experiments/first_start_ab.py {flag} --pairs {args.pairs} --out {args.out}"
    variant = UNDONE[args.ab] if args.ab else f"the project at {args.baseline_rev}"
    table, rows = timing_table(times, "first starts s", "start", {"variant": variant})
    write_results(args.out, args, rows, [f"First starts of `python -m specblock.serve --compile` until it listens, each on "
                                         f"an empty home linking only the converted model, interleaved (`{cmd}`).", "",
                                         *table])


if __name__ == "__main__":
    main()
