# One call on a fresh nvidia-h100-x4 request that came as 4 x H200 (the tree at eebd8a6), from
# the repo root: the N-rank test, the step account with the one-shot all-reduce and with NCCL's
# (MINIKV_ONE_SHOT=0), then two ranks (tp2 wrote its 1 x 32768 row before its 180 s limit;
# account-nomix skipped, the budget):
BUDGET_S=570 perf/gpu/tp4.sh eebd8a6 test account account-nccl tp2 account-nomix
