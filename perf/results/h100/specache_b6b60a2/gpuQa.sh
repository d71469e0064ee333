set -uo pipefail
export MINIKV_GIT_SHA=$1 PYTHONPATH=/tmp/site TORCHINDUCTOR_CACHE_DIR=/tmp/ic TRITON_CACHE_DIR=/tmp/tc
ROOT=$(pwd); mkdir -p $OUT/r
timeout 560 perf/gpu_check.sh $OUT/r tests/test_recall.py tests/test_specache.py tests/test_scheduler.py 2>&1 | tail -3
