"""Host-side compile cost of the decode step's parts, on the CPU (no GPU needed).

    TORCHINDUCTOR_CACHE_DIR=DIR python perf/experiments/compile_probe_cpu.py   # twice: cold, warm

A 32-layer tiny Llama (tests' ``tiny``), 8 slots, compiled on the CPU: every (bucket, mode) is
prepared and timed, then dynamo's own breakdown is printed, one column per compiled graph, and
a last line with the totals: the time spent compiling (dynamo and inductor, every graph) and
dynamo's bytecode tracing within it. "prepare all" also runs one step per key, which on this
project's shared 2-core machine now and then took ~4.5 s a key instead of 0.02 s (other
processes' load, no compile): compare the compile totals. Dynamo's tracing is host work that
grows with the layers traced, as on the GPU; inductor's code generation differs (C++ here,
Triton there), so only the warm run (code generation cached) is a proxy for a GPU restart. It
reads nothing but the public engine, so it runs against any tree.
"""
import sys, time, torch
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[2] / 'tests'))
t0 = time.perf_counter()
from test_engine import tiny, prompt_of
from minikv_compile import MiniKVConfig, minikv_compile
model = tiny(num_hidden_layers=32)
cm = minikv_compile(model, MiniKVConfig.preset("snapkv", residual_length=32, max_prompt_len=128, max_new_tokens=8,
                                        max_batch_size=8, compile=True))
t1 = time.perf_counter()
for b in cm.runtime.buckets:
    for mode in ("greedy", "sample"):
        s = time.perf_counter()
        cm.runtime.prepare(b, mode)
        print(b, mode, round(time.perf_counter() - s, 2), flush=True)
t2 = time.perf_counter()
from torch._dynamo.utils import compilation_time_metrics, compile_times
print(compile_times(repr="str"))
total = {k: round(sum(compilation_time_metrics.get(k, [])), 1)
         for k in ("_compile.compile_inner", "bytecode_tracing")}
print("build", round(t1 - t0, 1), "prepare all", round(t2 - t1, 1), "compiles", cm.stats["compiles"],
      "compiling", total["_compile.compile_inner"], "of which bytecode tracing",
      total["bytecode_tracing"])
