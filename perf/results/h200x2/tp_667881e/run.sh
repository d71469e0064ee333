#!/usr/bin/env bash
# Two-GPU calls for issue #26, from the repo root: run.sh SHA PART... (test 70b 131k hf8x4k | 8b2 8b1):
# install, then the parts named, in order, each under its own time limit, into $OUT
# (the 2 x H100 calls of 8b9cdaa ran an older copy with test 200 s, 70b 330 s, 131k 200 s;
# the test part prints its ranks' progress files, whether it passed, failed or was killed).
set -uo pipefail
ROOT=$(pwd); SHA=$1; shift; L=$OUT/all.log
export MINIKV_GIT_SHA=$SHA PYTHONUNBUFFERED=1
perf/gpu_check.sh $OUT > $L 2>&1
export PYTHONPATH=/tmp/mk; cd /tmp/run
T="python -m torch.distributed.run --standalone --nproc-per-node"
B="-m minikv_compile.perf.bench_tp --warm-tokens 4 --timed-tokens 32"
s() { echo "=== $(date +%T) $*" | tee -a $L; }
for part in "$@"; do
  s $part
  case $part in
    test) timeout 380 python -m pytest -q -m gpu -p no:cacheprovider --rootdir $ROOT $ROOT/tests/test_tensor_parallel.py -k two_nccl >> $L 2>&1; tail -3 $L; cat /tmp/pytest-of-*/pytest-*/test_gpu_two*/progress*.txt | tee -a $L ;;
    70b) timeout 540 $T 2 $B --cases 1x32768,8x4096 --methods minikv,hf-static --out $OUT/tp70_hf.json >> $L 2>&1; grep "ms/token" $L ;;
    hf8x4k) timeout 540 $T 2 $B --cases 8x4096 --methods minikv,hf-static --out $OUT/tp70_hf8x4k.json >> $L 2>&1; grep "ms/token" $L | tail -2 ;;
    131k) timeout 300 $T 2 $B --cases 1x131000 --warm-tokens 2 --timed-tokens 16 --out $OUT/tp70_131k.json >> $L 2>&1; grep "ms/token" $L | tail -1 ;;
    8b2) timeout 150 $T 2 $B --shape llama3.1-8b --cases 1x32768,8x4096 --out $OUT/tp8_2.json >> $L 2>&1; grep "ms/token" $L | tail -2 ;;
    8b1) timeout 150 $T 1 $B --shape llama3.1-8b --cases 1x32768,8x4096 --out $OUT/tp8_1.json >> $L 2>&1; grep "ms/token" $L | tail -2 ;;
  esac
done
s done
grep -v "Warning\|warn(" $L > $OUT/run.log
