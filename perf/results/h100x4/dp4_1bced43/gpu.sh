# One call on the same nvidia-h100-x4 machine, after the two of ../tp4_1bced43 (the tree at
# 1bced43 with the serving wheels in .whl, carried as .carry_head), from the repo root:
B1=190 B4=210 perf/gpu/dp4.sh 1bced43
