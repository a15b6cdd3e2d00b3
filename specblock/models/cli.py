"""``python -m specblock.runtime models``: the named targets, and whether each is built."""

from __future__ import annotations

import argparse
import json

from specblock.errors import SpecBlockError
from specblock.models.registry import DEFAULT_TARGET_NAME, MODELS, is_built, model_dir, resolve_target


def rows() -> list[dict]:
    return [{"name": name, "default": name == DEFAULT_TARGET_NAME, "built": is_built(name),
             "path": str(model_dir(name)), "source": "shipped" if spec.source is None
             else f"pip: {spec.source.package}=={spec.source.version}", "summary": spec.summary}
            for name, spec in MODELS.items()]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m specblock.runtime models", description=__doc__.splitlines()[0])
    ap.add_argument("--build", metavar="NAME", help="build this model now (otherwise built on first use)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.build is not None:
        if args.build not in MODELS:
            raise SpecBlockError(f"unknown model {args.build!r}; known: {', '.join(MODELS)}")
        print(resolve_target(args.build))
        return 0
    table = rows()
    if args.json:
        print(json.dumps(table, indent=1))
        return 0
    for r in table:
        flag = "*" if r["default"] else " "
        state = "built" if r["built"] else "not built (built on first use)"
        print(f"{flag} {r['name']:<24} {state:<32} {r['source']}\n    {r['summary']}\n    {r['path']}")
    return 0
