"""Our C++ op libraries, built on first use: one build per source text and torch version, under
``$SPECBLOCK_HOME/extensions`` (a new torch or a changed source gets a fresh build, never a stale .so).

Why one helper: four libraries (q4's kernels, packed-fp16's compiled linear, the tree attention, the
RMSNorm of ``exact_parts``) build the same way. ``no_implicit_headers`` keeps ``load_inline`` from adding
``torch/extension.h`` (all of libtorch's C++ API and pybind11): 7.1 s instead of 26.9 s a build
(``experiments/native_build_time.py``). Each library registers its ops with ``TORCH_LIBRARY``, so
nothing is imported as a Python module.
"""

from __future__ import annotations

import functools
import hashlib
import subprocess
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from specblock.cpu import cpu_flags  # noqa: F401  (the kernels ask cext; tests patch it here)

#: at::parallel_for is an OpenMP region compiled into the library: without these, one thread.
OPENMP = (["-O3", "-fopenmp"], ["-fopenmp"])


def build_name(prefix: str, source: str, torch_dir: str | None = None) -> str:
    """One build folder per source text, torch version and torch installation. Why the
    installation: the build command names torch's headers and libraries by path, so two virtual
    environments sharing one ``$SPECBLOCK_HOME`` (a checkout and a clone) made ninja rebuild every
    library each time a process from the other one ran (5-6 s a library, in turns, in this
    project's own build logs)."""
    where = torch_dir if torch_dir is not None else str(Path(torch.__file__).resolve().parent)
    return f"{prefix}_{hashlib.sha256((source + torch.__version__ + where).encode()).hexdigest()[:12]}"


#: Builds begun in the background (``start_build``), by library name and flags.
_STARTED: dict[tuple, Future] = {}


def _key(prefix: str, source: str, cflags: list[str], ldflags: list[str] | None) -> tuple:
    return build_name(prefix, source), tuple(cflags), tuple(ldflags or ())


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=2, thread_name_prefix="specblock-build")


def start_build(prefix: str, source: str, cflags: list[str], ldflags: list[str] | None = None) -> None:
    """Begin ``build`` in a background thread; a later ``build`` of the same library and flags waits
    for it (and raises what it raised). Why: on a first start the C++ compiler then runs beside the
    model's load, on the core that load leaves idle, instead of after it (``compiled.prebuild``);
    on a later start the build is ninja's check that nothing changed, overlapped too."""
    key = _key(prefix, source, cflags, ldflags)
    if key not in _STARTED:  # copies: torch appends to the lists it is given
        _STARTED[key] = _pool().submit(_build_now, prefix, source, list(cflags), list(ldflags or ()))


def build(prefix: str, source: str, cflags: list[str], ldflags: list[str] | None = None) -> None:
    """Compile (or load the saved build of) ``source`` and register its ops in this process."""
    started = _STARTED.get(_key(prefix, source, cflags, ldflags))
    if started is not None:
        started.result()
        return
    _build_now(prefix, source, list(cflags), list(ldflags or ()))  # copies, as in start_build


#: The libraries this process has loaded (build name -> folder), and a lock per name. Why: a library
#: registers its ops with ``TORCH_LIBRARY``, and a second copy of it in one process registers the
#: same namespace again, which aborts the process (no exception). A second load of the same file is
#: harmless, but the folder follows ``$SPECBLOCK_HOME`` at build time, and another flag set makes
#: torch build a renamed copy; a background build (``start_build``) after a synchronous one found no
#: record of it. A CI worker aborted so in stop 67, loading a library in a build thread mid-test.
_LOADED: dict[str, str] = {}
_NAME_LOCKS: dict[str, threading.Lock] = {}
_LOCKS_LOCK = threading.Lock()


def _build_now(prefix: str, source: str, cflags: list[str], ldflags: list[str] | None = None) -> None:
    from torch.utils.cpp_extension import load_inline

    from specblock.models.registry import specblock_home

    name = build_name(prefix, source)
    with _LOCKS_LOCK:
        lock = _NAME_LOCKS.setdefault(name, threading.Lock())
    with lock:  # one build and load of a library at a time; other libraries build beside it
        if name in _LOADED:
            return
        where = specblock_home() / "extensions" / name
        where.mkdir(parents=True, exist_ok=True)
        load_inline(name, cpp_sources=[source], is_python_module=False, build_directory=str(where),
                    extra_cflags=cflags, extra_ldflags=ldflags or [], verbose=False, no_implicit_headers=True)
        _LOADED[name] = str(where)


def build_or_why(prefix: str, source: str, fakes: dict[str, Callable]) -> str | None:
    """``build`` with OpenMP, then each op's fake (what tracing sees): None, or in one line why it
    failed (a missing compiler or headers), for the caller's one warning and fallback."""
    try:
        build(prefix, source, *OPENMP)
        for op, fake in fakes.items():
            torch.library.register_fake(op, fake)
    except Exception as exc:  # noqa: BLE001 - any build failure means the caller's fallback
        lines = str(exc).strip().splitlines()
        return f"it could not be built ({type(exc).__name__}: {lines[-1] if lines else exc!r})"
    return None


#: A line of a C++ source that stands for another file beside it (one translation unit, split so
#: that no file grows past one job; the text built and hashed is the whole).
INCLUDE = "// @include "


def read_source(path: Path, read: Callable[[Path], str] | None = None) -> str:
    """``path``'s text with each ``// @include NAME`` line replaced by the text of ``NAME`` beside it
    (one level). ``read``: how a file is read (default: from disk)."""
    read = read or (lambda p: p.read_text())
    lines = read(path).splitlines(keepends=True)
    return "".join(read(path.parent / line[len(INCLUDE):].strip()) if line.startswith(INCLUDE) else line
                   for line in lines)


def build_revision(prefix: str, path: str, rev: str):
    """The library ``prefix`` as its source ``path`` (relative to the repository, its includes too)
    stood at git revision ``rev``, built and registered as ``prefix + "_base"``; returns that op
    namespace. For experiments that time an op against its own earlier version in one process."""
    root = Path(__file__).resolve().parents[2]

    def at_rev(p: Path) -> str:
        return subprocess.run(["git", "show", f"{rev}:{p.as_posix()}"], cwd=root, check=True, capture_output=True,
                              text=True).stdout

    source = read_source(Path(path), at_rev)
    base = f"{prefix}_base"
    for macro in ("TORCH_LIBRARY", "TORCH_LIBRARY_IMPL"):
        source = source.replace(f"{macro}({prefix},", f"{macro}({base},")
    build(base, source, *OPENMP)
    return getattr(torch.ops, base)
