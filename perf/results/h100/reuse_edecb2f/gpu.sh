#!/usr/bin/env bash
# The device call at edecb2f (asked for any one GPU, given an H100), from a clean `git archive
# HEAD` copy carried as .carry_head with the serving wheels in .carry_head/.whl: phase reuse with
# documents of 8k-16k tokens (the load of h200/reuse_935483e), reuse off then on, Poisson then burst.
cd .carry_head && DOC_LEN=8192,16384 bash perf/gpu/prefix_reuse.sh $OUT/reuse edecb2f
