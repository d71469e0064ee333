#!/usr/bin/env bash
# The device call at 57893b8 (one fresh H100, carry .whl): the long phase of the serving
# benchmark with preset("minikv") then preset("accurate"), 8 slots, 1.64 requests/s; the
# "accurate" server was still compiling its warm-up at the 150 s start-up bound and was stopped
# (no figure); then the decode step at 8 x 4k in what the call left. The call's summary files
# (serve.md, the parts) did not come back (the device's file count); the logs did.
perf/gpu/long_ttft.sh 57893b8
