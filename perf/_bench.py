"""What the kernel benchmarks (``bench_*``) share: the environment block of their JSON rows,
the median timer, and writing the JSON."""
from __future__ import annotations

import json
import platform
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable, Dict, Tuple

import torch

from minikv_compile.perf.harness import git_info, nvml_info


def environment() -> dict:
    """GPU, driver, versions, commit and time, flat, as every benchmark row carries them."""
    import triton

    device = torch.device("cuda", torch.cuda.current_device())
    return {
        "gpu": torch.cuda.get_device_name(device),
        "driver": nvml_info(device).get("driver_version") or "unknown",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "git_sha": git_info(Path(__file__).resolve().parent.parent).get("sha") or "unknown",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def median_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 200) -> float:
    """Median milliseconds per call (``triton.testing.do_bench``: it flushes L2 between calls)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def kernel_times(fn: Callable[[], object], name_chars: int = 90) -> Tuple[dict, dict]:
    """Run ``fn`` under ``torch.profiler`` (CUDA activity; it synchronizes at the end) and group
    the kernels it launched by name (first ``name_chars`` characters): ({name: total device us},
    {name: launches})."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals: Dict[str, float] = defaultdict(float)
    counts: Dict[str, int] = defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name[:name_chars]
            totals[name] += e.device_time_total
            counts[name] += 1
    return dict(totals), dict(counts)


def write_json(path: str, payload: object) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"wrote {path}")
