#!/usr/bin/env bash
# Issue 47, part 3's third ratio: time to first token in the serving benchmark's long phase
# (every 8th prompt 32k tokens), `preset("accurate")` beside `preset("minikv")`, one server
# after the other on one GPU, the Llama-3.1-8B shape (carry .whl: the serving wheels), from the
# repo root, one preset a call on the same warm machine:
#   PRESETS=accurate perf/gpu/long_ttft.sh SHA      (its server took over 150 s to start)
#   PRESETS=minikv perf/gpu/long_ttft.sh SHA
# Each call gives its servers what the call's 600 s leave after the install (start-up, the two
# warm-up requests and the phase count in `--budget-seconds`); the parts stay in
# /tmp/serve_<preset>, so the last call prints the ratio of both. SLOTS (default 8) for both:
# "accurate"'s pinned host copy is 4.4 GB a slot at 32k + 512 tokens, 279 GB at the benchmark's
# default 64 slots. RATE (default 0.8 requests/s) for both: at 1.64 (the 64-slot server's half
# rate) 8 slots of "minikv" queue (TTFT p50 4.36 s, 57893b8). The decode step's ratios are
# perf/gpu/accurate_price.sh's.
# CUDA_VISIBLE_DEVICES picks the GPU where the machine has several.
# Only the summaries go to $OUT (a call brings back a limited number of files).
set -uo pipefail
export MINIKV_GIT_SHA=${1:?usage: perf/gpu/long_ttft.sh SHA} PYTHONUNBUFFERED=1
SLOTS=${SLOTS:-8}; RATE=${RATE:-0.8}; PRESETS=${PRESETS:-minikv accurate}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl > "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
# INSTALLED=1: the project an earlier call installed into /tmp/mk stays (another job of the
# machine, the accuracy harness on the other GPU, is running from it)
[ -n "${INSTALLED:-}" ] && [ -d /tmp/mk ] || perf/gpu_check.sh "$OUT" | tail -3
export PYTHONPATH=/tmp/mk:/tmp/site; cd /tmp/run || exit 1
N=$(echo $PRESETS | wc -w)
BUDGET=${BUDGET:-$(((600 - SECONDS - 40) / N - 30))}
for preset in $PRESETS; do
  echo "=== $(date +%T) serve --preset $preset, budget $BUDGET s"
  rm -rf "/tmp/serve_$preset"
  timeout $((BUDGET + 25)) python -m minikv_compile.perf serve --backends minikv --phases long \
    --preset "$preset" --model llama3.1-8b --half-rate "$RATE" --max-batch-size "$SLOTS" \
    --budget-seconds "$BUDGET" --startup-timeout $((BUDGET - 90)) --out "/tmp/serve_$preset" \
    > "$OUT/serve_$preset.log" 2>&1
  echo "perf exit code $?"
  mkdir -p "$OUT/serve_$preset" && cp /tmp/serve_$preset/serve.md /tmp/serve_$preset/serve-parts/*.json \
    "$OUT/serve_$preset/" 2>/dev/null
  grep -E "ready in|phase|skipped|error|Error" "$OUT/serve_$preset.log" | tail -4
done
python - <<'PY'
import json, pathlib
rows = {}
for preset in ("minikv", "accurate"):
    parts = sorted(pathlib.Path(f"/tmp/serve_{preset}/serve-parts").glob("*.long.json"))
    if not parts:
        print(preset, "no long-phase part (yet)"); continue
    part = json.loads(parts[0].read_text())
    run = (part.get("runs") or [{}])[-1]
    rows[preset] = run
    keys = ("ttft_p50_s", "ttft_p99_s", "itl_p50_ms", "itl_p99_ms", "completed", "requests")
    print(preset, part.get("status"), "ready in", part.get("startup_s"),
          {k: run.get(k) for k in keys}, "engine", json.dumps(part.get("engine")))
if len(rows) == 2:
    for k in ("ttft_p50_s", "ttft_p99_s"):
        a, m = rows["accurate"].get(k), rows["minikv"].get(k)
        if a and m:
            print(f"{k}: accurate / minikv = {a:.3f} / {m:.3f} = {a / m:.3f}x (target <= 1.2x)")
PY
echo "=== $(date +%T) done"
