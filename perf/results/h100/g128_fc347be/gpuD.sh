#!/usr/bin/env bash
# Call D (carry .carry_g3; calls B and C copied .carry_g1/part_aa and .carry_g2/part_ab to /tmp/gguf
# on the same warm machine): the SmolLM2 GGUF joined and checked, then the accuracy harness's rows
# for key groups of 128 beside the group-64 preset. Usage from the repo root: gpuD.sh SHA
set -uo pipefail
cat /tmp/gguf/part_aa /tmp/gguf/part_ab .carry_g3/part_ac > /tmp/gguf/smollm2.gguf
sha256sum /tmp/gguf/smollm2.gguf | cut -c1-16
export MINIKV_GIT_SHA=$1 MINIKV_SMOLLM2_GGUF=/tmp/gguf/smollm2.gguf PYTHONPATH=/tmp/mk:/tmp/site PYTHONUNBUFFERED=1
cd /tmp/run || exit 1
timeout 330 python -m minikv_compile.perf.accuracy --tasks needle,ppl --methods full,kivi2_g64_spec64_hadamard,kivi2_g128_spec64_hadamard,kivi1_g128_spec64_hadamard,kivi1_g128_spec256_hadamard --out /tmp/acc --budget-seconds 320 > $OUT/acc.log 2>&1
cp /tmp/acc/main.md /tmp/acc/main.json $OUT/ 2>/dev/null
sed -n '/^| method/,/^$/p' $OUT/main.md | head -8 | cut -c1-140
