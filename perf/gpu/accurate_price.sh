#!/usr/bin/env bash
# Issue 47, part 3 (the accurate cache at the plain cache's price), on one GPU in one call, from
# the repo root:
#   perf/gpu/accurate_price.sh SHA
# 1. GPU tests ($TESTS, empty for none; by default the decode attention's and those of the host
#    copy's writers: test_specache.py, test_prompt_cache.py);
# 2. the Llama-3.1-8B shape's decode step and prefill at 1 x 32k and 8 x 4k, the paper's MiniKV
#    (preset "minikv") beside "accurate" (kivi-g64-hadamard-specache) and the steps between
#    them (KIVI-2 at the default group 16; group 64 + Hadamard without recall), one process:
#    `python -m minikv_compile.perf engine-vs-hf`, into $OUT/engine/;
# 3. with PROFILE=1, where "accurate"'s step goes at 1 x 32k: perf/experiments/profile_decode.py
#    with each kernel timed alone (MINIKV_PDL=0).
# Targets for the default: step <= 1.10x MiniKV's at both shapes, 32k prefill <= 1.2x.
set -uo pipefail
export MINIKV_GIT_SHA=${1:?usage: perf/gpu/accurate_price.sh SHA} PYTHONUNBUFFERED=1
METHODS=${METHODS:-minikv,kivi-g64-hadamard-specache,kivi-g64-hadamard,kivi}  # the ratio first
TESTS=${TESTS-tests/test_decode_attention.py tests/test_specache.py tests/test_prompt_cache.py}
ROOT=$(pwd)
perf/gpu_check.sh "$OUT" $TESTS | tail -3
export PYTHONPATH=/tmp/mk; cd /tmp/run || exit 1
# the engine's budget: what the call's 600 s leave after the tests, less the profile's part
LEFT=$((600 - SECONDS - 100 - ${PROFILE:-0} * 110))
BUDGET=${BUDGET:-$((LEFT < 60 ? 60 : LEFT))}
echo "=== $(date +%T) engine, budget $BUDGET s"
timeout $((BUDGET + 90)) python -m minikv_compile.perf engine-vs-hf --model llama3.1-8b \
  --methods "$METHODS" --shapes 1x32768,8x4096 --warm-tokens 8 --timed-tokens 64 \
  --budget-seconds "$BUDGET" --out "$OUT/engine" > "$OUT/engine.log" 2>&1
echo "perf exit code $?"
python - "$OUT/engine/engine-vs-hf.json" <<'PY'
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["results"]
        if r.get("experiment") == "decode" and r.get("status") == "ok"]
base = {(r["batch"], r["prompt_len"]): r for r in rows if r["method"] == "minikv"}
print(f"{'method':28} {'shape':8} {'ms/token':>9} {'x minikv':>9} {'prefill s':>10} {'x minikv':>9}")
for r in rows:
    b = base.get((r["batch"], r["prompt_len"]))
    ratio = lambda key: f"{r[key] / b[key]:9.3f}" if b else f"{'n/a':>9}"  # noqa: E731
    print(f"{r['method']:28} {r['batch']}x{r['prompt_len']:<6} {r['ms_per_token']:9.3f} "
          f"{ratio('ms_per_token')} {r['prefill_s']:10.3f} {ratio('prefill_s')}")
PY
if [ "${PROFILE:-0}" = 1 ]; then
  echo "=== $(date +%T) profile"
  MINIKV_PDL=0 timeout 110 python "$ROOT/perf/experiments/profile_decode.py" --kivi --recall 64 \
    --group-size 64 --rotation hadamard --steps 20 --top 14 > "$OUT/profile_accurate.log" 2>&1
  tail -16 "$OUT/profile_accurate.log"
fi
echo "=== $(date +%T) done"
