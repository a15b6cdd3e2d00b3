"""The package's rooms import downwards only (DESIGN.md: no import circles between parts).

Why a test: an upward import is one line and works, so nothing else would catch it until a circle
makes an import fail in some order. Ranks below are the layering as built; a room may import a room
of lower rank only. The one exception is named: the CLI's ``--compile`` hook imports
``specblock.compiled`` inside a function, on demand (``runtime/cli.py``: ``maybe_compile``,
``maybe_compile_drafter``).
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "specblock"

RANK = {
    "errors": 0,
    "buckets": 1, "q4file": 1, "data": 1, "gcstart": 1,
    "atomic": 2, "cpu": 2, "flags": 2, "prompts": 2, "policies": 2,
    "models": 3,
    "sim": 4, "runtime": 4,
    "compiled": 5, "training": 5,
    "serve": 6,
}
#: (importing file, imported room): lazy hooks, imported inside a function only
HOOKS = {("runtime/cli.py", "compiled")}


def _room(path: Path) -> str:
    rel = path.relative_to(PKG)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(imported room, at module level) for every ``specblock.X`` import in ``path``."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("specblock."):
            names = [node.module]
        elif isinstance(node, ast.ImportFrom) and node.module == "specblock":
            names = [f"specblock.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("specblock.")]
        found += [(n.split(".")[1], id(node) in top) for n in names]
    return found


def test_every_room_has_a_rank():
    rooms = {_room(p) for p in PKG.rglob("*.py")} - {"__init__", "__main__", "assets"}
    assert rooms <= set(RANK), f"rank the new room(s) here: {sorted(rooms - set(RANK))}"


def test_rooms_import_downwards_only():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        src = _room(path)
        if src not in RANK:
            continue
        rel = path.relative_to(PKG).as_posix()
        for dst, module_level in _imports(path):
            if dst == src or dst not in RANK:
                continue
            if (rel, dst) in HOOKS and not module_level:
                continue
            if RANK[dst] >= RANK[src]:
                bad.append(f"{rel} imports specblock.{dst} (rank {RANK[dst]} >= {src}'s {RANK[src]})")
    assert not bad, "\n".join(bad)


def test_the_check_sees_an_upward_import(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("from specblock.training.losses import rank_of\n\ndef g():\n    import specblock.compiled\n")
    assert _imports(f) == [("training", True), ("compiled", False)]
