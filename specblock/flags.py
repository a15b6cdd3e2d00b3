"""Command-line flags checked by pydantic models whose fields are the flags: one rule set per
value, shared by every command that takes it (issue 15), and a bad value is one line naming the
flag. Torch-free, like :mod:`specblock.errors`.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, NoReturn, TypeVar

from pydantic import BaseModel, ValidationError

from specblock.errors import SpecBlockError

M = TypeVar("M", bound=BaseModel)


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def one_line(e: ValidationError, name=flag_name) -> str:
    """The first error as ``--flag: what is wrong`` (pydantic's wording, without its prefixes)."""
    err = e.errors()[0]
    loc = [str(p) for p in err["loc"]]
    msg = err["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown option"
    if err["type"] == "finite_number":
        msg = "give a finite number"
    return f"{name(loc[0])}{'[' + ']['.join(loc[1:]) + ']' if len(loc) > 1 else ''}: {msg}" if loc else msg


def check(model: type[M], values: dict[str, Any], name=flag_name) -> M:
    """Build ``model`` from ``values`` (extra keys are ignored unless the model forbids them)."""
    try:
        return model.model_validate(values)
    except ValidationError as e:
        raise SpecBlockError(one_line(e, name)) from None


def env_switch(name: str, default: str = "on") -> bool:
    """An ``on``/``off`` environment switch (a load-time A/B baseline, e.g. ``SPECBLOCK_EXACT_PARTS``);
    any other value is refused in one line naming it."""
    value = os.environ.get(name, default)
    if value not in ("on", "off"):
        raise SpecBlockError(f"{name}={value!r}: use on or off")
    return value == "on"


def bad_text(value: Any) -> str | None:
    """Why ``value`` (a string, or JSON made of them) cannot be tokenized, if it cannot: lone
    surrogates come from non-UTF-8 bytes on the command line (Python's surrogateescape) or from
    ``\\ud800``-style escapes in JSON, and tokenizers refuse them with a TypeError."""
    if isinstance(value, str):
        for i, ch in enumerate(value):
            if "\ud800" <= ch <= "\udfff":
                return (f"character {i + 1} is not valid Unicode (a lone surrogate, e.g. from bytes that are "
                        "not UTF-8); give UTF-8 text")
        return None
    if isinstance(value, dict):
        value = list(value.keys()) + list(value.values())
    if isinstance(value, (list, tuple)):
        return next((why for v in value if (why := bad_text(v))), None)
    return None


class OneLineParser(argparse.ArgumentParser):
    """argparse with the project's error contract: one line on stderr, status 2, no usage dump
    (subcommand parsers inherit it)."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)
