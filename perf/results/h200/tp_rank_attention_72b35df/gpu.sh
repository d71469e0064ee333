# One call on a fresh H200 (the tree at 72b35df), from the repo root:
perf/gpu_check.sh /tmp/o
cd /tmp/run && PYTHONPATH=/tmp/mk python $ROOT/perf/experiments/tp_rank_attention.py \
  --out tp_rank_attention.json | tee tp_rank_attention.txt
