#!/usr/bin/env bash
# Call D (carry .carry_g3; calls B and C copied .carry_g1/part_aa and .carry_g2/part_ab to /tmp/gguf
# on the same warm machine): the SmolLM2 GGUF joined and checked, then the accuracy harness's main
# table (19 methods) into /tmp/acc for as long as one call allows. Call E, `gpuD.sh SHA --extend`
# on the same machine, goes on from /tmp/acc/main.json. Usage from the repo root: gpuD.sh SHA [--extend]
set -uo pipefail
[ -f /tmp/gguf/smollm2.gguf ] || cat /tmp/gguf/part_aa /tmp/gguf/part_ab .carry_g3/part_ac > /tmp/gguf/smollm2.gguf
sha256sum /tmp/gguf/smollm2.gguf | cut -c1-16
export MINIKV_GIT_SHA=$1 MINIKV_SMOLLM2_GGUF=/tmp/gguf/smollm2.gguf PYTHONPATH=/tmp/mk:/tmp/site PYTHONUNBUFFERED=1
cd /tmp/run || exit 1
timeout 540 python -m minikv_compile.perf.accuracy ${2:-} --out /tmp/acc --budget-seconds 480 > $OUT/acc.log 2>&1
echo "rc $?"
cp /tmp/acc/main.md /tmp/acc/main.json /tmp/acc/accuracy.png $OUT/ 2>/dev/null
grep -E "methods done|OK|MISMATCH|Error" $OUT/acc.log | tail -4
sed -n '/^| method/,/^$/p' $OUT/main.md | head -22 | cut -c1-110
