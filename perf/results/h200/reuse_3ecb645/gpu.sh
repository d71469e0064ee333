#!/usr/bin/env bash
# The device call at 3ecb645 (one H200), before the tail's warm-up at every chunk length and the
# burst: phase reuse of `perf serve`, 24 users x 4 turns on 4 documents of 8k-16k tokens, Poisson
# at 0.4 users/s, 8 GiB of prefix cache, reuse off then on (perf/gpu/prefix_reuse.sh of that commit).
bash perf/gpu/prefix_reuse.sh $OUT/reuse 3ecb645
