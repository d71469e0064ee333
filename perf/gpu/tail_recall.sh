#!/usr/bin/env bash
# Issue 47, on one GPU in one call, from the repo root:
#   perf/gpu/tail_recall.sh SHA
# 1. the GPU tests of the tail's recall and the host store (written in session 34 without a
#    device: tests/test_tail_recall.py, test_recall.py, test_tail_compiled.py,
#    test_prompt_cache.py);
# 2. a cached 32k context's time to first token (256-token question, 8B shape) with the
#    library default and with preset("accurate") (the tail's recall), perf/experiments/ttft_profile.py;
# 3. where a 32k prefill's time goes, MiniKV against "accurate" (part 3),
#    perf/experiments/prefill_profile.py.
# Each part under its own limit; everything lands in $OUT (gpu_tests.log, ttft_*.log,
# prefill_profile.json / .log).
set -uo pipefail
export MINIKV_GIT_SHA=${1:?usage: perf/gpu/tail_recall.sh SHA} PYTHONUNBUFFERED=1
ROOT=$(pwd)
perf/gpu_check.sh "$OUT" tests/test_tail_recall.py tests/test_recall.py tests/test_tail_compiled.py \
  tests/test_prompt_cache.py | tail -4
export PYTHONPATH=/tmp/mk; cd /tmp/run || exit 1
for preset in "" accurate; do
  name=ttft_${preset:-default}
  echo "=== $(date +%T) $name"
  timeout 150 python "$ROOT/perf/experiments/ttft_profile.py" ${preset:+--preset $preset} \
    > "$OUT/$name.log" 2>&1
  grep -E "^call|^question|^one call" "$OUT/$name.log"
done
echo "=== $(date +%T) prefill_profile"
timeout 240 python "$ROOT/perf/experiments/prefill_profile.py" --out "$OUT/prefill_profile.json" \
  > "$OUT/prefill_profile.log" 2>&1
grep -E "prefill .* s \(best" "$OUT/prefill_profile.log"
echo "=== $(date +%T) done"
