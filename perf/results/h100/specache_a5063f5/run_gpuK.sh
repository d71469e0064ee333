set -uo pipefail
export MINIKV_GIT_SHA=$1 PYTHONPATH=/tmp/site TORCHINDUCTOR_CACHE_DIR=/tmp/ic TRITON_CACHE_DIR=/tmp/tc
ROOT=$(pwd); mkdir -p $OUT/r
timeout 230 perf/gpu_check.sh $OUT/r tests/test_recall.py tests/test_specache.py tests/test_rotation.py tests/test_scheduler.py 2>&1 | tail -4
export PYTHONPATH=/tmp/mk:/tmp/site PYTHONUNBUFFERED=1; cd /tmp/run
timeout 330 python -m minikv_compile.perf engine-vs-hf --out $OUT/r/ev --methods kivi,kivi-specache,kivi-g64-hadamard,kivi-g64-hadamard-specache --shapes 1x32768,8x4096 --warm-tokens 8 --timed-tokens 64 --budget-seconds 320 > $OUT/r/ev.log 2>&1
tail -3 $OUT/r/ev.log
sed -n '/^| batch x prompt/,/^$/p' $OUT/r/ev/*.md | cut -c1-100
