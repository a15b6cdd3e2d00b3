"""Load a user's policy class by name: one loader for the runtime's CLI, its bench and the sim.

A policy is named ``package.module:Class`` (importable from ``sys.path``; ``python -m`` puts the
working directory there) or ``path/to/file.py:Class``. Loading runs that module's code: it is
the user's own code, asked for explicitly, and nothing here sandboxes it. Every failure is one
:class:`~specblock.errors.SpecBlockError` line saying what to fix (not found, not a subclass of
the base the slot needs, keyword arguments that do not fit), so the CLIs exit with status 2.

Why a loader of our own rather than each caller's ``importlib`` call: the same spelling must mean
the same class in the sim and in the runtime (the shared-policy promise), and every caller then
refuses bad names the same way.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import sys
from pathlib import Path

from specblock.errors import SpecBlockError

__all__ = ["load_class", "build", "parse_kwargs", "source_file"]


def _import(module: str, spec: str):
    if module.endswith(".py"):
        path = Path(module).expanduser()
        if not path.is_file():
            raise SpecBlockError(f"{spec}: no file {path}")
        name = "specblock_user_" + "_".join(path.resolve().with_suffix("").parts[-3:]).replace("-", "_")
        if name in sys.modules:  # one module object per file: the same class every time
            return sys.modules[name]
        loader = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(loader)
        sys.modules[name] = mod
        try:
            loader.loader.exec_module(mod)
        except BaseException:
            del sys.modules[name]
            raise
        return mod
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and (module == e.name or module.startswith(e.name + ".")):
            raise SpecBlockError(f"{spec}: no module {e.name!r} (is its folder on PYTHONPATH, or give path/to/file.py:Class)") from None
        raise SpecBlockError(f"{spec}: importing {module} failed: {e}") from None


def load_class(spec: str, base: type, flag: str = "policy") -> type:
    """The class ``spec`` names, checked to be ``base`` or a subclass of it."""
    module, sep, name = str(spec).rpartition(":")
    if not sep or not module or not name.isidentifier():
        raise SpecBlockError(f"{flag}: {spec!r} is not package.module:Class (or path/to/file.py:Class)")
    try:
        mod = _import(module, spec)
    except SpecBlockError as e:
        raise SpecBlockError(f"{flag}: {e}") from None
    except Exception as e:  # the user's module raised while importing: say so in one line
        first = str(e).splitlines()[0] if str(e) else ""
        raise SpecBlockError(f"{flag}: importing {module} raised {type(e).__name__}: {first}") from None
    cls = getattr(mod, name, None)
    if cls is None:
        raise SpecBlockError(f"{flag}: {module} has no {name}")
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise SpecBlockError(f"{flag}: {spec} is not a subclass of {base.__module__}.{base.__name__}")
    return cls


def source_file(spec: str) -> Path | None:
    """The file that defines the class ``spec`` names, found without importing it (None when it
    cannot be found): the sim's sweep cache keys on its contents."""
    module = str(spec).rpartition(":")[0]
    if module.endswith(".py"):
        return Path(module).expanduser()
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    return Path(found.origin) if found is not None and found.origin else None


def parse_kwargs(value, flag: str = "policy-kwargs") -> dict:
    """Keyword arguments from a dict, a JSON object string, or None (no arguments)."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise SpecBlockError(f"{flag}: not valid JSON ({e.msg}); give an object, e.g. '{{\"k\": 3}}'") from None
    if not isinstance(value, dict):
        raise SpecBlockError(f"{flag}: give a JSON object of keyword arguments, e.g. '{{\"k\": 3}}'")
    return dict(value)


def build(spec: str, kwargs, base: type, flag: str = "policy", defaults: dict | None = None,
          kwargs_flag: str | None = None):
    """An instance of the class ``spec`` names, built with ``defaults`` updated by ``kwargs``.

    ``defaults`` are what the caller would give its own class (a bandit's arms and seed): each
    is passed only where the user's class accepts it, so a subclass with its own signature works.
    Keyword arguments the class does not take, or that its constructor rejects, are one line.
    """
    kflag = kwargs_flag or f"{flag}-kwargs"
    cls = load_class(spec, base, flag)
    user = parse_kwargs(kwargs, kflag)
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):
        sig = None
    given = dict(user)
    if defaults:
        takes_any = sig is None or any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
        for k, v in defaults.items():
            if k not in given and (takes_any or k in sig.parameters):
                given[k] = v
    if sig is not None:
        try:
            sig.bind(**given)
        except TypeError as e:
            names = ", ".join(p for p in sig.parameters if p not in ("self", "args", "kwargs")) or "none"
            raise SpecBlockError(f"{kflag} {json.dumps(user, default=str)} do not fit {cls.__name__} ({e}); "
                                 f"it takes: {names}") from None
    try:
        return cls(**given)
    except (TypeError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SpecBlockError(f"{kflag} {json.dumps(user, default=str)} rejected by {cls.__name__}: {first}") from None
