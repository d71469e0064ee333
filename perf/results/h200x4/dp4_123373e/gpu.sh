# One call on the 4 x H200 machine of ../tp4_123373e, warm after its first call (the tree at
# 123373e with the serving wheels in .whl, carried), from the repo root; serve-parts/ (every
# request's figures) and serve.json (its raw figures, 8.5 MB) not kept:
perf/gpu/dp4.sh 123373e
