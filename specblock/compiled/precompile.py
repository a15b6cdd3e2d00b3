"""Later starts without tracing: a compiled target's graphs saved with dynamo's precompile cache.

Why: inductor's FX-graph and AOT-autograd caches on disk skip the C++ builds, but every new
process still traced the model with dynamo (and, with ``freezing``, AOT autograd) before it could
look them up: most of a warm start (issue 16 asks for under 10 s). With torch's
``caching_precompile``, dynamo saves what it compiled for a function (bytecode, guards, the
compiled graphs) under the inductor cache directory (``<dir>/dynamo``), and a later
``torch.compile`` of that function loads it and traces nothing until a guard fails.

Three choices here:

- The flag is on only while a compiled target is created and while it meets a new shape (the
  calls that compile), not process-wide: it changes how dynamo builds guards for every function it
  compiles, and other code in the process (HF's ``generate`` with ``torch.compile``) is not ours.
- An entry is keyed by the function's qualname and first line, the same for every model; each
  target's copy of the code (``own_code``) is tagged with its model's structure, dtype and compile
  options (``tag``), so models never share an entry, and with the shape it serves: one function,
  and so one entry, per shape, loaded when the shape is first met (``StaticTarget.step_fns``).
  Weights are not in the key: unfrozen graphs read them as inputs, and packed linears' keys are
  guarded constants.
- torch marks the feature experimental, and a saved entry that fails to load makes its
  ``torch.compile`` raise. Then the entry is removed and the target compiles as before (one warning):
  slower to start, same graphs.

Entries are pickles, as inductor's own caches are: the cache folder (under ``$SPECBLOCK_HOME``)
must be as trusted as the code, since loading a crafted entry runs code.

Which targets save: the whole-forward compile on CPU without inductor's ``freezing`` (it turns
off the AOT-autograd cache these entries need), the default (``CPU_OPTIONS`` in
``compiled/target.py``). Not CUDA graphs, and not ``--compile-mode regions``: torch 2.13 cannot
save the guards of its region calls and then fails an assertion.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
import shutil
import types
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from specblock.compiled.toolchain import keep_headers, remember_vec_isa
from specblock.models.registry import specblock_home


def tag(model: torch.nn.Module, options: dict[str, Any]) -> str:
    """What a compiled step's graphs depend on besides the shapes dynamo guards: the module tree
    (classes and sizes, ``repr``), the model's config, dtype, compile options and torch version."""
    p = next(model.parameters())
    config = getattr(model, "config", None)
    opts = {k: str(v.uuid()) if hasattr(v, "uuid") else repr(v) for k, v in sorted(options.items())}  # a pass by its uuid
    text = json.dumps([repr(model), config.to_json_string() if config is not None else "", str(p.dtype), str(p.device.type),
                       opts, torch.__version__])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@contextmanager
def recording() -> Iterator[None]:
    """Dynamo saves what it compiles in here for ``save``, and loads saved entries at ``torch.compile``.

    Dynamo's guard builder warns once per global it leaves unguarded in a saved entry (``torch``, the
    model's modules, each layer's hooks: about 150 lines per graph on the real model). That is how
    these entries are made, not a fault, so those warnings are held back while recording."""
    guards_log = logging.getLogger("torch._dynamo.guards")
    level = guards_log.level
    guards_log.setLevel(logging.ERROR)
    try:
        with torch._dynamo.config.patch(caching_precompile=True):
            yield
    finally:
        guards_log.setLevel(level)


def compile_saved(fn: Callable, **kw: Any) -> Callable:
    """``torch.compile(fn, **kw)``, with the graphs a previous process saved for ``fn`` loaded.
    A saved entry that does not load is removed and ``fn`` compiled without it."""
    try:
        with recording(), _guards_built_once():
            compiled = torch.compile(fn, **kw)
        _skip_loaded_names(fn.__globals__)
        return compiled
    except Exception as exc:  # an entry from another torch build, a changed source, a torch bug
        # A load can fail after installing the entry's globals (a guard on a registry that is
        # shorter in this process raised IndexError); the compile below must not reuse their names.
        _skip_loaded_names(fn.__globals__)
        shutil.rmtree(entry_path(fn), ignore_errors=True)
        warnings.warn(f"specblock: a saved compiled graph did not load ({type(exc).__name__}); compiling "
                      "again (slower start, same graphs)", stacklevel=2)
        return torch.compile(fn, **kw)


@contextmanager
def _guards_built_once() -> Iterator[None]:
    """Load a saved entry's guards with one build pass, not two. Why: while ``caching_precompile``
    is on, dynamo's ``CheckFunctionManager`` builds a graph's guards twice, the first pass only to
    drop the guard kinds a saved entry cannot hold (``ID_MATCH``, ``DICT_VERSION``, ...). An entry
    saved under that flag holds none of them (the same filter ran before it was saved), so at load
    the first pass drops nothing. Loading with the flag off for the guard build alone skips it: the
    same guards, built once. The real model's default server (8 saved graphs) started in 8.43 s
    against 9.61 s with the guards built twice, interleaved (``experiments/start_time.py --ab
    guards``, ``start_time_default_warm_s56_guards.md``). Where torch has no such function, nothing
    changes."""
    from torch._dynamo import package

    load = getattr(package, "load_guard_manager", None)
    if load is None:
        yield
        return

    def load_once(*args: Any, **kw: Any) -> Any:
        with torch._dynamo.config.patch(caching_precompile=False):
            return load(*args, **kw)

    package.load_guard_manager = load_once
    try:
        yield
    finally:
        package.load_guard_manager = load


def _skip_loaded_names(scope: dict[str, Any]) -> None:
    """A loaded entry puts its globals (``__compiled_fn_7``, ``__builtins_dict___3``, ...) into the
    function's module under the names the saving process drew from dynamo's counter; a fresh process
    counts from 0 again, so its first new compile (a new tree size) clashed with them ("Name ...
    already exists in scope"). Move the counter past the highest loaded name."""
    from torch._dynamo import bytecode_transformation as bt

    taken = [int(m.group(1)) for name in scope if name.startswith("__") and (m := _NUMBERED.search(name))]
    if taken:
        bt._unique_id_counter = itertools.count(max(next(bt._unique_id_counter), max(taken) + 1))


_NUMBERED = re.compile(r"_(\d+)$")


def entry_path(fn: Callable) -> Path:
    """The folder dynamo keeps ``fn``'s saved entry in."""
    from torch._dynamo.package import CompilePackage, DynamoCache

    return Path(DynamoCache.path_prefix()) / CompilePackage.source_id_from_fn(fn)


def first_call(fn: Callable, *args: Any) -> Any:
    """A compiled function's first call at a new shape: recorded, and saved if it compiled a graph
    (rather than loading one)."""
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    with recording():
        out = fn(*args)
    if counters["stats"]["unique_graphs"] != graphs:
        save()
    return out


def save() -> None:
    """Write every entry compiled in this process so far (with the ones it loaded) to the disk
    cache (atomically, per entry); called after a call that compiled, so the next process finds it.
    A failed save (a full disk, something dynamo cannot pickle) costs later starts, not this run:
    one warning."""
    from torch._dynamo.precompile_context import PrecompileContext

    try:
        PrecompileContext.save_to_dynamo_cache()
    except Exception as exc:
        warnings.warn(f"specblock: compiled graphs not saved for later starts ({type(exc).__name__}: "
                      f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else exc!r})", stacklevel=2)


def use_disk_cache() -> Path:
    """Inductor's compiled graphs (FX graph and AOT-autograd caches, on by default) go under
    ``$SPECBLOCK_HOME/inductor`` unless ``TORCHINDUCTOR_CACHE_DIR`` says otherwise: the default
    ``/tmp/torchinductor_$USER`` does not survive a reboot, and a warm start skips the C++ builds.
    Importing inductor writes that default into the environment itself, so a value equal to it
    counts as unset (until this was checked, every artefact went to /tmp). Also spares later
    processes inductor's vector-ISA check, and keeps its precompiled headers under the home either
    way (``compiled/toolchain.py``)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not given or os.path.abspath(given) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(specblock_home() / "inductor")
    path = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    path.mkdir(parents=True, exist_ok=True)
    keep_headers(specblock_home() / "inductor" / "precompiled_headers")
    remember_vec_isa(path)
    return path


def own_code(fn, tag: str | None = None):
    """``fn`` (a function or bound method) on a copy of its code object. Why: dynamo keeps its
    compiled graphs per code object, and before each call walks the guards of that code's graphs
    until one matches. Every compiled target compiled the same ``_step``, so with several in one
    process (a bench's ``ar@c`` beside ``specblock@c``, a measurement's baseline) each call first
    failed the others' graphs' guards. With a code object each, a target sees only its own graphs.
    ``tag`` goes into the copy's qualname, which keys dynamo's saved entries (``compiled/precompile.py``)."""
    bound = getattr(fn, "__self__", None)
    f = getattr(fn, "__func__", fn)
    copy = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    copy.__kwdefaults__, copy.__doc__ = f.__kwdefaults__, f.__doc__
    copy.__qualname__ = f.__qualname__ if tag is None else f"{f.__qualname__}[{tag}]"
    return copy if bound is None else types.MethodType(copy, bound)


def shape_tag(tag: str | None, shape: tuple) -> str | None:
    """A per-shape function's tag (its saved entry's key): the model's tag and the shape."""
    return None if tag is None else f"{tag}:{'x'.join(str(v) for v in shape)}"
