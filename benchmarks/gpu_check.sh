#!/usr/bin/env bash
# Everything worth running in one session on a GPU machine, as one prepared script:
# the GPU tests (tests/test_gpu.py and the other `gpu`-marked ones), then the benchmarks
# at the papers' sizes on the wall clock (docs/performance.md). Writes under $OUT
# (default benchmarks/results/cuda). Run from the repository root after `make test` has
# built .venv (with a CUDA build of torch on that machine).
#
#   bash benchmarks/gpu_check.sh              # tests, then every benchmark (paper sizes)
#   QUICK=1 bash benchmarks/gpu_check.sh      # tests, then the tiny sizes only (minutes)
set -euo pipefail
PY=${PY:-.venv/bin/python}
OUT=${OUT:-benchmarks/results/cuda}
mkdir -p "$OUT"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
"$PY" -m pytest -q -m gpu tests/ 2>&1 | tee "$OUT/gpu_tests.txt"
if [ "${QUICK:-0}" = 1 ]; then
  "$PY" benchmarks/run_all.py --quick --device cuda --out "$OUT" 2>&1 | tee "$OUT/bench.txt"
else
  "$PY" benchmarks/run_all.py --paper --device cuda --out "$OUT" 2>&1 | tee "$OUT/bench.txt"
fi
