#!/usr/bin/env bash
# Two-GPU call for issue #26 (not committed): install, the two-rank NCCL test, the 70B shape with
# HF's tp_plan baseline, the 8B shape on 2 and 1 GPUs, the longest batch-1 context.
set -uo pipefail
ROOT=$(pwd); L=$OUT/all.log
export MINIKV_GIT_SHA=$1 PYTHONUNBUFFERED=1
perf/gpu_check.sh $OUT > $L 2>&1
export PYTHONPATH=/tmp/mk; cd /tmp/run
T="python -m torch.distributed.run --standalone --nproc-per-node"
B="-m minikv_compile.perf.bench_tp --warm-tokens 4 --timed-tokens 32"
s() { echo "=== $(date +%T) $*" | tee -a $L; }
s test; timeout 200 python -m pytest -q -m gpu -p no:cacheprovider --rootdir $ROOT $ROOT/tests/test_tensor_parallel.py -k two_nccl >> $L 2>&1; tail -3 $L
s 70b; timeout 330 $T 2 $B --cases 1x32768,8x4096 --methods minikv,hf-static --out $OUT/tp70_hf.json >> $L 2>&1; grep "ms/token" $L
s 8b2; timeout 120 $T 2 $B --shape llama3.1-8b --cases 1x32768,8x4096 --out $OUT/tp8_2.json >> $L 2>&1; grep "ms/token" $L | tail -2
s 8b1; timeout 120 $T 1 $B --shape llama3.1-8b --cases 1x32768,8x4096 --out $OUT/tp8_1.json >> $L 2>&1; grep "ms/token" $L | tail -2
s 131k; timeout 250 $T 2 $B --cases 1x131000 --warm-tokens 2 --timed-tokens 16 --out $OUT/tp70_131k.json >> $L 2>&1; grep "ms/token" $L | tail -1
s done
