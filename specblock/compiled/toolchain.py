"""What inductor's C++ toolchain does once per machine, kept with the rest of the cache: the check
of the CPU's vector instruction sets, and precompiled headers.

Why a module: both are machine-wide facts that inductor keeps outside its cache folder (the check
in each process's memory, the headers under ``/tmp/torchinductor_$USER``), so a fresh home was not
a fresh machine (docs/compiled.md, stop 64). Tried and not kept: the check (9-10 s of g++ builds
on a first start) begun beside the model's load; on 2 cores that load and two C++ builds already
fill, the first start did not move (``first_start_ab_vecisa_s64.md``, measured at ce79e76); nor,
tried again with the sets checked side by side, did the session open sooner
(``first_start_timeline_open_vecisa_s65.md``, measured at 96a499e).
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import torch


def keep_headers(folder: Path) -> None:
    """Inductor's precompiled headers (one per set of compile flags; two a first start here, about
    5 s and 150 MB each) in ``folder`` rather than ``/tmp/torchinductor_$USER``. Why: a first start
    on an empty ``$SPECBLOCK_HOME`` reused the headers an earlier run had left in ``/tmp``, so it
    measured less than a fresh machine does, and ``/tmp`` kept every header of every run (4 GB
    here). Inductor reads the folder from a module global at each build; torch is pinned, and a
    torch without the global keeps its own place."""
    from torch._inductor import codecache

    if hasattr(codecache, "_HEADER_DIR") and hasattr(codecache, "_HEADER_LOCK_DIR"):
        codecache._HEADER_DIR = str(folder)
        codecache._HEADER_LOCK_DIR = str(folder / "locks")


def _recorded(cache_dir: Path) -> list[str] | None:
    try:
        known = json.loads((cache_dir / "vec_isa.json").read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(known, dict) and known.get("torch") == torch.__version__ and known.get("valid")
    return list(known["valid"]) if ok else None


def _checks_here() -> bool:
    from torch._inductor import config

    return config.cpp.vec_isa_ok is None and platform.machine() in ("x86_64", "AMD64")


def remember_vec_isa(cache_dir: Path) -> None:
    """Skip inductor's per-process check of the CPU's vector instruction sets when this machine's
    answer is on record. Why: before it loads or compiles a first graph, inductor builds a test
    library for each instruction set the CPU reports and ``dlopen``s it in a child Python, every
    process: 0.9 s of a 4.2 s first call of a saved graph in a profiled later start. The answer
    does not change on one machine and torch build, so the first process records the sets that
    passed (``vec_isa.json`` beside the graphs); a later one takes every set the CPU reports as
    passing (``cpp.vec_isa_ok``) only if that gives the recorded list, and checks as before if not
    (another CPU behind the same cache folder, a set that failed to build)."""
    from torch._inductor import config, cpu_vec_isa

    if not _checks_here():
        return  # set by the user, or an architecture this was not measured on
    names = lambda: [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]  # noqa: E731
    known = _recorded(cache_dir)
    if known is not None:
        config.cpp.vec_isa_ok = True
        cpu_vec_isa.valid_vec_isa_list.cache_clear()
        if names() == known:
            return
        config.cpp.vec_isa_ok = None
        cpu_vec_isa.valid_vec_isa_list.cache_clear()
    from specblock.atomic import write_atomic

    try:
        write_atomic(cache_dir / "vec_isa.json", json.dumps({"torch": torch.__version__, "valid": names()}))  # the check, once
    except OSError:
        pass  # a read-only cache: every process checks, as before
