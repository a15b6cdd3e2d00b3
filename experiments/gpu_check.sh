#!/usr/bin/env bash
# The GPU check of issue 16, ready for a lent CUDA machine; nothing else depends on it.
#  1. the compiled path's tests, the CUDA one included (static buffers on the device, CUDA graphs
#     via torch.compile(mode="reduce-overhead")), lossless against HF generate at fp32;
#  2. T(n) compiled vs eager, plain decoding vs HF generate (plain / static / static+compile),
#     cold and warm compile times and the bandwidth floor, on the lab model (shipped in the repo).
# Needs: torch with CUDA, transformers 5.23, numpy, pytest, hypothesis (`pip install -e '.[test]'`).
# Usage: bash experiments/gpu_check.sh [OUT_DIR]     (PY=... picks the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
OUT=${1:-experiments/results}
mkdir -p "$OUT"
"$PY" - <<'PY'
import torch, transformers
assert torch.cuda.is_available(), "torch sees no CUDA device: this is the GPU check"
print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name())
PY
# -rs prints skip reasons: the CUDA test must say it ran, not that it was skipped.
"$PY" -m pytest -q -rs -p no:cacheprovider tests/test_compiled.py tests/test_compiled_drafter.py tests/test_compiled_eagle3.py tests/test_compiled_medusa.py 2>&1 | tee "$OUT/gpu_check_tests.txt"
"$PY" experiments/compiled_speed.py --device cuda --targets lab --reps 50 --runs 3 --tokens 128 \
    --out "$OUT/compiled_speed_cuda"
