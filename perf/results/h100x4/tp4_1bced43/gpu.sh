# Two calls on one nvidia-h100-x4 machine (kept warm between them), from the repo root
# (the tree at 1bced43 carried as .carry_head):
perf/gpu/tp4.sh 1bced43 test tp4 hf account 131k tp2   # run1.log, summary1.md: hf, 131k, tp2 skipped (budget)
BUDGET_S=480 perf/gpu/tp4.sh 1bced43 hf 131k           # run2.log, summary2.md
