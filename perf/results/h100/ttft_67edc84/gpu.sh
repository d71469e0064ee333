#!/usr/bin/env bash
# One device call at 67edc84 (a clean copy of the commit, carried as .carry_head): the compiled tail
# prefill (issue 46, TTFT of a cached 32k context + a 256-token question). The GPU tests of the
# tail op, the compiled tail and the prompt cache, then `perf prompt-cache` on the Llama-3.1-8B
# shape (the TTFT ratio against a fresh prefill in the same run; target <= 0.05), then
# perf/experiments/ttft_profile.py (phases, CPU vs CUDA time, launches, compiles at other tail
# lengths). Budget ~7 min: install ~0.5, tests <= 2.3, prompt-cache <= 2.8, profile <= 1.4.
set -uo pipefail
cd .carry_head
export MINIKV_GIT_SHA=67edc84 PYTHONUNBUFFERED=1
bash perf/gpu_check.sh "$OUT" > /dev/null
ROOT=$(pwd); export PYTHONPATH=/tmp/mk; cd /tmp/run
timeout 140 python -m pytest -q -m gpu -p no:cacheprovider --durations=6 --rootdir "$ROOT" \
  $ROOT/tests/test_tail_attention.py $ROOT/tests/test_tail_compiled.py \
  $ROOT/tests/test_prompt_cache.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -12
mkdir -p "$OUT/pc"
timeout 170 python -m minikv_compile.perf prompt-cache --out "$OUT/pc" > "$OUT/pc/prompt-cache.log" 2>&1
echo "prompt-cache exit code $?"; tail -3 "$OUT/pc/prompt-cache.log"
sed -n '/^## A cached/,/^## Compile/p' "$OUT/pc/prompt-cache.md" | head -20
grep -E "^- (target|chat prefill)" "$OUT/pc/prompt-cache.md"
timeout 85 python $ROOT/perf/experiments/ttft_profile.py > "$OUT/ttft_profile.log" 2>&1
echo "ttft_profile exit code $?"
grep -E "^(call |question |one call)" "$OUT/ttft_profile.log"
grep -m1 -A14 "Self CPU %" "$OUT/ttft_profile.log" | cut -c1-150
cat "$OUT/gpu.txt"
