#!/usr/bin/env bash
# Issue 50, tensor parallel over four GPUs, in one call on a 4-GPU machine (nvidia-h100-x4 or
# nvidia-h200-x4), from the repo root:
#   perf/gpu/tp4.sh SHA [PART...]      (default parts: test tp4 hf account 131k tp2)
# Installs the tree (perf/gpu_check.sh: pip install --no-deps --no-build-isolation), then runs
# the parts in the order given, each under its own limit and all inside BUDGET_S (520 s) from
# the start; a part with less than its minimum left is skipped and says so:
#   test     the N-rank NCCL test (tests/test_tensor_parallel.py, 4 GPUs: 4 ranks)
#   tp4      bench_tp, Llama-3.1-70B shape over 4 ranks, 1 x 32k and 8 x 4k against the floor
#            (at 1bced43 on 4 x H100 both rows were written before its 210 s limit ended it)
#   hf       HF tp_plan="auto" + StaticCache over the same 4 GPUs, 1 x 32k (HF_CASES; its
#            warm-up alone took 129 s on 4 x H100)
#   account  perf/experiments/tp_account.py over 4 ranks at 1 x 32k (ACCOUNT_CASES): the step
#            with its collectives as no-ops, the collectives alone, kernels and GPU idle a step
#   account-nccl   the same with MINIKV_ONE_SHOT=0: every all-reduce NCCL's (the A/B of the
#            one-shot all-reduce, models/parallel.py)
#   account-nomix  account-nccl with NCCL_GRAPH_MIXING_SUPPORT=0 (NCCL then adds no
#            cross-stream ordering of its own to a captured collective; NCCL's guide allows it
#            only where no uncaptured NCCL call follows a graph launch still running: the
#            engine's eager calls between steps follow a synchronized step, but check)
#   account-nopdl  the same as account with MINIKV_PDL=0: is the step's idle time with
#            collectives the non-PDL kernel boundaries at each all-reduce (perf/NOTES.md,
#            "Four GPUs: where the tensor-parallel step's idle time may come from")?
#   (of the account parts only account is among the defaults)
#   131k     bench_tp over 4 ranks at 1 x 131000 (the model's 131072 positions less the tokens)
#   tp2      bench_tp over 2 of the GPUs, 1 x 32k and 8 x 4k: the 4-against-2 scaling
# Everything lands in /tmp/r, packed after each part into $OUT/tp4.tgz; $OUT also gets run.log
# (the log less torch's warnings) and summary.md (the table printed last): three files.
set -uo pipefail
# NVLink multicast stays off (the machine's rule: it can take the host's GPUs out of service)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export MINIKV_GIT_SHA=${1:?usage: perf/gpu/tp4.sh SHA [PART...]} PYTHONUNBUFFERED=1
shift
PARTS=${*:-test tp4 hf account 131k tp2}
BUDGET=${BUDGET_S:-520}
ROOT=$(pwd); R=/tmp/r; L=$R/all.log
rm -rf $R; mkdir -p $R
pack() {
  grep -v "Warning\|warn(\|warnings.warn" $L > $OUT/run.log
  tar czf $OUT/tp4.tgz -C $R . 2>/dev/null
}
perf/gpu_check.sh $R > $L 2>&1
nvidia-smi topo -m >> $R/gpu.txt 2>&1
cat $R/gpu.txt
export PYTHONPATH=/tmp/mk; cd /tmp/run || exit 1
NGPU=$(python -c "import torch; print(torch.cuda.device_count())")
T="python -m torch.distributed.run --standalone --nproc-per-node"
B="-m minikv_compile.perf.bench_tp --warm-tokens 4 --timed-tokens 32"
# run NAME MAX_S MIN_S CMD...: CMD under min(MAX_S, the budget left), unless MIN_S is not left
run() {
  local name=$1 max=$2 min=$3; shift 3
  local left=$((BUDGET - SECONDS)); local limit=$((max < left ? max : left))
  if [ $limit -lt $min ]; then
    echo "=== $(date +%T) $name skipped: ${left} s of the budget left, needs ${min} s" | tee -a $L
    return
  fi
  echo "=== $(date +%T) $name (limit ${limit} s, ${left} s left)" | tee -a $L
  local t0=$SECONDS
  timeout -k 10 $limit "$@" >> $L 2>&1
  local rc=$?
  echo "=== $(date +%T) $name: exit $rc after $((SECONDS - t0)) s" | tee -a $L
  pack
}
for part in $PARTS; do
  case $part in
    test) run test 170 100 python -m pytest -q -m gpu -p no:cacheprovider --durations=5 \
            --rootdir $ROOT $ROOT/tests/test_tensor_parallel.py -k nccl_ranks
          cat /tmp/pytest-of-*/pytest-*/test_gpu_nccl_ranks*/progress*.txt >> $L 2>/dev/null
          grep -E "passed|failed|error" $L | tail -2 ;;
    tp4) run tp4 260 120 $T $NGPU $B --cases 1x32768,8x4096 --out $R/tp4.json
         grep "ms/token" $L | tail -2 ;;
    hf) run hf 360 180 $T $NGPU $B --cases ${HF_CASES:-1x32768} --methods hf-static \
          --out $R/tp4_hf.json
        grep "hf-static.*ms/token" $L | tail -2 ;;
    account|account-nccl|account-nomix|account-nopdl)
      case $part in  # each variant's environment, for its run alone
        account) env=() ;;
        account-nccl) env=(MINIKV_ONE_SHOT=0) ;;
        account-nomix) env=(MINIKV_ONE_SHOT=0 NCCL_GRAPH_MIXING_SUPPORT=0) ;;
        account-nopdl) env=(MINIKV_PDL=0) ;;
      esac
      out=$R/tp4_${part/-/_}.json
      run $part 150 80 env "${env[@]}" $T $NGPU $ROOT/perf/experiments/tp_account.py \
        --cases ${ACCOUNT_CASES:-1x32768} --out $out
      cat ${out%.json}.md 2>/dev/null ;;
    131k) run 131k 180 110 $T $NGPU $B --cases 1x131000 --warm-tokens 2 --timed-tokens 16 \
            --out $R/tp4_131k.json
          grep "ms/token" $L | tail -1 ;;
    tp2) CUDA_VISIBLE_DEVICES=0,1 run tp2 180 110 $T 2 $B --cases 1x32768,8x4096 \
           --out $R/tp2.json
         grep "ms/token" $L | tail -2 ;;
    *) echo "unknown part $part (test tp4 hf account account-nccl account-nomix account-nopdl" \
            "131k tp2)" | tee -a $L ;;
  esac
done
python $ROOT/perf/gpu/tp_table.py $R > $OUT/summary.md 2>> $L
pack
echo "=== $(date +%T) done after $SECONDS s"
cat $OUT/summary.md
