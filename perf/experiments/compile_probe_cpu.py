"""Host-side compile cost of the two-part decode step, on the CPU (no GPU needed).

    TORCHINDUCTOR_CACHE_DIR=DIR python perf/experiments/compile_probe_cpu.py   # twice: cold, warm

A 32-layer tiny Llama (tests' ``tiny``), 8 slots, compiled on the CPU: every (bucket, mode) is
prepared and timed, then dynamo's own breakdown is printed. Dynamo's tracing is host work that
grows with the layer count, as on the GPU; inductor's code generation differs (C++ here, Triton
there), so only the warm run (code generation cached) is a proxy for a GPU restart.
"""
import sys, time, torch
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[2] / 'tests'))
t0 = time.perf_counter()
from test_engine import tiny, prompt_of
from minikv_compile import MiniKVConfig, minikv_compile
model = tiny(num_hidden_layers=32)
cm = minikv_compile(model, MiniKVConfig(residual_length=32, max_prompt_len=128, max_new_tokens=8,
                                        max_batch_size=8, compile=True))
t1 = time.perf_counter()
for b in cm.runtime.buckets:
    for mode in ("greedy", "sample"):
        s = time.perf_counter()
        cm.runtime.prepare(b, mode)
        print(b, mode, round(time.perf_counter() - s, 2), flush=True)
t2 = time.perf_counter()
from torch._dynamo.utils import compile_times
print(compile_times(repr="str"))
print("build", round(t1 - t0, 1), "prepare all", round(t2 - t1, 1), "compiles", cm.stats["compiles"])
