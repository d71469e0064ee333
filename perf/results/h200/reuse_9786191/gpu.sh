#!/usr/bin/env bash
# The device call at 9786191 (one H200), from a clean `git archive HEAD` copy carried as
# .carry_head with the serving wheels in .carry_head/.whl: phase reuse of `perf serve` on the
# Llama-3.1-8B shape (24 users x 4 turns on 4 documents of 8k-24k tokens, Poisson at 0.4 users/s,
# then a burst of 24 other users at once; 8 GiB of prefix cache), reuse off then on.
cd .carry_head && bash perf/gpu/prefix_reuse.sh $OUT/reuse 9786191
