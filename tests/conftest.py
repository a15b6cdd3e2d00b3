import sys
from pathlib import Path

import torch

# One intra-op thread per test process: pytest-xdist runs one process per core, and torch's
# thread pools fighting over two cores make tiny-model forwards tens of times slower.
torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).parent))
