#!/usr/bin/env bash
# Two device calls at 935483e on one warm H200: phase reuse with documents of 8k-16k tokens (the
# load of reuse_3ecb645, now with the burst), then the GPU tests of the scheduler, the prefix
# cache, the prompt cache, the compiled tail and the server (gpu_tests.log: 4 passed, 2 skipped).
DOC_LEN=8192,16384 bash perf/gpu/prefix_reuse.sh $OUT/reuse 935483e
MINIKV_GIT_SHA=935483e bash perf/gpu_check.sh $OUT tests/test_scheduler.py tests/test_prefix_cache.py \
  tests/test_prompt_cache.py tests/test_tail_compiled.py tests/test_serve.py
