"""Which CPU this is, in the terms our measured choices key on. No torch: ``--method auto`` asks
before any model loads."""

from __future__ import annotations

import functools
from pathlib import Path

from specblock.errors import SpecBlockError

#: The CPU kinds that measured serving choices may key on (``best.json`` and ``serving.json``
#: overrides' ``"cpu"``): which of the project's kernels run, and so what a tree row costs.
CPU_KINDS = ("amx", "avx512-bf16", "avx512", "other")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The flags of ``/proc/cpuinfo``, read once a process (every q4 linear asks at load); empty where
    it cannot be read: no AVX512 kernels then."""
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return frozenset()


@functools.cache
def cpu_model() -> str:
    """``/proc/cpuinfo``'s model name ("AMD EPYC", "Intel(R) Xeon(R) ..."), or "unknown": what a
    record measured on this very machine (``tune``) names besides its kind."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    except OSError:
        pass
    return "unknown"


def cpu_kind() -> str:
    """This CPU's kind (``CPU_KINDS``): AMX tiles (Intel Sapphire Rapids on), AVX512-BF16 without
    them (AMD Zen 4-5: q4 on the int8 kernel, where a tree row costs more than on tiles), AVX512, other.
    The best method and node budget differ between them (EAGLE-3's budget 1 measured best on a
    Zen 5 and worst on an AMX Xeon), so a measured choice may say where it holds."""
    f = cpu_flags()
    if not {"avx512f", "avx512bw"} <= f:
        return "other"
    if "avx512_bf16" not in f:
        return "avx512"
    return "amx" if {"amx_bf16", "amx_tile"} <= f else "avx512-bf16"


def holds_here(override: dict, source: Path, **here: object) -> bool:
    """Whether a measured record's ``override`` (``serving.json``'s or ``best.json``'s) holds for
    this run: each of ``here``'s keys (``dtype``, ``compiled``), ``cpu`` and ``cpu_model`` that it
    names equals this run's, ``cpu`` (a ``CPU_KINDS`` name) this machine's kind, ``cpu_model``
    (``tune``'s records) its model name. ``source`` names the file in errors."""
    cpu = override.get("cpu")
    if cpu is not None and cpu not in CPU_KINDS:
        raise SpecBlockError(f"{source}: \"cpu\" {cpu!r} is not one of {', '.join(CPU_KINDS)}")
    here = {**here, "cpu": cpu_kind()}
    if "cpu_model" in override:
        here["cpu_model"] = cpu_model()
    return all(override[k] == v for k, v in here.items() if k in override)
