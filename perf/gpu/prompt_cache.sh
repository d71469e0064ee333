#!/usr/bin/env bash
# Issue 46 on one GPU, from the repo root: perf/gpu/prompt_cache.sh OUTDIR [test files]
# Installs the project (perf/gpu_check.sh, which also runs the GPU tests of the test files given),
# then `python -m minikv_compile.perf prompt-cache` on the Llama-3.1-8B shape (random weights,
# bf16) into OUTDIR, and prints its table and target lines. The benchmark alone: ~4-6 min.
set -uo pipefail
OUT=${1:?usage: perf/gpu/prompt_cache.sh OUTDIR [test files]}; shift || true
mkdir -p "$OUT"
perf/gpu_check.sh "$OUT" "$@"
export PYTHONPATH=/tmp/mk PYTHONUNBUFFERED=1
cd /tmp/run
timeout 480 python -m minikv_compile.perf prompt-cache --out "$OUT" > "$OUT/prompt-cache.log" 2>&1
echo "perf exit code $?"
tail -5 "$OUT/prompt-cache.log"
sed -n '/^## A cached/,/^## Compile/p' "$OUT/prompt-cache.md" | head -20
grep -E "^- (target|chat prefill)" "$OUT/prompt-cache.md"
