#!/usr/bin/env bash
# The device call at a9800a7 (one H100; carry .whl, the serving wheels): phase reuse of `perf
# serve` on the Llama-3.1-8B shape over the issue's range of documents, 8k-32k tokens (24 users x
# 4 turns on 4 documents, Poisson at 0.4 users/s, then a burst of 24 other users at once; 8 GiB of
# prefix cache), reuse off then on.
DOC_LEN=8192,32768 perf/gpu/prefix_reuse.sh $OUT/reuse a9800a7
