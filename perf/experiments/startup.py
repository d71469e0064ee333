"""Start-up of a serving engine: compile + capture of every (bucket, mode), cold and warm.

    python perf/experiments/startup.py --out FILE.json [--model llama3.1-8b] [--max-batch 64]
        [--profile FILE.txt]

Run it twice with the same TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR: the first process is the
cold start, the second the restart with a warm compile cache. Prints the seconds of each key,
dynamo's own breakdown, and the replayed step time of each bucket with one live slot (is a
coarser set of buckets affordable?). ``--profile``: cProfile of the engine's build and the
buckets, the functions with the most cumulative time.
"""
from __future__ import annotations

import argparse
import cProfile
import importlib
import json
import pstats
import time

t_python = time.perf_counter()
import torch  # noqa: E402

t_torch = time.perf_counter() - t_python


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="llama3.1-8b")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=16384)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--modes", default="greedy,sample")
    p.add_argument("--profile", default=None)
    a = p.parse_args()
    t_start = time.perf_counter()
    imports = {}
    for name in ("transformers", "minikv_compile", "minikv_compile.perf.harness"):
        t0 = time.perf_counter()
        importlib.import_module(name)
        imports[name] = round(time.perf_counter() - t0, 2)
    from minikv_compile import MiniKVConfig, minikv_compile
    from minikv_compile.perf import harness as H
    t_import = time.perf_counter() - t_start
    profile = cProfile.Profile() if a.profile else None
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    model = H.build_model(a.model, dev, torch.bfloat16)
    torch.cuda.synchronize()
    t_model = time.perf_counter() - t0
    cfg = MiniKVConfig.preset("snapkv", max_batch_size=a.max_batch, max_prompt_len=a.max_prompt,
                       max_new_tokens=a.new_tokens)
    t0 = time.perf_counter()
    if profile:
        profile.enable()
    engine = minikv_compile(model, cfg)
    t_engine = time.perf_counter() - t0
    print(f"import {t_import:.1f} s, model {t_model:.1f} s, engine {t_engine:.1f} s", flush=True)
    rt = engine.runtime
    keys = {}
    t0 = time.perf_counter()
    for b in rt.buckets:
        for mode in a.modes.split(","):
            s = time.perf_counter()
            rt.prepare(b, mode)
            keys[f"{b}/{mode}"] = time.perf_counter() - s
            print(f"{b}/{mode}: {keys[f'{b}/{mode}']:.1f} s, compiles {rt.runner.compiles}",
                  flush=True)
    t_buckets = time.perf_counter() - t0
    total = time.perf_counter() - t_start
    if profile:
        profile.disable()
        with open(a.profile, "w") as f:
            stats = pstats.Stats(profile, stream=f).sort_stats("cumulative")
            stats.print_stats(60)
            stats.print_stats("minikv_compile", 40)  # the package's own functions
            stats.sort_stats("tottime").print_stats(40)
    from torch._dynamo.utils import compile_times
    breakdown = compile_times(repr="str")
    # Step time of each bucket's greedy graph with one live slot (slot 0, a 1k prompt).
    from minikv_compile.graphs.runtime import Request
    rt.admit(0, Request(list(range(1, 1025)), a.new_tokens))
    steps = {}
    for b in rt.buckets:
        key = (b, "greedy")
        for _ in range(3):
            rt.runner.run(key)
        rt.state.count[0] = 1  # keep the slot live
        rt.state.done[0] = False
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        n = 50
        e0.record()
        for _ in range(n):
            rt.runner.run(key)
        e1.record()
        torch.cuda.synchronize()
        steps[b] = e0.elapsed_time(e1) / n
        rt.state.count[0] = 1
        rt.state.done[0] = False
    imports["torch"] = round(t_torch, 2)
    result = dict(import_s=t_import + t_torch, imports_s=imports, model_s=t_model,
                  engine_s=t_engine, buckets_s=t_buckets, total_to_ready_s=total, per_key_s=keys,
                  compile_s={f"{k[0]}/{k[1]}": v for k, v in rt.runner.compile_seconds.items()},
                  capture_s={f"{k[0]}/{k[1]}": v for k, v in rt.runner.capture_seconds.items()},
                  compiles=rt.runner.compiles, loaded=rt.runner.loads,
                  step_ms_one_live=steps,
                  gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(breakdown)
    print(json.dumps({k: v for k, v in result.items() if k not in ("compile_s",)}, indent=1))


if __name__ == "__main__":
    main()
