"""Static shapes and compiled forwards for the hot path (opt-in: ``--compile``).

A room above ``runtime``: it imports ``runtime`` and ``policies``; ``runtime`` reaches it only
through the CLI's lazy ``--compile`` hook (``runtime.cli``), never at import time.
"""

from specblock.compiled.target import BUCKETS, StaticTarget, bucket_of, span_of
from specblock.runtime.target import TargetModel


def compile_target(target: TargetModel) -> StaticTarget:
    """The CLI's ``--compile``: the loaded target behind static shapes, compiled per bucket on
    first use (inductor on CPU, CUDA graphs on CUDA)."""
    return StaticTarget.wrap(target, compile=True)


__all__ = ["BUCKETS", "StaticTarget", "bucket_of", "compile_target", "span_of"]
