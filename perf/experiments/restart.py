"""Cold start and restarts of the server, as a user runs them: the time from launching the
process to ``GET /health`` answering 200 (every bucket compiled and captured, a prompt of
``max_prompt_len`` prefilled), the first launch with empty compile caches, the next ones with the
caches the first one left (``--compile-cache`` / ``TORCHINDUCTOR_CACHE_DIR``), and how many of the
step's compiled graphs each launch compiled and loaded (``/metrics``), and when each stage of
the start-up ended (the worker's stamps in ``/info``).

    python perf/experiments/restart.py --out FILE.json [--model llama3.1-8b] [--restarts 2]
        [--cache DIR]

Runs ``python -m minikv_compile.perf serve-worker --backend minikv`` (the benchmark's server).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from minikv_compile.perf.argtypes import positive_float
from minikv_compile.perf.serve_bench import Worker


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="llama3.1-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--max-prompt-len", type=int, default=32768)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--max-queue", type=int, default=1024)
    p.add_argument("--prefill-ms", type=positive_float, default=50.0)
    p.add_argument("--restarts", type=int, default=2)
    p.add_argument("--timeout", type=float, default=240.0)
    p.add_argument("--cache", default=None,
                   help="the compile caches' folder (default: a new empty one)")
    a = p.parse_args()
    cache = Path(a.cache or tempfile.mkdtemp(prefix="minikv-restart-"))
    cold = not (cache / "inductor").exists()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(cache / "triton")
    launches = []
    for i in range(1 + a.restarts):
        worker = Worker("minikv", a, Path(a.out).with_suffix(f".launch{i}.log"))
        launched = time.time()
        try:
            ready = worker.start(a.timeout)
            counters = worker.metrics() or {}
            info = worker.info()
        finally:
            worker.stop()
        # seconds from the launch to the end of each stage the worker stamps (python and the
        # imports, the model, the environment's facts, the engine's build), then ready
        stamps = info["model"].get("stamps", {})
        stages = {name: round(stamps[name] - launched, 2) for name in stamps}
        launch = {"launch": "cold" if i == 0 and cold else f"restart {i + (not cold)}",
                  "ready_s": round(ready, 2),
                  "compiled_graphs": counters.get("minikv_compiled_graphs_total"),
                  "loaded_graphs": counters.get("minikv_loaded_graphs_total"),
                  "cuda_graphs": counters.get("minikv_cuda_graphs"), "stages_s": stages,
                  "engine_build_s": round(info["engine_build_s"], 2),
                  "compile_s": info["compile_s"], "capture_s": info["capture_s"]}
        launches.append(launch)
        print(json.dumps(launch), flush=True)
        time.sleep(2.0)  # the GPU's memory back before the next launch
    capacity = {"max_batch_size": a.max_batch_size, "max_prompt_len": a.max_prompt_len,
                "max_new_tokens": a.max_new_tokens}
    # Python's bytecode cache: the GPU machine sets PYTHONDONTWRITEBYTECODE over a torch
    # without .pyc, which costs every launch ~8 s of imports
    python = {name: os.environ.get(name)
              for name in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
    Path(a.out).write_text(json.dumps({"model": a.model, "cache": str(cache),
                                       "capacity": capacity, "python": python,
                                       "launches": launches}, indent=1))


if __name__ == "__main__":
    main()
