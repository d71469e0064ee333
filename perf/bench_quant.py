"""Benchmark the quantization ops and the cache writes of one decode step (with and without a
flush).

    python -m minikv_compile.perf.bench_quant [--out results.json]

Rows:
- quantize_keys / quantize_values (and their dequantize twins) on (B=8, H=8, T=4096, D=128) bf16,
  2 and 4 bit, G = 16;
- step / step_flush: the cache writes of one decode step for B = 8 slots, H_kv = 8, D = 128,
  ring R = 128, 2 bit, 32 layers (a Llama-3-8B-sized step) as the engine runs them,
  ``cache_begin_step`` over every layer then ``cache_write_ring`` per layer: a step that only
  writes the new token, and a step where every slot flushes its full ring of 128 tokens first.

Each row gives the median time of an eager call (``triton.testing.do_bench``; includes Python and
launch overhead) and of the same work replayed from a CUDA graph (how the engine runs the decode
step), the bytes the op must move, and the bandwidth that graph time achieves, also as a fraction
of the NVML-derived peak (memory clock x bus width x 2). The step mutates its counters, so
every timed call first restores them (``lens.copy_``); that copy is timed alone and subtracted
("net"). The flush cost of a step is the 32-layer flush row minus the 32-layer plain row; amortized
over the R steps between flushes, it is what the flush adds to an average decode step.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from minikv_compile.perf.measure import median_ms, nvml_peak_gbps, row_environment, write_json

RING = 128


@dataclass(frozen=True)
class ExperimentConfig:
    op: str                 # quantize_keys | quantize_values | dequantize_keys | dequantize_values
                            # | step | step_flush
    B: int = 8
    H: int = 8
    T: int = 4096           # tokens quantized (quant ops); unused by step rows (ring = RING)
    D: int = 128
    bits: int = 2
    group_size: int = 16
    dtype: str = "bfloat16"
    layers: int = 1         # step rows: layer caches per timed step

    @property
    def name(self) -> str:
        if self.op.startswith("step"):
            return f"{self.op} B{self.B} H{self.H} D{self.D} {self.bits}b x{self.layers} layers"
        return f"{self.op} ({self.B},{self.H},{self.T},{self.D}) {self.bits}b G{self.group_size}"


@dataclass(frozen=True)
class ExperimentResult:
    config: ExperimentConfig
    eager_us: float         # median eager call (net of the lens reset for step rows)
    graph_us: float         # median CUDA-graph replay (net of the lens reset for step rows)
    reset_us: float         # the subtracted lens resets, replayed from a graph (0 for quant ops)
    bytes_moved: int
    gbps: float             # bytes_moved / graph_us
    fraction_of_peak: Optional[float]


def get_configs() -> List[ExperimentConfig]:
    quant = [ExperimentConfig(op, bits=bits)
             for bits in (2, 4)
             for op in ("quantize_keys", "quantize_values", "dequantize_keys",
                        "dequantize_values")]
    step = [ExperimentConfig(op, layers=32) for op in ("step", "step_flush")]
    return quant + step


# ---------------------------------------------------------------------------------------------
# Timing helpers
# ---------------------------------------------------------------------------------------------


def _median_us(fn: Callable[[], object]) -> float:
    return 1e3 * median_ms(fn)


def _graphed(fn: Callable[[], object]) -> Callable[[], None]:
    """Capture ``fn`` (already warmed up) into a CUDA graph; return its replay."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


# ---------------------------------------------------------------------------------------------
# Experiments
# ---------------------------------------------------------------------------------------------


def _quant_bytes(cfg: ExperimentConfig) -> int:
    n = cfg.B * cfg.H * cfg.T * cfg.D
    full = n * torch.finfo(getattr(torch, cfg.dtype)).bits // 8
    codes = n * cfg.bits // 8
    scale_zero = 2 * 2 * n // cfg.group_size
    return full + codes + scale_zero     # read one side, write the other


def _run_quant(cfg: ExperimentConfig, peak: Optional[float]) -> ExperimentResult:
    from minikv_compile import ops

    dtype = getattr(torch, cfg.dtype)
    x = torch.randn(cfg.B, cfg.H, cfg.T, cfg.D, dtype=dtype, device="cuda")
    G, bits = cfg.group_size, cfg.bits
    fn = {
        "quantize_keys": lambda: ops.quantize_keys(x, bits, G),
        "quantize_values": lambda: ops.quantize_values(x, bits, G),
    }.get(cfg.op)
    if fn is None:
        q = (ops.quantize_keys if cfg.op == "dequantize_keys" else ops.quantize_values)(x, bits, G)
        dequant = getattr(ops, cfg.op)
        fn = lambda: dequant(*q, bits, G, dtype)  # noqa: E731
    fn()
    torch.cuda.synchronize()
    eager = _median_us(fn)
    graph = _median_us(_graphed(fn))
    nbytes = _quant_bytes(cfg)
    gbps = nbytes / graph * 1e-3
    return ExperimentResult(cfg, eager, graph, 0.0, nbytes, gbps, gbps / peak if peak else None)


def _layer_cache(cfg: ExperimentConfig, T_cap: int):
    """One layer's buffers (the contract's layout), zero-filled."""
    B, H, D, G, P = cfg.B, cfg.H, cfg.D, cfg.group_size, 32 // cfg.bits
    dtype = getattr(torch, cfg.dtype)
    z = dict(device="cuda")
    return [torch.zeros(B, H, T_cap // P, D, dtype=torch.int32, **z),
            torch.zeros(B, H, T_cap // G, D, dtype=torch.float16, **z),
            torch.zeros(B, H, T_cap // G, D, dtype=torch.float16, **z),
            torch.zeros(B, H, T_cap, D // P, dtype=torch.int32, **z),
            torch.zeros(B, H, T_cap, D // G, dtype=torch.float16, **z),
            torch.zeros(B, H, T_cap, D // G, dtype=torch.float16, **z),
            torch.randn(B, H, RING, D, dtype=dtype, **z),
            torch.randn(B, H, RING, D, dtype=dtype, **z),
            torch.zeros(B, 2, dtype=torch.int32, **z)]


def _step_bytes(cfg: ExperimentConfig) -> int:
    B, H, D, G = cfg.B, cfg.H, cfg.D, cfg.group_size
    elem = torch.finfo(getattr(torch, cfg.dtype)).bits // 8
    token = 2 * B * H * D * elem * 2             # k and v: read the new token, write the ring row
    counters = B * 2 * 4 * 2                     # lens: read by launch 1, rewritten by launch 2
    flush = 0
    if cfg.op.endswith("_flush"):
        n = B * H * RING * D
        flush = 2 * (n * elem + n * cfg.bits // 8 + 2 * 2 * n // G)  # k and v: ring in, codes out
    return cfg.layers * (token + counters + flush)


def _run_step(cfg: ExperimentConfig, peak: Optional[float]) -> ExperimentResult:
    from minikv_compile import ops

    dtype = getattr(torch, cfg.dtype)
    T_cap = 4 * RING
    layers = [_layer_cache(cfg, T_cap) for _ in range(cfg.layers)]
    # Every slot holds 2 * RING quantized tokens; the ring is full (flush) or holds 5 tokens.
    flush = cfg.op.endswith("_flush")
    ring_fill = RING if flush else 5
    lens0 = torch.tensor([[2 * RING, ring_fill]] * cfg.B, dtype=torch.int32, device="cuda")
    k_new = torch.randn(cfg.B, cfg.H, cfg.D, dtype=dtype, device="cuda")
    v_new = torch.randn_like(k_new)

    def reset():
        for bufs in layers:
            bufs[8].copy_(lens0)

    layout = ops.CacheLayout(layers, cfg.bits, cfg.group_size)
    live = torch.ones(cfg.B, dtype=torch.bool, device="cuda")

    def step():
        reset()
        ring_index = ops.cache_begin_step(layout, cfg.B, live)
        for bufs, index in zip(layers, ring_index):
            ops.cache_write_ring(k_new, v_new, bufs[6], bufs[7], index)

    step()
    want = [3 * RING, 1] if flush else [2 * RING, ring_fill + 1]
    if layers[0][8][0].tolist() != want:  # the timed step must do the work it is named for
        raise RuntimeError(f"{cfg.name}: expected lens {want} after one step, "
                           f"got {layers[0][8][0].tolist()}")
    reset_eager, reset_graph = _median_us(reset), _median_us(_graphed(reset))
    eager = _median_us(step) - reset_eager
    graph = _median_us(_graphed(step)) - reset_graph
    nbytes = _step_bytes(cfg)
    gbps = nbytes / graph * 1e-3
    return ExperimentResult(cfg, eager, graph, reset_graph, nbytes, gbps,
                            gbps / peak if peak else None)


def run_experiment(cfg: ExperimentConfig, peak: Optional[float] = None) -> ExperimentResult:
    if cfg.op.startswith("step"):
        return _run_step(cfg, peak)
    return _run_quant(cfg, peak)


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------


def print_table(results: List[ExperimentResult]) -> None:
    header = (f"{'op':<52} {'eager us':>9} {'graph us':>9} {'reset us':>9} {'MB':>8} "
              f"{'GB/s':>8} {'% peak':>7}")
    print(header)
    print("-" * len(header))
    for r in results:
        frac = f"{100 * r.fraction_of_peak:6.1f}%" if r.fraction_of_peak is not None else "      -"
        print(f"{r.config.name:<52} {r.eager_us:9.1f} {r.graph_us:9.1f} {r.reset_us:9.1f} "
              f"{r.bytes_moved / 1e6:8.2f} {r.gbps:8.1f} {frac}")


def flush_summary(results: List[ExperimentResult]) -> dict:
    """Flush cost of a whole decode step (the deepest layer count measured), from graph times."""
    by = {(r.config.op, r.config.layers): r for r in results}
    layers = max(r.config.layers for r in results if r.config.op.startswith("step"))
    flush_us = by["step_flush", layers].graph_us - by["step", layers].graph_us
    return {"layers": layers, "ring": RING, "flush_us": flush_us,
            "flush_us_per_step_amortized": flush_us / RING,
            "step_us_per_step": by["step", layers].graph_us}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the results as JSON to this path")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_quant: needs a CUDA GPU; none found, nothing measured.")
        return 1

    env = row_environment()
    peak = nvml_peak_gbps()
    peak_note = f"  peak {peak:.0f} GB/s (NVML)" if peak else "  peak unknown (no NVML)"
    print(f"{env['gpu']}  torch {env['torch']}  triton {env['triton']}  driver {env['driver']}"
          + peak_note)
    results = []
    for cfg in get_configs():
        results.append(run_experiment(cfg, peak))
        torch.cuda.empty_cache()
    print_table(results)
    summary = flush_summary(results)
    print(f"\nflush of {summary['ring']} tokens in all {summary['layers']} layers "
          f"(cache_begin_step + cache_write_ring): {summary['flush_us']:.1f} us once every "
          f"{summary['ring']} steps = {summary['flush_us_per_step_amortized']:.2f} us per step on "
          f"average (no flush: {summary['step_us_per_step']:.1f} us per step)")
    if args.out:
        rows = [{**env, "peak_gbps": peak, **dataclasses.asdict(r)} for r in results]
        write_json(args.out, {"rows": rows, "flush_summary": {**env, **summary}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
