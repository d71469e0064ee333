set -uo pipefail
export MINIKV_GIT_SHA=$1 PYTHONPATH=/tmp/site TORCHINDUCTOR_CACHE_DIR=/tmp/ic TRITON_CACHE_DIR=/tmp/tc
ROOT=$(pwd); mkdir -p $OUT/r
timeout 200 perf/gpu_check.sh $OUT/r tests/test_recall.py tests/test_specache.py tests/test_scheduler.py 2>&1 | tail -2
export PYTHONPATH=/tmp/mk:/tmp/site PYTHONUNBUFFERED=1; cd /tmp/run
timeout 220 python -m minikv_compile.perf engine-vs-hf --out $OUT/r/ev --methods kivi,kivi-specache,kivi-g64-hadamard,kivi-g64-hadamard-specache --shapes 1x32768,8x4096 --warm-tokens 8 --timed-tokens 64 --budget-seconds 210 > $OUT/r/ev.log 2>&1
sed -n '/^| batch x prompt/,/^$/p' $OUT/r/ev/*.md | cut -c1-70
R=/tmp/mk/minikv_compile/ops/recall.py
for n in 4 2; do sed -i "s/^_GATHER_PROGRAMS = .*/_GATHER_PROGRAMS = $n/" $R
  timeout 100 python -m minikv_compile.perf engine-vs-hf --out $OUT/r/ev_cap$n --methods kivi-specache --shapes 8x4096,1x32768 --warm-tokens 8 --timed-tokens 64 --budget-seconds 90 > $OUT/r/ev_cap$n.log 2>&1
  echo "== cap $n $(grep -o 'b=[0-9]* L=[0-9]*: ok ms_per_token=[0-9.]*' $OUT/r/ev_cap$n.log | tr '\n' ' ')"
done
