#!/usr/bin/env bash
# The GPU machine's install and GPU tests, from the repo root:
#   perf/gpu_check.sh OUTDIR [test files]
# Installs the project in editable mode (no dependencies: the machine brings torch, triton and
# transformers), writes the GPU, driver, clocks and versions to OUTDIR/gpu.txt, and with test
# files runs their GPU-marked tests into OUTDIR/gpu_tests.log. The commit is $MINIKV_GIT_SHA
# when set (a copy of the tree without .git), else the checkout's.
set -uo pipefail
OUT=${1:?usage: perf/gpu_check.sh OUTDIR [test files]}; shift || true
export PYTHONUNBUFFERED=1
pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -5
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python -c "import torch, triton, transformers, minikv_compile.graphs; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
echo "git ${MINIKV_GIT_SHA:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}" | tee -a "$OUT/gpu.txt"
if [ $# -gt 0 ]; then
  timeout 420 python -m pytest -q -m gpu -p no:cacheprovider "$@" 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
fi
