set -uo pipefail
export MINIKV_GIT_SHA=$1 PYTHONPATH=/tmp/site TORCHINDUCTOR_CACHE_DIR=/tmp/ic TRITON_CACHE_DIR=/tmp/tc
ROOT=$(pwd); mkdir -p $OUT/r
timeout 100 perf/gpu_check.sh $OUT/r > /dev/null 2>&1
export PYTHONPATH=/tmp/mk:/tmp/site PYTHONUNBUFFERED=1; cd /tmp/run
D=/tmp/mk/minikv_compile/graphs/decode.py; R=/tmp/mk/minikv_compile/ops/recall.py
sed -i 's/^_TILE_ELEMENTS = 1024/_TILE_ELEMENTS = 8192/' $R
cp $D /tmp/d0.py; cp $R /tmp/r0.py
run() {
  timeout 110 python -m minikv_compile.perf engine-vs-hf --out $OUT/r/ev_$1 --methods kivi-specache --shapes 8x4096,1x32768 --warm-tokens 8 --timed-tokens 64 --budget-seconds 100 > $OUT/r/ev_$1.log 2>&1
  echo "== $1 $(grep -o 'b=[0-9]* L=[0-9]*: ok ms_per_token=[0-9.]*' $OUT/r/ev_$1.log | tr '\n' ' ')"
}
run t8k
for n in 16 8; do sed -i "s/^_GATHER_PROGRAMS = .*/_GATHER_PROGRAMS = $n/" $R; run t8k_cap$n; done
cp /tmp/r0.py $R
sed -i 's/^\( *\)ops.recall_store(store, kv.k_ring, kv.v_ring, kv.lens, ring)/\1pass  # EXPERIMENT/' $D; grep -c EXPERIMENT $D
run t8k_nostore
cp /tmp/d0.py $D
sed -i 's/^\( *\)ops.recall_gather(store, rec.idx\[:batch\], rec.k, rec.v)/\1pass  # EXPERIMENT/' $D; grep -c EXPERIMENT $D
run t8k_nogather
cp /tmp/d0.py $D
