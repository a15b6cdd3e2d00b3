"""Training checkpoints as one safetensors file: the tensors (weights, optimiser moments, RNG
states) in its body, everything else (step, optimiser hyper-parameters, numpy RNG state, the
run's flags) as JSON in its header.

Why not ``torch.save``: unpickling a file can run any code it names, and a run directory is
just a folder someone may hand you (issue 15: a crafted ``ckpt.pt`` ran a shell command on
resume). Nothing here unpickles; a pickle left by an older version is refused by name. One file
keeps the write atomic (temporary file, then ``os.replace``), which a weights file plus a JSON
file beside it could not be.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specblock.errors import SpecBlockError

META_KEY = "specblock_checkpoint"
TENSOR, TUPLE, ITEMS = "__tensor__", "__tuple__", "__items__"


def _encode(obj: Any, key: str, tensors: dict[str, torch.Tensor], seen: dict[int, str]) -> Any:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        if t.numel() and t.untyped_storage().data_ptr() in seen:  # tied weights: safetensors refuses shared storage
            t = t.clone()
        if t.numel():
            seen[t.untyped_storage().data_ptr()] = key
        tensors[key] = t
        return {TENSOR: key}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and k not in (TENSOR, TUPLE, ITEMS) for k in obj):
            return {k: _encode(v, f"{key}/{k}", tensors, seen) for k, v in obj.items()}
        return {ITEMS: [[k, _encode(v, f"{key}/{k}", tensors, seen)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {TUPLE: [_encode(v, f"{key}/{i}", tensors, seen) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, f"{key}/{i}", tensors, seen) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)  # paths and the like in the run's flags: kept for the record only


def _decode(obj: Any, f) -> Any:
    if isinstance(obj, dict):
        if TENSOR in obj:
            return f.get_tensor(obj[TENSOR])
        if TUPLE in obj:
            return tuple(_decode(v, f) for v in obj[TUPLE])
        if ITEMS in obj:
            return {k: _decode(v, f) for k, v in obj[ITEMS]}
        return {k: _decode(v, f) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v, f) for v in obj]
    return obj


def save_checkpoint(path: Path, state: dict) -> None:
    """Write ``state`` (nested dicts, lists, tuples, tensors, JSON scalars) atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    meta = json.dumps(_encode(state, "s", tensors, {}))
    tmp = path.with_name(path.name + ".tmp")
    try:
        save_file(tensors, str(tmp), metadata={META_KEY: meta})
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_checkpoint(path: Path) -> dict:
    """Read a checkpoint written by :func:`save_checkpoint`; anything else is one line."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = (f.metadata() or {}).get(META_KEY)
            if meta is None:
                raise ValueError("no specblock checkpoint header")
            return _decode(json.loads(meta), f)
    except Exception as e:  # noqa: BLE001 - truncated, empty, foreign: all the same to the user
        raise SpecBlockError(f"{path} is not a readable checkpoint ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}); "
                             "delete it to start over, or pass another --run-dir") from e


def refuse_pickles(*paths: Path) -> None:
    """Older versions pickled checkpoints; loading one could run code, so it is never read."""
    for p in paths:
        if Path(p).exists():
            raise SpecBlockError(f"{p} is a pickled checkpoint (older version); pickles are never loaded, "
                                 "since they can run code: delete it to start over, or pass another --run-dir")
