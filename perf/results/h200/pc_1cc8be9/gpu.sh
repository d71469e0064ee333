#!/usr/bin/env bash
# The device call at 1cc8be9 (GPU 0 of a 4 x H200 machine, right after the tensor-parallel call of
# perf/results/h200x4/tp4_41fd31d), from a clean `git archive HEAD` copy carried as .carry_head: the
# GPU tests of the StepPlan, the runtime, the engine, the compiled tail and the prompt cache, then
# `perf prompt-cache` on the Llama-3.1-8B shape.
cd .carry_head && export MINIKV_GIT_SHA=1cc8be9 PYTHONUNBUFFERED=1
bash perf/gpu_check.sh "$OUT" > /dev/null; R=$(pwd); export PYTHONPATH=/tmp/mk; cd /tmp/run
timeout 200 python -m pytest -q -m gpu -p no:cacheprovider -x --durations=5 --rootdir $R \
  $R/tests/test_step_plan.py $R/tests/test_runtime.py $R/tests/test_engine.py \
  $R/tests/test_tail_compiled.py $R/tests/test_prompt_cache.py 2>&1 | tee $OUT/gpu_tests.log | tail -8
mkdir -p $OUT/pc; timeout 170 python -m minikv_compile.perf prompt-cache --out $OUT/pc > $OUT/pc/log 2>&1
grep -E "^- (target|chat prefill)" $OUT/pc/prompt-cache.md
