#!/usr/bin/env bash
# One call (carry .whl_serve): install, the GPU tests the call of gpu_all_1bb7961 did not reach
# (test_quant, test_recall, test_rotation, test_runtime, test_scheduler, test_specache,
# test_tensor_parallel; test_selective_attention, test_selection and test_prefill_batch ran in
# prefill_attention_8faf841), then the server's cold start and two restarts with Python's
# bytecode cached (what a pip install gives), bounded to the device time left.
# Usage from the repo root: gpu.sh SHA
set -uo pipefail
export MINIKV_GIT_SHA=$1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl_serve/*.whl
perf/gpu_check.sh $OUT > $OUT/install.log 2>&1
tail -2 $OUT/install.log
ROOT=$(pwd)
export PYTHONPATH=/tmp/mk:/tmp/site; cd /tmp/run || exit 1
T="test_quant test_recall test_rotation test_runtime test_scheduler test_specache test_tensor_parallel"
timeout 250 python -m pytest -q -m gpu -p no:cacheprovider --durations=10 --rootdir "$ROOT" $(for t in $T; do echo $ROOT/tests/$t.py; done) > $OUT/gpu_tests.log 2>&1
tail -8 $OUT/gpu_tests.log
env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=/tmp/pyc timeout ${RESTART_S:-150} python $ROOT/perf/experiments/restart.py --out $OUT/restart.json --restarts 2 --cache /tmp/rc > $OUT/restart.log 2>&1
grep '^{' $OUT/restart.log
