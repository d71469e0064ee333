#!/usr/bin/env bash
# Call D of four (A: `pip install --target /tmp/site .whl/*.whl` and perf/gpu_check.sh with .whl
# carried; B and C: .carry_g1/part_aa and .carry_g2/part_ab copied to /tmp/gguf; D with .carry_g3):
# eviction under recall beside the full cache, needle and perplexity. Usage: gpuD.sh SHA
set -uo pipefail
cat /tmp/gguf/part_aa /tmp/gguf/part_ab .carry_g3/part_ac > /tmp/gguf/smollm2.gguf
sha256sum /tmp/gguf/smollm2.gguf | cut -c1-16
export MINIKV_GIT_SHA=$1 MINIKV_SMOLLM2_GGUF=/tmp/gguf/smollm2.gguf PYTHONPATH=/tmp/mk:/tmp/site PYTHONUNBUFFERED=1
cd /tmp/run || exit 1
timeout 280 python -m minikv_compile.perf.accuracy --tasks needle,ppl --methods full,snapkv_block_sink_k85_g64_spec64_hadamard,snapkv_block_sink_k70_g64_spec64_hadamard,snapkv_block_sink_hadamard_spec64 --out /tmp/acc2 --budget-seconds 250 > $OUT/acc.log 2>&1
cp /tmp/acc2/main.md /tmp/acc2/main.json $OUT/ 2>/dev/null
sed -n '/^| method/,/^$/p' $OUT/main.md | cut -c1-150 | head -8
