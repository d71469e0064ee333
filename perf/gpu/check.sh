#!/usr/bin/env bash
# One GPU session step: install, GPU tests. Usage: perf/gpu/check.sh OUTDIR [test files]
# The project is installed as a regular wheel into /tmp/mk and everything runs from /tmp/run, so
# the installed package (with its package-dir mapping) is imported, not the folders of the tree.
set -uo pipefail
OUT=${1:?usage: check.sh OUTDIR}; shift || true
ROOT=$(pwd)
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/mk${PYTHONPATH:+:$PYTHONPATH}
rm -rf /tmp/mk && pip install -q --no-deps --no-build-isolation --target /tmp/mk . 2>&1 | tail -5
mkdir -p /tmp/run
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
(cd /tmp/run && python -c "import torch, triton, transformers, minikv_compile.graphs; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)") | tee -a "$OUT/gpu.txt"
echo "git ${MINIKV_GIT_SHA:-unknown}" | tee -a "$OUT/gpu.txt"
if [ $# -gt 0 ]; then
  (cd /tmp/run && timeout 420 python -m pytest -q -m gpu -p no:cacheprovider --rootdir "$ROOT" "${@/#/$ROOT/}" 2>&1) | tee "$OUT/gpu_tests.log" | tail -40
fi
