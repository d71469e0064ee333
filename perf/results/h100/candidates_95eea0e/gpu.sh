#!/usr/bin/env bash
# The device call at 95eea0e (one fresh H100): the GPU tests of the decode attention, recall and
# prompt cache (95ffd1b's per-word key scales first run on a GPU), then the Llama-3.1-8B shape's
# decode step and prefill for preset("minikv") beside "accurate", its two candidates (group 32;
# K 128) and the copies without recall; the engine's budget (179 s) ended before most 8 x 4k rows
# (those are in ../long_ttft_57893b8/).
METHODS=minikv,kivi-g64-hadamard-specache,kivi-g32-hadamard-specache,kivi-g64-hadamard-specache128,kivi-g64-hadamard,kivi \
  perf/gpu/accurate_price.sh 95eea0e
