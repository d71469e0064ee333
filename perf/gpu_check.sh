#!/usr/bin/env bash
# The GPU machine's install and GPU tests, from the repo root:
#   perf/gpu_check.sh OUTDIR [test files]
# The project is installed as a regular wheel into /tmp/mk (no dependencies: the machine brings
# torch, triton and transformers) and everything runs from /tmp/run, so that the installed
# package (with its package-dir mapping) is imported, not the folders of the tree. Writes the
# GPU, driver, clocks and versions to OUTDIR/gpu.txt, and with test files runs their GPU-marked
# tests into OUTDIR/gpu_tests.log. The commit is $MINIKV_GIT_SHA (the tree travels without .git).
# Later commands of the same call: `export PYTHONPATH=/tmp/mk; cd /tmp/run`.
set -uo pipefail
OUT=${1:?usage: perf/gpu_check.sh OUTDIR [test files]}; shift || true
ROOT=$(pwd)
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/mk${PYTHONPATH:+:$PYTHONPATH}
rm -rf /tmp/mk && pip install -q --no-deps --no-build-isolation --target /tmp/mk . 2>&1 | tail -5
mkdir -p /tmp/run
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
(cd /tmp/run && python -c "import torch, triton, transformers, minikv_compile.graphs; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)") | tee -a "$OUT/gpu.txt"
echo "git ${MINIKV_GIT_SHA:-unknown}" | tee -a "$OUT/gpu.txt"
if [ $# -gt 0 ]; then
  (cd /tmp/run && timeout 540 python -m pytest -q -m gpu -p no:cacheprovider --durations=10 --rootdir "$ROOT" "${@/#/$ROOT/}" 2>&1) | tee "$OUT/gpu_tests.log" | tail -40
fi
