#!/usr/bin/env bash
# One device call at ea0330b (a clean copy of the commit, carried as .carry_head): the GPU tests of the
# sampling fix, the tail attention and the prompt cache (and of the attention files that were
# split), then the tail op's benchmark and `perf prompt-cache` on the Llama-3.1-8B shape.
set -uo pipefail
cd .carry_head
export MINIKV_GIT_SHA=ea0330b PYTHONUNBUFFERED=1
bash perf/gpu_check.sh "$OUT" > /dev/null
ROOT=$(pwd); export PYTHONPATH=/tmp/mk; cd /tmp/run
timeout 230 python -m pytest -q -m gpu -p no:cacheprovider --durations=8 --rootdir "$ROOT" \
  $ROOT/tests/test_sampling.py $ROOT/tests/test_tail_attention.py $ROOT/tests/test_prompt_cache.py \
  $ROOT/tests/test_decode_attention.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
timeout 60 python -m minikv_compile.perf.bench_tail_attention --out "$OUT/bench_tail_attention.json" 2>&1 | tail -12
timeout 260 python -m minikv_compile.perf prompt-cache --out "$OUT/pc" 2>&1 | tail -30
cat "$OUT/gpu.txt"
