set -uo pipefail
export MINIKV_GIT_SHA=$1 PYTHONPATH=/tmp/site TORCHINDUCTOR_CACHE_DIR=/tmp/ic TRITON_CACHE_DIR=/tmp/tc
ROOT=$(pwd); mkdir -p $OUT/r
timeout 100 perf/gpu_check.sh $OUT/r > /dev/null 2>&1
export PYTHONPATH=/tmp/mk:/tmp/site PYTHONUNBUFFERED=1; cd /tmp/run
for rows in 8 16; do
  sed -i "s/^FUSED_MAX_ROWS = .*/FUSED_MAX_ROWS = $rows/" /tmp/mk/minikv_compile/models/llama.py
  grep -n "^FUSED_MAX_ROWS" /tmp/mk/minikv_compile/models/llama.py
  timeout 230 python -m minikv_compile.perf engine-vs-hf --out $OUT/r/ev_fused$rows --methods kivi,kivi-specache,kivi-g64-hadamard-specache --shapes 8x4096,16x2048 --warm-tokens 8 --timed-tokens 64 --budget-seconds 220 > $OUT/r/ev_fused$rows.log 2>&1
  tail -1 $OUT/r/ev_fused$rows.log
  sed -n '/^| batch x prompt/,/^$/p' $OUT/r/ev_fused$rows/*.md | cut -c1-60
done
