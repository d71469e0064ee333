#!/usr/bin/env bash
# Issue 46 on one GPU, from the repo root: perf/gpu/prompt_cache.sh OUTDIR
# Installs the project (perf/gpu_check.sh), runs the GPU tests of the prompt cache and its tail
# op, then `python -m minikv_compile.perf prompt-cache` on the Llama-3.1-8B shape (random
# weights, bf16) into OUTDIR, and prints its table and target lines. ~4-6 min on an H100.
set -uo pipefail
OUT=${1:?usage: perf/gpu/prompt_cache.sh OUTDIR}
mkdir -p "$OUT"
TESTS="tests/test_prompt_cache.py"
[ -f tests/test_tail_attention.py ] && TESTS="$TESTS tests/test_tail_attention.py"
perf/gpu_check.sh "$OUT" $TESTS
export PYTHONPATH=/tmp/mk PYTHONUNBUFFERED=1
cd /tmp/run
timeout 420 python -m minikv_compile.perf prompt-cache --out "$OUT" > "$OUT/prompt-cache.log" 2>&1
echo "perf exit code $?"
tail -5 "$OUT/prompt-cache.log"
sed -n '/^## A cached/,/^## Compile/p' "$OUT/prompt-cache.md" | head -20
grep -E "^- (target|chat prefill)" "$OUT/prompt-cache.md"
