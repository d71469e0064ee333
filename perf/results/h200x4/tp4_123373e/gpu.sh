# Two calls on one fresh 4 x H200 machine (the tree at 123373e), from the repo root.
# 1. The N-rank NCCL test (4 ranks), the 70B shape at 1 x 131000 over 4 ranks, then the GPU
#    tests of tests/test_specache.py on GPU 0:
ROOT=$(pwd); BUDGET_S=385 perf/gpu/tp4.sh 123373e test 131k
cd /tmp/run && PYTHONPATH=/tmp/mk python -m pytest -q -m gpu -p no:cacheprovider --durations=5 \
  --rootdir $ROOT $ROOT/tests/test_specache.py > gpu_tests_specache.log
# 2. (after perf/gpu/dp4.sh 123373e, ../dp4_123373e, and a first try of the same account that
#    tp4.sh's 150 s part limit ended) the step account at 1 x 131000, its own limit:
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
perf/gpu_check.sh /tmp/r2; export PYTHONPATH=/tmp/mk; cd /tmp/run
timeout 420 python -m torch.distributed.run --standalone --nproc-per-node 4 \
  $ROOT/perf/experiments/tp_account.py --cases 1x131000 --out tp4_131k_account.json
