import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

# One intra-op thread per test process: pytest-xdist runs one process per core, and torch's
# thread pools fighting over two cores make tiny-model forwards tens of times slower.
torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).parent))

# Compiled graphs of this test process go to a folder of its own, removed at exit: saved entries
# in a shared folder made a test's result depend on what another process (or an earlier run, on
# older code) had compiled. A folder the caller chose is kept.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="specblock-test-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], True)

from hypothesis import settings

# CI runs the same examples every time (a failure then reproduces); locally HYPOTHESIS_PROFILE=dev
# explores new ones.
settings.register_profile("ci", derandomize=True, deadline=None)
settings.register_profile("dev", deadline=None)
settings.load_profile("dev" if os.environ.get("HYPOTHESIS_PROFILE") == "dev" else "ci")
