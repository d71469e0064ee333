#!/usr/bin/env bash
# The device call at ae30d4d (one H100): the GPU tests of the tail's recall and the host store,
# a cached 32k context's time to first token with the library default and preset("accurate"),
# and a 32k prefill's kernel time by category, MiniKV against "accurate" (issue 47, part 3).
perf/gpu/tail_recall.sh ae30d4d
