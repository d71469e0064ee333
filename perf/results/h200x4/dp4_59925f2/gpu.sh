# One call on a fresh 4 x H200 machine (the tree at 59925f2 with the serving wheels in .whl,
# carried), from the repo root; serve-parts/ (every request's figures, 7.3 MB) not kept:
perf/gpu/dp4.sh 59925f2
