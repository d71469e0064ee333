#!/usr/bin/env bash
# Issue 47: does recall_resync fix the GPU demo? A fresh nvidia-h200-x2 machine (2 x H200) at
# 103c77b (the resync off by default then). Calls 1-2 (carry .carry_a, .carry_b):
#   mkdir -p /tmp/gguf && cp .carry_[ab]/* /tmp/gguf/
# Call 3 (carry .carry_c), this script with SHA=103c77b: GPU 0 the accuracy harness (full,
# "accurate", "accurate" + resync; acc_run.out has its table: the run's main.json did not come
# back, more than 8 files were left in $OUT, and the machine was given back before it was
# fetched), GPU 1 test_specache's GPU tests (gpu_tests.log: the replayed step with and without
# the resync equals the eager one), then perf/experiments/demo_resync.py (demo_resync.txt,
# .json: compiled with CUDA graphs, bf16, the demo's prompt at 4,000, 1,500, 3,000 and 6,000
# passage tokens, max_prompt_len the longest prompt's).
set -u
SHA=${1:?sha}
ROOT=$(pwd)
cp .carry_c/gguf_xz_* /tmp/gguf/
export OMP_NUM_THREADS=$(( $(nproc) / 2 ))
( CUDA_VISIBLE_DEVICES=0 METHODS=full,preset_accurate,kivi2_g64_spec64_hadamard_resync \
  WHEELS=.carry_c GPUS=1 BUDGET=400 perf/gpu/accuracy_both.sh run $SHA > "$OUT/acc_run.out" 2>&1 ) &
ACC=$!
for i in $(seq 150); do [ -f /tmp/gguf/smollm2.gguf ] && [ -f "$OUT/install.log" ] && break; sleep 2; done
sleep 20  # the join of the GGUF
rm -rf /tmp/mkhead && pip install -q --no-deps --no-build-isolation --target /tmp/mkhead .
mkdir -p /tmp/runhead && cd /tmp/runhead
export PYTHONPATH=/tmp/mkhead:/tmp/site MINIKV_SMOLLM2_GGUF=/tmp/gguf/smollm2.gguf PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=1
timeout 170 python -m pytest -q -m gpu -p no:cacheprovider --rootdir "$ROOT" "$ROOT/tests/test_specache.py" > "$OUT/gpu_tests.log" 2>&1
timeout 300 python "$ROOT/perf/experiments/demo_resync.py" --out "$OUT/demo_resync.json" > "$OUT/demo_resync.txt" 2>&1
wait $ACC
