#!/usr/bin/env bash
# The device call at 175d4bf (one H100): the decode step's kernels, each timed alone (PDL off),
# for KIVI-2 (group 16), group 64 + Hadamard, and "accurate" (+ recall 64), Llama-3.1-8B shape,
# 1 x 32k, 20 replayed steps each (issue 47, part 3: where the step's 1.22x goes).
export MINIKV_GIT_SHA=175d4bf; ROOT=$(pwd); perf/gpu_check.sh $OUT >/dev/null 2>&1
export PYTHONPATH=/tmp/mk MINIKV_PDL=0; cd /tmp/run
for a in "--kivi" "--kivi --group-size 64 --rotation hadamard" \
         "--kivi --group-size 64 --rotation hadamard --recall 64"; do
  n=$(echo $a | tr -d ' -')
  timeout 75 python $ROOT/perf/experiments/profile_decode.py $a --steps 20 --top 14 > $OUT/profile_$n.log 2>&1
done
