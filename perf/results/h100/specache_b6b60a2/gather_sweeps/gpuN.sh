set -uo pipefail
export MINIKV_GIT_SHA=$1 PYTHONPATH=/tmp/site TORCHINDUCTOR_CACHE_DIR=/tmp/ic TRITON_CACHE_DIR=/tmp/tc
ROOT=$(pwd); mkdir -p $OUT/r
timeout 100 perf/gpu_check.sh $OUT/r > /dev/null 2>&1
export PYTHONPATH=/tmp/mk:/tmp/site PYTHONUNBUFFERED=1; cd /tmp/run
D=/tmp/mk/minikv_compile/graphs/decode.py; R=/tmp/mk/minikv_compile/ops/recall.py
cp $D /tmp/d0.py; cp $R /tmp/r0.py
run() {
  timeout 120 python -m minikv_compile.perf engine-vs-hf --out $OUT/r/ev_$1 --methods kivi-specache --shapes 8x4096,1x32768 --warm-tokens 8 --timed-tokens 64 --budget-seconds 110 > $OUT/r/ev_$1.log 2>&1
  echo "== $1"; sed -n '/^| batch x prompt/,/^$/p' $OUT/r/ev_$1/*.md | tail -n +3 | cut -c1-45
}
run base
sed -i 's/torch.cuda.Stream(device=cache.device)/torch.cuda.Stream(device=cache.device, priority=-1)/' $D; grep -c "priority=-1" $D
run prio
cp /tmp/d0.py $D
sed -i 's/^_TILE_ELEMENTS = 1024/_TILE_ELEMENTS = 8192/' $R; grep -n "^_TILE_ELEMENTS" $R
run tile8k
sed -i 's/torch.cuda.Stream(device=cache.device)/torch.cuda.Stream(device=cache.device, priority=-1)/' $D
run prio_tile8k
cp /tmp/d0.py $D; cp /tmp/r0.py $R
