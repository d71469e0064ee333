#!/usr/bin/env bash
# Issue 47: the default (preset("accurate"), now with recall_resync) against the former default
# (the same cache without the resync: kivi2_g64_spec64_hadamard) and the full cache, both modes,
# and the GPU demo, on a fresh nvidia-h200-x2 machine (2 x H200) at 83720f1.
# Calls 1-2 (carry .carry_a, then .carry_b): mkdir -p /tmp/gguf && cp .carry_[ab]/* /tmp/gguf/
# Call 3 (carry .carry_c): `bash .carry_c/call3.sh 83720f1`, this script:
# The same three methods had run at 103c77b (the resync not yet the default:
# kivi2_g64_spec64_hadamard_resync) with the same table (85.8 / 85.8, 85.0 / 84.6, 88.3 / 87.1);
# that run's JSON was lost with its machine (perf/results/h200x2/demo_resync_103c77b/ has the
# rest of that call).
set -u
SHA=${1:?sha}
ROOT=$(pwd)
cp .carry_c/gguf_xz_* /tmp/gguf/
export OMP_NUM_THREADS=$(( $(nproc) / 2 ))
mkdir -p "$OUT/r"
( CUDA_VISIBLE_DEVICES=0 METHODS=full,preset_accurate,kivi2_g64_spec64_hadamard OUT="$OUT/r" \
  WHEELS=.carry_c GPUS=1 BUDGET=${BUDGET:-420} perf/gpu/accuracy_both.sh run $SHA > "$OUT/r/acc_run.out" 2>&1 ) &
ACC=$!
for i in $(seq 150); do [ -f /tmp/gguf/smollm2.gguf ] && [ -f "$OUT/r/install.log" ] && break; sleep 2; done
sleep 20  # the join of the GGUF
sha256sum /tmp/gguf/smollm2.gguf | cut -c1-16
rm -rf /tmp/mkhead && pip install -q --no-deps --no-build-isolation --target /tmp/mkhead . 2>&1 | grep -v WARNING | tail -3
mkdir -p /tmp/runhead && cd /tmp/runhead
export PYTHONPATH=/tmp/mkhead:/tmp/site MINIKV_SMOLLM2_GGUF=/tmp/gguf/smollm2.gguf PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/r/gpu1.txt"
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" >> "$OUT/r/gpu1.txt"
echo "git $SHA" >> "$OUT/r/gpu1.txt"
T=$SECONDS; timeout 170 python -m pytest -q -m gpu -p no:cacheprovider --rootdir "$ROOT" "$ROOT/tests/test_specache.py" > "$OUT/r/gpu_tests.log" 2>&1
echo "gpu tests rc $? $((SECONDS - T)) s"; tail -2 "$OUT/r/gpu_tests.log"
T=$SECONDS; timeout 200 python -m minikv_compile.demo > "$OUT/r/demo-gpu.txt" 2>&1; echo "demo rc $? $((SECONDS - T)) s"
wait $ACC; echo "acc rc $?"
cp /tmp/acc/main.json "$OUT/r/main.json" 2>/dev/null
tail -5 "$OUT/r/acc_run.out"
grep -E "^(== |answer|correct|prefill|decode|setup)" "$OUT/r/demo-gpu.txt" | cut -c1-150
(cd "$OUT" && tar -cJf results.tar.xz r && rm -rf r)
ls -la "$OUT"
