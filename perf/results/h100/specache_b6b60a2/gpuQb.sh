set -uo pipefail
export MINIKV_GIT_SHA=$1 PYTHONPATH=/tmp/mk:/tmp/site TORCHINDUCTOR_CACHE_DIR=/tmp/ic TRITON_CACHE_DIR=/tmp/tc PYTHONUNBUFFERED=1
mkdir -p $OUT/r; cd /tmp/run
timeout 560 python -m minikv_compile.perf engine-vs-hf --out $OUT/r/ev --methods kivi,kivi-specache,kivi-g64-hadamard,kivi-g64-hadamard-specache --shapes 1x32768,8x4096 --warm-tokens 8 --timed-tokens 64 --budget-seconds 540 > $OUT/r/ev.log 2>&1
sed -n '/^| batch x prompt/,/^$/p' $OUT/r/ev/*.md | cut -c1-70
