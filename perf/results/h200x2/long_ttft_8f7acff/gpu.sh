#!/usr/bin/env bash
# Issue 47, part 3's third ratio: the serving benchmark's long phase (every 8th prompt 32k
# tokens, 0.8 requests/s, 8 slots, the Llama-3.1-8B shape with random bf16 weights), one
# server after the other on GPU 1 of one warm 2 x H200 machine at 8f7acff, the accuracy
# harness running on GPU 0 beside each (perf/results/accuracy/both_8f7acff/gpu.sh, calls 4-5).
# Carry .whl; the project was installed by the call before (INSTALLED=1).
CUDA_VISIBLE_DEVICES=1 INSTALLED=1 PRESETS=accurate BUDGET=500 perf/gpu/long_ttft.sh 8f7acff   # call 4
CUDA_VISIBLE_DEVICES=1 INSTALLED=1 PRESETS=minikv BUDGET=300 perf/gpu/long_ttft.sh 8f7acff     # call 5
# Both calls ran past the device's limit in a wait loop after the benchmark ended (`pgrep -f`
# matched the call's own command line); the benchmark's figures were printed before.
# The parts: `xz -dk *.long.json.xz`.
