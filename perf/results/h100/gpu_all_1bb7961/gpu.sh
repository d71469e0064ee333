#!/usr/bin/env bash
# One call (carry .whl_serve): install, every GPU-marked test (bounded at 330 s), then the serving
# benchmark's single and long phases again (a second run of the long-phase median).
# Usage from the repo root: gpu.sh SHA
set -uo pipefail
export MINIKV_GIT_SHA=$1 PYTHONUNBUFFERED=1
L=/tmp/logs; mkdir -p $L
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl_serve/*.whl
perf/gpu_check.sh $OUT > $L/install.log 2>&1
tail -2 $L/install.log
ROOT=$(pwd)
export PYTHONPATH=/tmp/mk:/tmp/site; cd /tmp/run || exit 1
timeout 330 python -m pytest -q -m gpu -p no:cacheprovider --durations=15 --rootdir "$ROOT" $ROOT/tests > $OUT/gpu_tests.log 2>&1
tail -12 $OUT/gpu_tests.log
timeout 235 python -m minikv_compile.perf serve --out /tmp/serve --backends minikv --phases single,long --half-rate 1.64 --budget-seconds 225 --startup-timeout 150 > $L/serve.log 2>&1
cp /tmp/serve/serve.md /tmp/serve/serve.json $OUT/ 2>/dev/null
cp -r /tmp/serve/serve-parts /tmp/serve/serve-logs /tmp/serve/*.png $L/ 2>/dev/null
cd /tmp && tar czf $OUT/rest.tgz logs
grep -E "ITL p50|^\| minikv" $OUT/serve.md | head -12
tail -3 $L/serve.log
