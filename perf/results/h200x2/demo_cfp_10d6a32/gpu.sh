#!/usr/bin/env bash
# Session 39, call 3 (carry .carry_c; .carry_a, .carry_b copied to /tmp/gguf by calls 1-2).
# GPU 0: the accuracy harness goes on from 8f7acff's run (GPUS=1 this call).
# GPU 1: HEAD's GPU demo (the new default first), then context_first_profile.py.
set -u
ROOT=$(pwd)
cp .carry_c/gguf_xz_* /tmp/gguf/
( CUDA_VISIBLE_DEVICES=0 SRC=.carry_c/src_8f7acff.tar.xz SEED=perf/results/accuracy/both_8f7acff/main.json.xz \
  WHEELS=.carry_c GPUS=1 BUDGET=${BUDGET:-370} perf/gpu/accuracy_both.sh run 8f7acff > "$OUT/acc_run.out" 2>&1 ) &
ACC=$!
for i in $(seq 150); do [ -f "$OUT/install.log" ] && break; sleep 2; done
sha256sum /tmp/gguf/smollm2.gguf | cut -c1-16
rm -rf /tmp/mkhead && pip install -q --no-deps --no-build-isolation --target /tmp/mkhead . 2>&1 | tail -3
mkdir -p /tmp/runhead && cd /tmp/runhead
export PYTHONPATH=/tmp/mkhead:/tmp/site MINIKV_SMOLLM2_GGUF=/tmp/gguf/smollm2.gguf PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt"
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" >> "$OUT/gpu.txt"
T=$SECONDS; timeout 240 python -m minikv_compile.demo > "$OUT/demo-gpu.txt" 2>&1; echo "demo rc $? $((SECONDS - T)) s"
T=$SECONDS; timeout 200 python "$ROOT/perf/experiments/context_first_profile.py" --method preset_accurate \
  --length 2048 --out "$OUT/cfp" > "$OUT/cfp.log" 2>&1; echo "cfp rc $? $((SECONDS - T)) s"
wait $ACC; echo "acc rc $?"
tail -8 "$OUT/acc_run.out"
grep -E "^(== |answer|correct|prefill|decode|setup)" "$OUT/demo-gpu.txt" | cut -c1-150
grep -E "ms$|repeat" "$OUT/cfp.log" | head -20
