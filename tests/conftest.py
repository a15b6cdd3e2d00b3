import sys
from pathlib import Path

import torch

# One intra-op thread per test process: pytest-xdist runs one process per core, and torch's
# thread pools fighting over two cores make tiny-model forwards tens of times slower.
torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).parent))

from hypothesis import settings

# CI runs the same examples every time (a failure then reproduces); locally HYPOTHESIS_PROFILE=dev
# explores new ones.
settings.register_profile("ci", derandomize=True, deadline=None)
settings.register_profile("dev", deadline=None)
settings.load_profile("dev" if __import__("os").environ.get("HYPOTHESIS_PROFILE") == "dev" else "ci")
