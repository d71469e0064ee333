#!/usr/bin/env bash
# Profile one warm launch of the decode-attention split kernel with Nsight Compute (GPU machine,
# from the repo root, after perf/gpu_check.sh installed the project). Usage:
#   [KERNEL=regex] perf/experiments/ncu_decode.sh OUTDIR TAG [--bits 2 --batch 8 --tokens 16384 --kernel ..]
# KERNEL picks the kernel by name (default the Triton split kernel; "fragments_kernel" for the
# Gluon kernel of --kernel fragments).
# Writes OUTDIR/ncu_TAG.txt: the headline metrics and `ncu_decode_attention summarize` of the
# per-instruction page. Clocks are left alone (--clock-control none).
set -uo pipefail
OUT=${1:?usage: ncu_decode.sh OUTDIR TAG [run options]}; TAG=${2:?}; shift 2
REP=/tmp/ncu_$TAG
HERE=$(cd "$(dirname "$0")" && pwd)
(timeout 300 ncu --clock-control none --kernel-name "regex:${KERNEL:-_decode_attention_split}" \
    --launch-skip 3 --launch-count 1 --set full --import-source no -f -o "$REP" \
    python "$HERE/ncu_decode_attention.py" run "$@") > "$REP.log" 2>&1 || tail -5 "$REP.log"
{
  echo "# ncu_decode.sh $TAG $*  (git ${MINIKV_GIT_SHA:-unknown})"
  ncu --import "$REP.ncu-rep" --page details --print-details all 2>&1 | grep -E \
    "^    (Duration|Issue Slots Busy|Warp Cycles Per Issued|Achieved Occupancy|Registers Per|L1: Data Pipe Lsu Wavefronts|Stall [A-Z])" \
    | sed -E "s/ +/ /g" | sort -u
  ncu --import "$REP.ncu-rep" --page source --csv --print-source sass > "$REP.csv" 2>&1
  python "$HERE/ncu_decode_attention.py" summarize "$REP.csv"
} > "$OUT/ncu_$TAG.txt"
tail -40 "$OUT/ncu_$TAG.txt"
