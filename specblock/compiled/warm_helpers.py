"""A first start's tree sizes compiled side by side: helper processes compile some, the server the rest.

Why: a server warms every tree bucket its drafter can meet before it listens (``StaticTarget.warm``),
and on a first start each bucket compiles for about 20 s on the real model, three of them for the
default server: most of a first start that issue 16 wants under 2 minutes. That compile is mostly
one thread of Python (dynamo, AOT autograd, inductor's code generation), so on this 2-core CPU two
buckets compiled in two processes took 21-22 s together against 38 s one after the other
(``docs/compiled.md``). A helper is a fresh Python that loads the same model the same way
(``TargetModel.source``), compiles its buckets into the disk cache (``compiled/precompile.py``) and
exits; the server then loads them as a later start would.

Three choices here:

- Only buckets with no saved graph go to helpers, and only where a core is free for each
  (``helper_count``; ``SPECBLOCK_WARM_HELPERS=0`` turns them off, a number sets how many at most).
  A helper starts 6-8 s behind the server (imports, loading), so the server keeps the larger share.
- A helper checks that its graphs would be the server's (the model's ``precompile.tag``) and
  exits otherwise; any failure (or a helper still running after ``TIMEOUT_S``, then stopped)
  leaves the server to compile those buckets itself, as before, with one warning: slower to
  start, same graphs.
- Dynamo names the globals a compiled graph installs in ``compiled/target.py``'s module from a
  counter that starts at 0 in every process, and loading an entry installs its names silently over
  any the process already holds. Graphs the server compiled itself and graphs it loads from a helper
  would then share names, and the server's own graphs would call the helper's. So a helper counts
  from a random point far above (``_distinct_names``), and the server, as on every load, moves its
  counter past the names it loaded (``precompile._skip_loaded_names``).
"""

from __future__ import annotations

import argparse
import itertools
import os
import secrets
import subprocess
import sys
import tempfile
import warnings
from typing import Sequence

import torch

from specblock import gcstart

ENV = "SPECBLOCK_WARM_HELPERS"
#: A helper's share takes about 20 s a bucket here; one still running after this is stopped.
TIMEOUT_S = 600.0


def helper_count(cold: int) -> int:
    """Helpers for ``cold`` buckets to compile: one per free core, each with at least one bucket,
    the server keeping at least as many as a helper (``SPECBLOCK_WARM_HELPERS`` caps it)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    most = cores - 1
    if os.environ.get(ENV, "").strip():
        try:
            most = int(os.environ[ENV])
        except ValueError:
            warnings.warn(f"specblock: {ENV}={os.environ[ENV]!r} is not a number; no helper processes", stacklevel=2)
            most = 0
    return max(0, min(most, cold // 2))


def split(cold: Sequence[int], helpers: int) -> tuple[list[int], list[list[int]]]:
    """The server's buckets and each helper's: helpers take the smaller ones, dealt round-robin,
    ``len(cold) // (helpers + 1)`` each at most; the server keeps the rest (it starts first)."""
    cold = sorted(cold)
    if helpers < 1:
        return cold, []
    each = len(cold) // (helpers + 1)
    given = cold[:each * helpers]
    return cold[each * helpers:], [given[i::helpers] for i in range(helpers)]


class Helper:
    """One helper process compiling ``buckets`` (its stderr kept for the warning if it fails)."""

    def __init__(self, target, buckets: list[int]) -> None:
        self.buckets = buckets
        self.log = tempfile.TemporaryFile(mode="w+")
        src = target.source
        cmd = [sys.executable, "-m", "specblock.compiled.warm_helpers", "--path", src.path, "--dtype", src.dtype,
               "--device", src.device, "--attn", src.attn, "--tag", target.tag, "--threads", str(torch.get_num_threads()),
               "--taps", ",".join(map(str, target.tap_layers)), "--buckets", ",".join(map(str, buckets))]
        if src.trust_remote_code:
            cmd.append("--trust-remote-code")
        if target.want_features:
            cmd.append("--features")
        # fbgemm's GEMM in the helper's own warm-up forwards: the graphs are the same code either way, and
        # with the fp16 kernel there a first start's warm-up took about 8 s longer (docs/compiled.md, stop 66)
        env = dict(os.environ, SPECBLOCK_FP16_KERNEL="fbgemm")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.log, env=env)

    def wait(self, timeout: float = TIMEOUT_S) -> bool:
        """True when the helper compiled and saved every bucket; a warning otherwise (a helper still
        running after ``timeout`` seconds is stopped: a stuck one must not keep a server from starting)."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
            lines = [f"still running after {timeout:.0f} s"]
        else:
            self.log.seek(0)
            lines = [ln.strip() for ln in self.log.read().splitlines() if ln.strip()]
        if code != 0:
            why = lines[-1] if lines else f"exit status {code}"
            warnings.warn(f"specblock: a helper compiling {len(self.buckets)} tree size(s) failed ({why[:200]}); "
                          "compiling them here (slower start, same graphs)", stacklevel=3)
        self.log.close()
        return code == 0


def can_help(target) -> bool:
    """Whether helpers can compile for ``target``: another process can load it again (``source``,
    set by ``compile_target``) and its graphs are saved for loading (``saved``, ``tag``)."""
    return target.source is not None and target.saved and target.tag is not None


def start(target, cold: Sequence[int]) -> tuple[list[int], list[Helper]]:
    """Helpers for part of ``cold`` (``target`` passes ``can_help``); returns the buckets the
    server compiles itself and the helpers."""
    mine, shares = split(cold, helper_count(len(cold)))
    return mine, [Helper(target, share) for share in shares]


def _distinct_names() -> None:
    """This process's dynamo names from a random point far past any other process's (module doc)."""
    from torch._dynamo import bytecode_transformation as bt

    bt._unique_id_counter = itertools.count(secrets.randbelow(1 << 40) << 20)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="compile a target's tree buckets into the disk cache (a helper of "
                                             "StaticTarget.warm; not for direct use)")
    ap.add_argument("--path", required=True)
    ap.add_argument("--dtype", required=True)
    ap.add_argument("--device", required=True)
    ap.add_argument("--attn", required=True)
    ap.add_argument("--trust-remote-code", action="store_true")
    ap.add_argument("--tag", required=True, help="the server's model tag: a helper whose own differs compiles nothing")
    ap.add_argument("--threads", type=int, required=True, help="the server's: inductor's kernels are built for it")
    ap.add_argument("--taps", required=True)
    ap.add_argument("--features", action="store_true")
    ap.add_argument("--buckets", required=True)
    args = ap.parse_args(argv)
    gcstart.begin()  # a short-lived process that compiles: the collector's thresholds stay raised to its end
    torch.set_num_threads(args.threads)
    _distinct_names()
    from specblock.compiled import compile_target
    from specblock.runtime.target import TargetModel

    target = compile_target(TargetModel.load(args.path, args.dtype, args.device, args.attn, args.trust_remote_code))
    if target.tag != args.tag:
        print(f"this process would compile other graphs (tag {target.tag}, the server's {args.tag})", file=sys.stderr)
        return 3
    target.want_features = args.features
    target.tap_layers = tuple(int(t) for t in args.taps.split(",") if t)
    buckets = tuple(int(b) for b in args.buckets.split(","))
    target.warm(max(buckets), buckets, helpers=False)
    return 0


__all__ = ["Helper", "can_help", "helper_count", "split", "start"]

if __name__ == "__main__":
    sys.exit(main())
