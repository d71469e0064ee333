#!/usr/bin/env bash
# Engine A/B of launch-setting variants (perf/gpu/config_trial.py) in one GPU call, alternating,
# each run a fresh process. Usage (after check.sh installed the tree into /tmp/mk):
#   perf/gpu/config_ab.sh OUTDIR ROUNDS "VARIANT..." [perf args...]
# Appends every run's output to OUTDIR/config_ab.log and prints each run's decode rows.
set -uo pipefail
OUT=${1:?usage}; ROUNDS=${2:?usage}; VARIANTS=${3:?usage}; shift 3
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p /tmp/run
for i in $(seq 1 "$ROUNDS"); do
  for v in $VARIANTS; do
    run=/tmp/cab/${v}_$i; rm -rf "$run"
    (cd /tmp/run && PYTHONPATH=/tmp/mk PYTHONUNBUFFERED=1 \
      timeout 200 python "$HERE/config_trial.py" "$v" "$@" --out "$run" 2>&1) >> "$OUT/config_ab.log"
    python "$HERE/decode_rows.py" "$v" "$run"
  done
done
