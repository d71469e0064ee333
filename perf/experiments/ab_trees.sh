#!/usr/bin/env bash
# Engine A/B of two trees in one GPU call, alternating: each run a fresh process.
# Usage (from the repo root, after perf/gpu_check.sh installed this tree into /tmp/mk):
#   perf/experiments/ab_trees.sh OUTDIR OLD_TREE ROUNDS [perf args...]
# OLD_TREE (e.g. a git-ignored `git archive` export carried to the machine) is installed into
# /tmp/mk_old and put first on PYTHONPATH for its runs; every run starts in /tmp/run, outside
# the tree, so that the tree's folders shadow neither install. Round i runs `python -m minikv_compile.perf ARGS` with each tree, new first, each
# tree with an inductor cache of its own (a graph cached by one tree calls ops by the schema of
# that tree). Keeps OUTDIR/ab_{new,old}_i.{log,json} (few files: the transfer back counts them)
# and prints each run's decode rows (ms per token, x floor; `decode_rows.py`).
set -uo pipefail
OUT=${1:?usage}; OLD=${2:?usage}; ROUNDS=${3:?usage}; shift 3
HERE=$(cd "$(dirname "$0")" && pwd)
rm -rf /tmp/mk_old && pip install -q --no-deps --no-build-isolation --target /tmp/mk_old "$OLD" 2>&1 | tail -3
mkdir -p /tmp/run
for i in $(seq 1 "$ROUNDS"); do
  for tree in new old; do
    site=/tmp/mk; [ "$tree" = old ] && site=/tmp/mk_old
    echo "== $tree $i"
    run=/tmp/ab/${tree}_$i; rm -rf "$run"
    (cd /tmp/run && PYTHONPATH=$site PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_$tree \
      timeout 200 python -m minikv_compile.perf "$@" --out "$run" 2>&1) > "$OUT/ab_${tree}_$i.log"
    cp "$run"/*.json "$OUT/ab_${tree}_$i.json" 2>/dev/null
    python "$HERE/decode_rows.py" "$tree" "$OUT/ab_${tree}_$i.json"
  done
done
