"""A process's start with the cyclic garbage collector out of the way, then its objects frozen.

Why: importing torch and transformers, loading the model and loading a compiled target's saved
graphs (each rebuilds thousands of dynamo guards from an unpickled guard tree) create about 600k
objects that live as long as the process. At CPython's default thresholds (700, 10, 10) the
collector ran again and again over the growing heap while they piled up, finding little: on the
real model's default compiled server 2.5 s of a 9.3 s later start (``experiments/start_pieces.py``,
docs/compiled.md).

So ``python -m specblock.runtime`` and ``python -m specblock.serve`` call :func:`begin` before their
imports, and :func:`done` once the engine is loaded and warmed: the default thresholds come back
and what the start built is frozen (``gc.freeze``: moved where no collection scans it again). The
freeze also spares the first requests a full collection over all of it. Cyclic garbage the start
left behind is frozen with it rather than freed; a full collection at that point found 118k such
objects and gave back no resident memory (measured on the default server), and it would cost 0.6 s.

Only the two entry points begin; a program that imports the runtime as a library keeps its own
collector settings (:func:`done` does nothing where :func:`begin` did not run). Standard library
only, so it can run before anything heavy is imported.
"""

from __future__ import annotations

import gc

#: Gen-0 threshold high enough that the start's few hundred thousand objects see a few collections,
#: not hundreds (``start_pieces_s56.md``: 100k a start of 6.83 s, 10k 7.47 s, the default 9.3 s, off 6.71 s).
START_THRESHOLDS = (100_000, 50, 100)

_saved: tuple[int, int, int] | None = None


def begin() -> None:
    """Raise the collector's thresholds until :func:`done` (first thing in an entry point)."""
    global _saved
    if _saved is None:
        _saved = gc.get_threshold()
        gc.set_threshold(*START_THRESHOLDS)


def done() -> None:
    """The start is over: freeze what it built and put the thresholds back. A no-op unless
    :func:`begin` ran (and after the first call)."""
    global _saved
    if _saved is not None:
        gc.freeze()
        gc.set_threshold(*_saved)
        _saved = None
