#!/usr/bin/env bash
# One call (carry .whl_serve: fastapi, uvicorn, starlette, pydantic, pydantic-core,
# annotated-types, typing-inspection, opentelemetry-api): install, the prefill and selection GPU tests, the
# prefill-attention experiment, then the serving benchmark's single / half / long phases on a
# cold compile cache. Usage from the repo root: gpu1.sh SHA
set -uo pipefail
export MINIKV_GIT_SHA=$1 PYTHONUNBUFFERED=1
L=/tmp/logs; mkdir -p $L
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl_serve/*.whl
perf/gpu_check.sh $OUT ${TESTS:-tests/test_selection.py tests/test_prefill_batch.py tests/test_selective_attention.py} > $L/install.log 2>&1
tail -3 $L/install.log
ROOT=$(pwd)
export PYTHONPATH=/tmp/mk:/tmp/site; cd /tmp/run || exit 1
timeout 200 python $ROOT/perf/experiments/prefill_attention.py --out $OUT/prefill_attention.json > $L/prefill_attention.log 2>&1
grep -v Warn $L/prefill_attention.log | grep -E "attention, L|ms|prefill of" | head -40
timeout 330 python -m minikv_compile.perf serve --out /tmp/serve --backends minikv --phases single,half,long --half-rate 1.64 --budget-seconds 320 --startup-timeout 200 > $L/serve.log 2>&1
cp /tmp/serve/serve.md /tmp/serve/serve.json $OUT/ 2>/dev/null
cp -r /tmp/serve/serve-parts /tmp/serve/serve-logs /tmp/serve/*.png $L/ 2>/dev/null
cd /tmp && tar czf $OUT/rest.tgz logs
grep -E "ITL p50|start-up|ready" $OUT/serve.md | head -12
tail -5 $L/serve.log
