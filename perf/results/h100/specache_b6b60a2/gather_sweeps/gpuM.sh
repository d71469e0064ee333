set -uo pipefail
export MINIKV_GIT_SHA=$1 PYTHONPATH=/tmp/site TORCHINDUCTOR_CACHE_DIR=/tmp/ic TRITON_CACHE_DIR=/tmp/tc
ROOT=$(pwd); mkdir -p $OUT/r
timeout 100 perf/gpu_check.sh $OUT/r > /dev/null 2>&1
export PYTHONPATH=/tmp/mk:/tmp/site PYTHONUNBUFFERED=1; cd /tmp/run
P=/tmp/mk/minikv_compile/graphs/decode.py
timeout 150 python $ROOT/perf/experiments/profile_decode.py --batch 8 --prompt 4096 --kivi --recall 64 --top 40 > $OUT/r/prof_8x4k_recall.txt 2>&1
grep -A42 "us/step" $OUT/r/prof_8x4k_recall.txt | cut -c1-110 | head -44
grep "kernel time per step" $OUT/r/prof_8x4k_recall.txt
cp $P /tmp/decode_orig.py
sed -i 's/^\( *\)ops.recall_gather(store, rec.idx\[:batch\], rec.k, rec.v)/\1pass  # EXPERIMENT: no gather/' $P
sed -i 's/^\( *\)ops.recall_store(store, kv.k_ring, kv.v_ring, kv.lens, ring)/\1pass  # EXPERIMENT: no store/' $P
grep -c EXPERIMENT $P
timeout 200 python -m minikv_compile.perf engine-vs-hf --out $OUT/r/ev_nolink --methods kivi-specache --shapes 8x4096,1x32768 --warm-tokens 8 --timed-tokens 64 --budget-seconds 190 > $OUT/r/ev_nolink.log 2>&1
sed -n '/^| batch x prompt/,/^$/p' $OUT/r/ev_nolink/*.md | cut -c1-60
cp /tmp/decode_orig.py $P
