#!/usr/bin/env bash
# Issue 50, data-parallel replicas behind one front, in one call on a 4-GPU machine (carry .whl:
# the serving wheels, see perf/README.md), from the repo root:
#   perf/gpu/dp4.sh SHA [one] [four]      (default: both, one call)
# The serving benchmark on the Llama-3.1-8B shape (perf/README.md, "Serving benchmark"), one
# replica on GPU 0, then four replicas (serve-worker --data-parallel 4: the front of
# minikv_compile/serve/replicas.py over four workers, one GPU each) on the same machine, the
# second start on the compile cache of the first. Fixed Poisson rates of RATE_S seconds each:
# R1 around one H100's saturation (3.28 req/s sustained at 1bced43, 4.1 not run), R4 the same
# rates times 3.6, so that each replica rate has its target beside it; each invocation within
# its budget (B1, B4) and the whole under 9 minutes. Target: the four replicas' highest
# sustained rate at least 3.6x the one replica's, their ITL p99 under 100 ms there.
# With RATE_S=60 the two do not fit one call: run `one` and `four` in two calls on the same warm
# machine (the second on the first's compile cache), each with its B1 / B4 raised.
# Everything lands in /tmp/s1 and /tmp/s4, packed into $OUT/dp4.tgz; $OUT also gets run.log and
# summary.md (the two serve.md tables' sweep rows, printed last).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export MINIKV_GIT_SHA=${1:?usage: perf/gpu/dp4.sh SHA [one] [four]} PYTHONUNBUFFERED=1
shift; PARTS=${*:-one four}
R1=${R1:-3.28,3.69,4.1}; R4=${R4:-11.81,13.28,14.76}; RATE_S=${RATE_S:-30}
B1=${B1:-270}; B4=${B4:-220}
ROOT=$(pwd); L=/tmp/dp4.log
rm -rf /tmp/s1 /tmp/s4; mkdir -p /tmp/s1 /tmp/s4
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl > $L 2>&1 || { tail $L; exit 1; }
perf/gpu_check.sh /tmp/s1 >> $L 2>&1
cat /tmp/s1/gpu.txt
export PYTHONPATH=/tmp/mk:/tmp/site; cd /tmp/run || exit 1
S="python -m minikv_compile.perf serve --backends minikv --phases single,sweep --model llama3.1-8b --preset snapkv"
S="$S --single-requests 2 --rate-seconds $RATE_S --requests 600 --min-requests 16"
case " $PARTS " in *" one "*)
  echo "=== $(date +%T) one replica (GPU 0), rates $R1" | tee -a $L
  CUDA_VISIBLE_DEVICES=0 timeout $((B1 + 40)) $S --out /tmp/s1 --rates $R1 \
    --budget-seconds $B1 --startup-timeout 200 >> $L 2>&1 ;;
esac
case " $PARTS " in *" four "*)
  echo "=== $(date +%T) four replicas, rates $R4" | tee -a $L
  timeout $((B4 + 40)) $S --data-parallel 4 --out /tmp/s4 --rates $R4 \
    --budget-seconds $B4 --startup-timeout 200 >> $L 2>&1 ;;
esac
echo "=== $(date +%T) done" | tee -a $L
grep -v "Warning\|warn(" $L > $OUT/run.log
tar czf $OUT/dp4.tgz -C /tmp s1 s4 2>/dev/null
for d in s1 s4; do echo "## $d"; grep -iE "rate|sustained|saturation|ITL" /tmp/$d/serve.md | head -20; done > $OUT/summary.md
cat $OUT/summary.md
