#!/usr/bin/env bash
# The device call at a9800a7 (one H100): the GPU tests of the host copy's writers, then the
# Llama-3.1-8B shape's decode step and prefill at 1 x 32k and 8 x 4k for preset("minikv"), KIVI-2,
# group 64 + Hadamard, and preset("accurate"), one process (issue 47, part 3), then the profile
# of "accurate"'s step.
perf/gpu/accurate_price.sh a9800a7
