#!/usr/bin/env bash
# Issue 48, the server's prefix reuse under a multi-turn, shared-document load, on one GPU
# (carry .whl: the serving wheels), from the repo root:
#   perf/gpu/prefix_reuse.sh OUTDIR [SHA]
# Installs the project (perf/gpu_check.sh) and the serving wheels, then
# `python -m minikv_compile.perf serve --phases reuse --backends minikv` on the Llama-3.1-8B
# shape: USERS users (Poisson at RATE users/s), each asking TURNS questions (64-256 tokens,
# answers OUT tokens) about one of DOCS documents of DOC_LEN tokens, one server with POOL bytes of
# prefix cache, run with reuse off (every request opts out) then on; then as many other users
# arriving at once (the sustained request rate), off then on. Prints the phase's table (TTFT
# p50/p99, ITL p99, output tokens/s, requests/s, hit rate, pool bytes) and the on/off ratios.
# Targets: TTFT p50 on <= 1/5 of off, requests/s on >= 3x off, ITL p99 on < 100 ms. The whole
# call: ~10 minutes at most.
set -uo pipefail
OUT=${1:?usage: perf/gpu/prefix_reuse.sh OUTDIR [SHA]}
export MINIKV_GIT_SHA=${2:-unknown} PYTHONUNBUFFERED=1
USERS=${USERS:-24}; RATE=${RATE:-0.4}; TURNS=${TURNS:-4}; DOCS=${DOCS:-4}; OUT_LEN=${OUT_LEN:-64,256}
POOL=${POOL:-8589934592}; BUDGET=${BUDGET:-460}; DOC_LEN=${DOC_LEN:-8192,24576}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # absolute: the run goes on from /tmp/run
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl > "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
perf/gpu_check.sh "$OUT"
export PYTHONPATH=/tmp/mk:/tmp/site; cd /tmp/run || exit 1
timeout $((BUDGET + 60)) python -m minikv_compile.perf serve --backends minikv --phases reuse \
  --model llama3.1-8b --preset snapkv --reuse-users "$USERS" --reuse-rate "$RATE" --reuse-turns "$TURNS" \
  --reuse-docs "$DOCS" --reuse-doc-len "$DOC_LEN" --reuse-question-len 64,256 \
  --output-len "$OUT_LEN" --reuse-pool-bytes "$POOL" --budget-seconds "$BUDGET" \
  --startup-timeout 240 --out "$OUT/serve" > "$OUT/serve.log" 2>&1
echo "perf exit code $?"
cp "$OUT"/serve/serve-logs/* "$OUT"/ 2>/dev/null; cp "$OUT"/serve/serve-parts/*.json "$OUT"/
grep -E "^\| |reuse (on|off)|ready in|skipped|error" "$OUT/serve.log" | tail -14
python - "$OUT/serve/serve-parts/llama3.1-8b.minikv.reuse.json" <<'PY'
import json, sys
part = json.load(open(sys.argv[1]))
print("status", part["status"], part.get("reason", ""))
print("on/off", json.dumps(part.get("reuse")))
for r in part.get("runs", []):
    print(r["load"], "reuse", r["reuse"], "evictions", r["pool_evictions"], "cut",
          r["cut"] + r["unsent"], "requests/s", r["requests_per_s"])
    if r["reuse"]:  # the slowest first tokens of the hits, with their tails
        slow = sorted(r["per_request"], key=lambda o: -(o["ttft_s"] or 0))[:5]
        print("  slowest:", [(o["index"], round(o["ttft_s"] or -1, 3),
                              o["prompt_len"] - (o["cached_tokens"] or 0)) for o in slow])
PY
