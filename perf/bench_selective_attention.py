"""Benchmark selective_attention (attention + per-key scores) against SDPA's FlashAttention.

    python -m minikv_compile.perf.bench_selective_attention [--out results.json] [--tune]

Both sides run causal prefill attention on the same bf16 q/k/v. SDPA is pinned to the flash
backend and given ``enable_gqa=True``, so it reads the un-expanded KV heads exactly like our
kernel. Should that backend refuse GQA on some torch build, K/V are expanded to H_q heads
*outside* the timed region and the row says ``kv_expanded``.

Reported per shape: median milliseconds (``triton.testing.do_bench``), the ratio to SDPA, the
achieved TFLOP/s (causal FLOPs: SDPA does q k^T and P v, 4 * B * H_q * D * L * (L + 1) / 2;
selective attention additionally recomputes q k^T in its score pass, 6 * ... / 2), and the peak
memory each call allocates beyond its inputs, total and beyond its returned ``out``.
The first call (Triton compilation) is timed apart.

Targets (H100/H200): ratio <= 2.0 at 8k and 32k, extra memory beyond out < 16 MiB at 32k.
``--tune`` searches block configurations of each pass (pass 1 first with pass 2 at its default,
then pass 2 with the best pass 1) and prints the best as a ``_KernelConfig`` to paste into
``ops/selective_attention.py``.
"""
import argparse
import dataclasses
import json
import math
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ExperimentConfig:
    L: int
    H_q: int
    H_kv: int
    D: int
    B: int = 1
    dtype: str = "bfloat16"

    @property
    def name(self) -> str:
        return f"B{self.B} L{self.L} {self.H_q}/{self.H_kv}h D{self.D} {self.dtype}"


@dataclass(frozen=True)
class ExperimentResult:
    config: ExperimentConfig
    ms: float
    sdpa_ms: float
    ratio: float
    tflops: float
    sdpa_tflops: float
    extra_mib: float
    extra_beyond_out_mib: float
    sdpa_extra_mib: float
    sdpa_extra_beyond_out_mib: float
    first_call_s: float
    max_abs_diff_vs_sdpa: float
    kv_expanded: bool


def get_configs() -> List[ExperimentConfig]:
    # Llama-3-8B attention shape at four lengths; SmolLM2-135M's (9 q / 3 KV heads, D = 64).
    llama = [ExperimentConfig(L, 32, 8, 128) for L in (1024, 4096, 8192, 32768)]
    smol = [ExperimentConfig(L, 9, 3, 64) for L in (4096, 8192)]
    return llama + smol


def causal_flops(cfg: ExperimentConfig, matmuls: int) -> float:
    """FLOPs of ``matmuls`` causal (L x L lower triangle) x D matmuls over all query heads."""
    return 2.0 * matmuls * cfg.B * cfg.H_q * cfg.D * cfg.L * (cfg.L + 1) / 2


def _inputs(cfg: ExperimentConfig) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dtype = getattr(torch, cfg.dtype)
    q = torch.randn(cfg.B, cfg.H_q, cfg.L, cfg.D, dtype=dtype, device="cuda")
    k = torch.randn(cfg.B, cfg.H_kv, cfg.L, cfg.D, dtype=dtype, device="cuda")
    v = torch.randn(cfg.B, cfg.H_kv, cfg.L, cfg.D, dtype=dtype, device="cuda")
    return q, k, v


def _median_ms(fn: Callable[[], object]) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def _peak_extra_bytes(fn: Callable[[], torch.Tensor]) -> Tuple[int, int]:
    """Peak bytes one call allocates beyond what is live before it: (total, beyond its out)."""
    fn()  # anything lazily allocated once (workspaces, compiled kernels) is not per-call memory
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    return extra, extra - out.numel() * out.element_size()


def _sdpa_callable(q, k, v) -> Tuple[Callable[[], torch.Tensor], bool]:
    """SDPA pinned to FlashAttention; (call, whether K/V had to be expanded beforehand)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(kk, vv, gqa):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa)

    try:
        run(k, v, True)
        return (lambda: run(k, v, True)), False
    except RuntimeError:
        group = q.shape[1] // k.shape[1]
        ke, ve = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return (lambda: run(ke, ve, False)), True


def run_experiment(cfg: ExperimentConfig) -> ExperimentResult:
    from minikv_compile.ops import selective_attention

    q, k, v = _inputs(cfg)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out, _ = selective_attention(q, k, v)
    torch.cuda.synchronize()
    first_call_s = time.perf_counter() - start

    sdpa, kv_expanded = _sdpa_callable(q, k, v)
    max_diff = (out.float() - sdpa().float()).abs().max().item()
    del out

    ms = _median_ms(lambda: selective_attention(q, k, v))
    sdpa_ms = _median_ms(sdpa)
    extra, extra_beyond_out = _peak_extra_bytes(lambda: selective_attention(q, k, v)[0])
    sdpa_extra, sdpa_extra_beyond_out = _peak_extra_bytes(sdpa)
    mib = 2.0**20
    return ExperimentResult(
        config=cfg,
        ms=ms,
        sdpa_ms=sdpa_ms,
        ratio=ms / sdpa_ms,
        tflops=causal_flops(cfg, 3) / ms * 1e-9,
        sdpa_tflops=causal_flops(cfg, 2) / sdpa_ms * 1e-9,
        extra_mib=extra / mib,
        extra_beyond_out_mib=extra_beyond_out / mib,
        sdpa_extra_mib=sdpa_extra / mib,
        sdpa_extra_beyond_out_mib=sdpa_extra_beyond_out / mib,
        first_call_s=first_call_s,
        max_abs_diff_vs_sdpa=max_diff,
        kv_expanded=kv_expanded,
    )


# ---------------------------------------------------------------------------------------------
# --tune
# ---------------------------------------------------------------------------------------------

_PASS1_CANDIDATES = {
    # (block_m, block_n, num_warps, num_stages)
    64: [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 4, 4), (64, 64, 4, 3),
         (64, 32, 4, 4), (128, 64, 4, 4)],
    128: [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (128, 128, 8, 2), (128, 32, 4, 3),
          (64, 64, 4, 3), (128, 64, 4, 3), (64, 32, 4, 4)],
}
_PASS2_CANDIDATES = [
    # (score_block_m, score_block_n, num_warps, num_stages)
    (64, 128, 8, 3), (64, 128, 4, 3), (32, 128, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3),
    (128, 64, 8, 3), (64, 256, 8, 3), (32, 256, 8, 3), (64, 128, 8, 2), (64, 128, 8, 4),
]


def _time_config(q, k, v, scale, config, expected) -> Optional[float]:
    from minikv_compile.ops.selective_attention import _selective_attention_triton

    try:
        out, scores = _selective_attention_triton(q, k, v, scale, config)
    except Exception as err:  # e.g. triton's OutOfResources (shared memory) for large tiles
        print(f"  skip {config}: {type(err).__name__}: {str(err).splitlines()[0][:80]}")
        return None
    # A config must reproduce the default's scores (same math, another tile order).
    if not torch.allclose(scores, expected, rtol=1e-3, atol=1e-5):
        print(f"  skip {config}: scores differ from the default config")
        return None
    return _median_ms(lambda: _selective_attention_triton(q, k, v, scale, config))


def tune(cfg: ExperimentConfig) -> None:
    from minikv_compile.ops.selective_attention import _default_config, _selective_attention_triton

    q, k, v = _inputs(cfg)
    scale = 1 / math.sqrt(cfg.D)
    base = _default_config(cfg.D, q.device)
    _, expected = _selective_attention_triton(q, k, v, scale, base)
    print(f"\ntuning {cfg.name}; default {base}")

    best, best_ms = base, _median_ms(lambda: _selective_attention_triton(q, k, v, scale, base))
    print(f"  default: {best_ms:.3f} ms")
    for bm, bn, warps, stages in _PASS1_CANDIDATES.get(cfg.D, []):
        config = dataclasses.replace(
            best, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages
        )
        ms = _time_config(q, k, v, scale, config, expected)
        if ms is not None:
            print(f"  pass 1 {(bm, bn, warps, stages)}: {ms:.3f} ms")
            if ms < best_ms:
                best, best_ms = config, ms
    for bm, bn, warps, stages in _PASS2_CANDIDATES:
        config = dataclasses.replace(
            best, score_block_m=bm, score_block_n=bn, score_num_warps=warps, score_num_stages=stages
        )
        ms = _time_config(q, k, v, scale, config, expected)
        if ms is not None:
            print(f"  pass 2 {(bm, bn, warps, stages)}: {ms:.3f} ms")
            if ms < best_ms:
                best, best_ms = config, ms
    print(f"best for D={cfg.D}: {best_ms:.3f} ms  {best}")


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------

def _environment() -> dict:
    import triton

    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        sha = "unknown"
    try:
        import pynvml

        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else driver
    except Exception:  # NVML missing or not permitted: the report still stands without it
        driver = "unknown"
    return {
        "gpu": torch.cuda.get_device_name(),
        "driver": driver,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "git_sha": sha,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def print_table(results: List[ExperimentResult]) -> None:
    header = (
        f"{'shape':<30} {'ms':>8} {'sdpa ms':>8} {'ratio':>6} {'TFLOP/s':>8} {'sdpa TF/s':>9} "
        f"{'extra MiB':>10} {'beyond out':>10} {'sdpa MiB':>9} {'1st call s':>10}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r.config.name:<30} {r.ms:8.3f} {r.sdpa_ms:8.3f} {r.ratio:6.2f} {r.tflops:8.1f} "
            f"{r.sdpa_tflops:9.1f} {r.extra_mib:10.1f} {r.extra_beyond_out_mib:10.1f} "
            f"{r.sdpa_extra_mib:9.1f} {r.first_call_s:10.2f}"
            + ("  (SDPA on expanded K/V)" if r.kv_expanded else "")
        )


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the results as JSON to this path")
    parser.add_argument("--tune", action="store_true", help="search block configs, print the best")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_selective_attention: needs a CUDA GPU; none found, nothing measured.")
        return 1

    env = _environment()
    print(f"{env['gpu']}  torch {env['torch']}  triton {env['triton']}  driver {env['driver']}")
    if args.tune:
        tune(ExperimentConfig(8192, 32, 8, 128))
        tune(ExperimentConfig(8192, 9, 3, 64))
        return 0

    results = []
    for cfg in get_configs():
        results.append(run_experiment(cfg))
        torch.cuda.empty_cache()
    print_table(results)
    if args.out:
        rows = [{**env, **dataclasses.asdict(r)} for r in results]
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
