set -uo pipefail
cat /tmp/gguf/part_aa .carry_g2/part_ab > /tmp/gguf/smollm2.gguf
sha256sum /tmp/gguf/smollm2.gguf | cut -c1-16
export MINIKV_GIT_SHA=$1 MINIKV_SMOLLM2_GGUF=/tmp/gguf/smollm2.gguf PYTHONPATH=/tmp/site TORCHINDUCTOR_CACHE_DIR=/tmp/ic TRITON_CACHE_DIR=/tmp/tc
ROOT=$(pwd); mkdir -p $OUT/r
timeout 90 perf/gpu_check.sh $OUT/r > /dev/null 2>&1
export PYTHONPATH=/tmp/mk:/tmp/site PYTHONUNBUFFERED=1; cd /tmp/run
timeout 150 python -m minikv_compile.demo > $OUT/r/demo_gpu.txt 2>&1; echo "demo rc $?"
grep -iE "correct|answer|tokens/s|MiB" $OUT/r/demo_gpu.txt | cut -c1-150 | head -20
timeout 300 python -m minikv_compile.perf.accuracy --tasks needle,ppl --methods full,kivi2_spec64,kivi2_g64_spec64_hadamard --out $OUT/r/acc --budget-seconds 290 > $OUT/r/acc.log 2>&1
sed -n '/^| method/,/^$/p' $OUT/r/acc/*.md | head -6 | cut -c1-140
