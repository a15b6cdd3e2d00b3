"""The entry points start with the garbage collector's thresholds raised and, once loaded and warmed,
freeze what the start built and put the thresholds back (``specblock/gcstart.py``); a library user's
process is left alone. Each check runs in a child: a freeze in the test process would keep every
object it holds out of later collections."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tiny import save_tiny

ROOT = Path(__file__).resolve().parents[1]

UNIT = r"""
import gc
from specblock import gcstart
default = gc.get_threshold()
gcstart.done()
assert gc.get_freeze_count() == 0, "done() without begin() froze the process"
assert gc.get_threshold() == default
gcstart.begin()
assert gc.get_threshold() == gcstart.START_THRESHOLDS
gcstart.begin()  # a second begin keeps the first one's thresholds to put back
gcstart.done()
assert gc.get_threshold() == default, gc.get_threshold()
assert gc.get_freeze_count() > 0
gcstart.done()  # once only
print("ok")
"""

# The module run as ``python -m`` runs it; the collector's state read when it exits.
ENTRY = r"""
import atexit, gc, json, runpy, sys
module = sys.argv[1]
sys.argv = [module, *sys.argv[2:]]
atexit.register(lambda: print(json.dumps({"threshold": gc.get_threshold(), "frozen": gc.get_freeze_count()})))
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""

LIBRARY = r"""
import gc, sys
from specblock.runtime.cli import main
code = main(sys.argv[1:])
assert code == 0, code
assert gc.get_freeze_count() == 0, "a library call froze its caller's objects"
print("ok")
"""

SERVE = r"""
import gc, sys
from specblock import gcstart
gcstart.begin()
from specblock.serve.cli import open_service, parse
open_service(*parse(sys.argv[1:]))
assert gc.get_threshold() != gcstart.START_THRESHOLDS, "the server kept the start's thresholds"
assert gc.get_freeze_count() > 100_000
print("ok")
"""


def child(code: str, *args: str) -> str:
    p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("gcstart") / "m", "llama", vocab=96, ctx=256)


def flags(model_dir: Path, cli: bool = True) -> list[str]:
    run = ["--target", str(model_dir), "--dtype", "float32", "--method", "lookup", "--max-new-tokens", "4"]
    return [*run, "--prompt", "hello", "--raw"] if cli else run


def test_begin_and_done():
    assert child(UNIT).split() == ["ok"]


def test_the_cli_entry_point_freezes_its_start_and_restores_the_thresholds(model_dir):
    import gc

    state = json.loads(child(ENTRY, "specblock.runtime", *flags(model_dir), "--json").splitlines()[-1])
    assert tuple(state["threshold"]) == gc.get_threshold()  # the default, as in this process
    assert state["frozen"] > 100_000  # torch, transformers and the model, at least


def test_the_runtime_as_a_library_leaves_the_collector_alone(model_dir):
    assert child(LIBRARY, *flags(model_dir)).split()[-1] == "ok"


def test_the_server_freezes_its_start_once_warmed(model_dir):
    assert child(SERVE, *flags(model_dir, cli=False)).split()[-1] == "ok"
