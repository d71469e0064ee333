#!/usr/bin/env bash
# Five calls on one warm H200 at 7037703 (perf/gpu/accuracy_both.sh): four copied the SmolLM2 GGUF's
# quarters (.carry_g1..4) to /tmp/gguf, the fourth then ran the table (acc_run.log: the full
# cache, the library default, "accurate" and "specache" in both modes before the budget), the
# fifth went on from /tmp/acc/main.json (acc_extend.log: "specache"'s context-first perplexity
# and code, "minikv", "kivi", MiniKV and KIVI-2). The other 16 methods of the main table were not
# reached within this session's device time.
cp .carry_g4/* /tmp/gguf/ && bash perf/gpu/accuracy_both.sh run 7037703
BUDGET=470 bash perf/gpu/accuracy_both.sh extend 7037703
