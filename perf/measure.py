"""Timing, the copy bandwidth and the environment record: what every measurement of
``minikv_compile.perf`` shares (the evidence tool, the accuracy harness, the kernel benchmarks).

- timing: the median of ``triton.testing.do_bench`` (it flushes L2 between calls), a CUDA graph
  of several calls, cache copies enough to read from HBM, per-kernel device time;
- the copy bandwidth, the denominator of every "of copy" and "x floor" figure: the fastest of
  5 block medians of 40 device-to-device copies of 1 GiB;
- NVML: device facts and a background sampler of memory, power and clocks;
- the environment: versions, git sha, device, NVML, as a record (reports) or a flat row
  (benchmark JSON).
"""
from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import threading
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

GiB = 1 << 30
_ROOT = Path(__file__).resolve().parent.parent  # the checkout (or installed tree) of this file


class Skip(Exception):
    """A measurement that does not apply here; its message is the reason recorded."""


# -- timing -------------------------------------------------------------------------------------


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


def graph_ms(calls: Sequence[Callable[[], object]]) -> float:
    """Median ms per call of a CUDA graph that runs ``calls`` once each (already warmed up)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    ms = median_ms(graph.replay, warmup=10, rep=100) / len(calls)
    del graph
    return ms


def replicas(nbytes: int) -> int:
    """Cache copies needed so that one graph replay reads >= 3x L2 from HBM."""
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return max(1, min(64, math.ceil(3 * l2 / max(nbytes, 1))))


# -- the copy bandwidth ------------------------------------------------------------------------


def copy_bandwidth(device: torch.device, nbytes: int = GiB, blocks: int = 5, per_block: int = 40,
                   warmup: int = 100) -> Dict[str, object]:
    """Device-to-device copy bandwidth (bytes read + written per second): ``blocks`` medians of
    ``per_block`` copies each after ``warmup`` copies (~50 ms each way on an H200), the fastest
    block's median taken.

    A low copy figure raises the floor and flatters every ratio to it, so a disturbed stretch of
    copies must not set it: on a fresh H200 one median of 100 copies gave 4.16 TB/s where the
    next process gave 4.21 (``perf/NOTES.md``, the decode step). The fastest block median gives
    the lowest floor measured."""
    if device.type != "cuda":
        raise Skip("no CUDA device")
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(warmup):
        dst.copy_(src)
    times = []
    for _ in range(blocks * per_block):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    t, medians = fastest_block_median(times, per_block)
    return {"bytes_per_s": 2 * nbytes / t, "buffer_bytes": nbytes, "iters": len(times),
            "blocks": blocks, "per_block": per_block, "median_s": t, "block_medians_s": medians,
            "min_s": min(times), "max_s": max(times)}


def fastest_block_median(times: Sequence[float], per_block: int) -> Tuple[float, List[float]]:
    """``(the smallest median, every median)`` of consecutive blocks of ``per_block`` times."""
    medians = [statistics.median(times[i:i + per_block]) for i in range(0, len(times), per_block)]
    return min(medians), medians


# -- NVML ---------------------------------------------------------------------------------------


def _nvml():
    """The pynvml module, initialized, or raises with the reason it is unusable."""
    import pynvml  # nvidia-ml-py

    pynvml.nvmlInit()
    return pynvml


def _nvml_handle(pynvml, device: torch.device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    bus = getattr(props, "pci_bus_id", None)
    if bus is not None:  # match by PCI address: CUDA_VISIBLE_DEVICES may renumber devices
        addr = f"{getattr(props, 'pci_domain_id', 0):08X}:{bus:02X}:{getattr(props, 'pci_device_id', 0):02X}.0"
        try:
            return pynvml.nvmlDeviceGetHandleByPciBusId(addr)
        except Exception:
            pass
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    ids = [v for v in visible.split(",") if v.strip().isdigit()]
    return pynvml.nvmlDeviceGetHandleByIndex(int(ids[index]) if index < len(ids) else index)


def _try(fn, *args, scale: float = 1.0):
    try:
        value = fn(*args)
    except Exception:
        return None
    if isinstance(value, bytes):
        return value.decode()
    return value * scale if scale != 1.0 and isinstance(value, (int, float)) else value


class NvmlSampler:
    """Polls device memory used, power and SM clock from NVML in a background thread.

    NVML reports the whole device (every process, the CUDA context, allocator caches); the
    PyTorch allocator peak reported beside it counts only tensors of this process.
    """

    def __init__(self, device: torch.device, interval_s: float = 0.01):
        self.interval_s = interval_s
        self.reason: Optional[str] = None
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._handle = None
        if device.type != "cuda":
            self.reason = "no CUDA device"
            return
        try:
            self._pynvml = _nvml()
            self._handle = _nvml_handle(self._pynvml, device)
        except Exception as e:  # ImportError, NVMLError
            self.reason = f"NVML unavailable: {type(e).__name__}: {e}"

    @property
    def available(self) -> bool:
        return self._handle is not None

    def start(self) -> None:
        if not self.available:
            return
        self._samples: List[tuple] = []
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="nvml-sampler", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        p, h = self._pynvml, self._handle
        self._samples.append((_try(lambda: p.nvmlDeviceGetMemoryInfo(h).used),
                              _try(p.nvmlDeviceGetPowerUsage, h, scale=1e-3),
                              _try(p.nvmlDeviceGetClockInfo, h, p.NVML_CLOCK_SM)))

    def _loop(self) -> None:
        self._poll()
        while not self._stop.wait(self.interval_s):
            self._poll()

    def stop(self) -> Dict[str, object]:
        if not self.available:
            return {"nvml": None, "nvml_reason": self.reason}
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._poll()
        used = [s[0] for s in self._samples if s[0] is not None]
        power = [s[1] for s in self._samples if s[1] is not None]
        clock = [s[2] for s in self._samples if s[2] is not None]
        return {"nvml": {
            "samples": len(self._samples), "interval_s": self.interval_s,
            "peak_used_bytes": max(used) if used else None, "start_used_bytes": used[0] if used else None,
            "max_power_w": max(power) if power else None,
            "mean_power_w": statistics.fmean(power) if power else None,
            "max_sm_clock_mhz": max(clock) if clock else None,
            "min_sm_clock_mhz": min(clock) if clock else None}}


def nvml_peak_gbps() -> Optional[float]:
    """The memory bandwidth NVML implies (max memory clock x bus width, double data rate) in
    GB/s, or None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        mhz = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_MEM)
        bus_bits = pynvml.nvmlDeviceGetMemoryBusWidth(handle)
        return mhz * 1e6 * 2 * bus_bits / 8 / 1e9   # double data rate
    except Exception:  # NVML missing or not permitted: report without the fraction
        return None


# -- environment --------------------------------------------------------------------------------


def _version(module: str) -> Optional[str]:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return None


def git_info(root: Path) -> Dict[str, object]:
    """Commit sha of the code that ran, and whether the tree differed from it.

    ``$MINIKV_GIT_SHA`` wins (the GPU machine runs an installed copy without ``.git``); else the
    checkout holding this file, else the current directory's.
    """
    sha = os.environ.get("MINIKV_GIT_SHA")
    if sha:
        return {"sha": sha, "source": "MINIKV_GIT_SHA"}
    reason = "not a git checkout"
    for where in (root, Path.cwd()):
        try:
            head = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True,
                                  text=True, timeout=10)
            if head.returncode != 0:
                reason = head.stderr.strip()[-200:] or "git rev-parse failed"
                continue
            status = subprocess.run(["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=10)
            changed = [line for line in status.stdout.splitlines() if line.strip()]
            return {"sha": head.stdout.strip(), "dirty": bool(changed), "changed_files": len(changed),
                    "source": str(where)}
        except Exception as e:  # no git binary
            reason = f"{type(e).__name__}: {e}"
    return {"sha": None, "reason": reason}


def nvml_info(device: torch.device) -> Dict[str, object]:
    """Driver, clocks, power and memory of the device as NVML reports them (or why not)."""
    if device.type != "cuda":
        return {"available": False, "reason": "no CUDA device"}
    try:
        p = _nvml()
        h = _nvml_handle(p, device)
    except Exception as e:
        return {"available": False, "reason": f"{type(e).__name__}: {e}"}
    clock = lambda kind: _try(p.nvmlDeviceGetClockInfo, h, kind)  # noqa: E731
    max_clock = lambda kind: _try(p.nvmlDeviceGetMaxClockInfo, h, kind)  # noqa: E731
    return {
        "available": True,
        "name": _try(p.nvmlDeviceGetName, h),
        "driver_version": _try(p.nvmlSystemGetDriverVersion),
        "cuda_driver_version": _try(p.nvmlSystemGetCudaDriverVersion),
        "memory_total_bytes": _try(lambda: p.nvmlDeviceGetMemoryInfo(h).total),
        "memory_used_bytes": _try(lambda: p.nvmlDeviceGetMemoryInfo(h).used),
        "sm_clock_mhz": clock(p.NVML_CLOCK_SM), "mem_clock_mhz": clock(p.NVML_CLOCK_MEM),
        "max_sm_clock_mhz": max_clock(p.NVML_CLOCK_SM), "max_mem_clock_mhz": max_clock(p.NVML_CLOCK_MEM),
        "power_w": _try(p.nvmlDeviceGetPowerUsage, h, scale=1e-3),
        "power_limit_w": _try(p.nvmlDeviceGetEnforcedPowerLimit, h, scale=1e-3),
        "temperature_c": _try(p.nvmlDeviceGetTemperature, h, p.NVML_TEMPERATURE_GPU),
        "pstate": _try(p.nvmlDeviceGetPerformanceState, h),
        "persistence_mode": _try(p.nvmlDeviceGetPersistenceMode, h),
    }


def environment(device: torch.device) -> Dict[str, object]:
    """Everything needed to reproduce or compare a run: time, versions, sha, device, NVML."""
    dev: Dict[str, object] = {"type": device.type}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        dev.update({"name": props.name, "total_memory_bytes": props.total_memory,
                    "capability": f"{props.major}.{props.minor}",
                    "multiprocessors": props.multi_processor_count})
    else:
        dev.update({"name": platform.processor() or platform.machine(),
                    "reason": "no CUDA device" if not torch.cuda.is_available() else "CPU requested"})
    return {
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(), "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "triton": _version("triton"), "transformers": _version("transformers"),
        "nvidia_ml_py": _version("nvidia-ml-py"), "minikv_compile": _version("minikv_compile"),
        "git": git_info(_ROOT), "device": dev, "nvml": nvml_info(device),
    }


def gpu_slug(device: torch.device) -> str:
    """A folder name for the device: "NVIDIA H100 80GB HBM3" -> "h100-80gb-hbm3"."""
    if device.type != "cuda":
        return "cpu"
    return name_slug(torch.cuda.get_device_name(device))


def name_slug(name: str) -> str:
    """``gpu_slug`` of a GPU's name as the driver reports it."""
    name = name.lower().replace("nvidia", "")
    return "-".join("".join(c if c.isalnum() else " " for c in name).split()) or "gpu"


def row_environment() -> dict:
    """GPU, driver, versions, commit and time, flat, as every benchmark row carries them."""
    import triton

    device = torch.device("cuda", torch.cuda.current_device())
    return {
        "gpu": torch.cuda.get_device_name(device),
        "driver": nvml_info(device).get("driver_version") or "unknown",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "git_sha": git_info(_ROOT).get("sha") or "unknown",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def write_json(path: str, payload: object) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"wrote {path}")
