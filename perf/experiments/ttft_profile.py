"""Where a cached prompt's time to first token goes (issue 46): the Llama-3.1-8B shape, a cached
32k context, a 256-token question; phases timed with a sync around each (prefix check, restore,
each tail chunk, the rest of generate), then torch.profiler over one whole call: its CPU and
CUDA time, kernel launches, and the tail layer's compiles (``TailPrefill.compiles``, which tails
of other lengths must not raise). ``--eager`` runs the tail's layers eagerly (as before the
compiled tail) for a side-by-side figure; ``--preset NAME`` takes a ``MiniKVConfig.preset`` instead
of the default config (``accurate``: the tail's recall, issue 47).

    python perf/experiments/ttft_profile.py [--context 32768] [--question 256] [--eager]
        [--preset accurate]
"""
import argparse
import time

import torch

from minikv_compile import MiniKVConfig, minikv_compile
from minikv_compile.graphs.tail import TailPrefill
from minikv_compile.perf import harness as H

p = argparse.ArgumentParser()
p.add_argument("--context", type=int, default=32768)
p.add_argument("--question", type=int, default=256)
p.add_argument("--eager", action="store_true", help="the tail's layers eager")
p.add_argument("--preset", default=None, help="a MiniKVConfig.preset name (default: the default)")
a = p.parse_args()
dev = torch.device("cuda")
model = H.build_model("llama3.1-8b", dev, torch.bfloat16)
EXTRAS = [0, 0, 0, 0, 37, 101]  # tokens added to the question per call (the last two: other
longest = a.question + max(EXTRAS)  # tail lengths, which must not recompile)
# A slot holds the cached context's kept half plus the whole tail and the new tokens, and its
# capacity is the kept count of max_prompt_len (about half of it) plus max_new_tokens: so room
# for the longest tail needs max_prompt_len >= context + 2 x tail (+ a margin for the rounding
# to whole groups and any layer keeping more than half).
fields = dict(max_batch_size=1, max_new_tokens=4, max_prompt_len=a.context + 2 * longest + 256)
cm = minikv_compile(model, MiniKVConfig.preset(a.preset, **fields))
g = torch.Generator().manual_seed(0)
doc = torch.randint(3, 1000, (a.context,), generator=g).tolist()
q = torch.randint(3, 1000, (a.question,), generator=g).tolist()
cache = cm.cache_prompt([doc])
phases = {}


def timed(name, fn):
    def wrapper(*args, **kw):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn(*args, **kw)
        torch.cuda.synchronize()
        phases.setdefault(name, []).append(time.perf_counter() - t)
        return out
    return wrapper


def timed_gen(name, fn):
    def wrapper(*args, **kw):
        gen = fn(*args, **kw)
        while True:
            torch.cuda.synchronize()
            t = time.perf_counter()
            try:
                next(gen)
            except StopIteration as stop:
                torch.cuda.synchronize()
                phases.setdefault(name, []).append(time.perf_counter() - t)
                return stop.value
            torch.cuda.synchronize()
            phases.setdefault(name, []).append(time.perf_counter() - t)
            yield
    return wrapper


rt = cm.runtime
rt.cache.restore = timed("restore", rt.cache.restore)
rt._check_prefix = timed("check_prefix", rt._check_prefix)
if a.eager:
    rt.tail = TailPrefill(rt.adapter, rt.cache, compile=False)
tail = rt.tail
rt.tail = timed_gen("tail_chunk", tail)
for i, extra in enumerate(EXTRAS):
    if extra:
        q2 = torch.randint(3, 1000, (a.question + extra,), generator=g).tolist()
        torch.cuda.synchronize()
        t = time.perf_counter()
        cm.generate([doc + q2], past_key_values=cache, max_new_tokens=1)
        torch.cuda.synchronize()
        print(f"question of {a.question + extra} tokens: {(time.perf_counter() - t) * 1e3:.1f} "
              f"ms, tail compiles so far {tail.compiles}")
        continue
    phases.clear()
    torch.cuda.synchronize()
    t = time.perf_counter()
    cm.generate([doc + q], past_key_values=cache, max_new_tokens=1)
    torch.cuda.synchronize()
    total = time.perf_counter() - t
    print(f"call {i}: total {total * 1e3:.1f} ms (tail compiles {tail.compiles}); " + "; ".join(
        f"{k} " + "+".join(f"{x * 1e3:.1f}" for x in v) for k, v in phases.items()))
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                        torch.profiler.ProfilerActivity.CUDA]) as prof:
    cm.generate([doc + q], past_key_values=cache, max_new_tokens=1)
    torch.cuda.synchronize()
events = prof.key_averages()
launches = {e.key: e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernelEx",
                                                        "cuLaunchKernel")}
print(f"one call: {sum(e.self_cpu_time_total for e in events) / 1e3:.1f} ms CPU, "
      f"{sum(e.self_device_time_total for e in events) / 1e3:.1f} ms CUDA, launches {launches}")
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
