# One call on the 4 x H200 machine of ../dp4_59925f2, kept warm after it (the tree at 59925f2:
# eebd8a6's product code), from the repo root (hf wrote its row before its 360 s limit):
BUDGET_S=575 perf/gpu/tp4.sh 59925f2 tp4 hf
