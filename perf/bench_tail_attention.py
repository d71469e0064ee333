"""Benchmark tail_attention (a chunk of T query rows per sequence over the compressed cache,
causal among themselves) against T launches of decode_attention, one per row: the prefill of a
prompt's tail after a cached prefix, chunked, against running it through the decode step.

    python -m minikv_compile.perf.bench_tail_attention [--out results.json] [--sweep]

Shapes: Llama-3.1-8B attention (32 query / 8 KV heads, D = 128, bf16), G = 16, a ring of 128
rows (256 for the 256-token chunk) that holds the chunk: ``lens = (N, 1)`` (row 0's token at ring row 0; row t sees the first
t + 1 ring rows). The first row is the issue's case: one sequence, 32k quantized tokens (bits
2), T = 128 (one ring of tail). Caches come from ``bench_decode_attention._cache`` (random
codes, every slot full).

Timing: each side is captured into a CUDA graph (the tail op: its two launches; the decode side:
T decode_attention calls, row t with its own ``lens`` whose ring count is 1 + t, so the graph
replays the whole chunk) and the replay is timed with ``triton.testing.do_bench`` (median; L2
flushed before each replay). The eager tail call (Python and launch overhead included) is
reported too. TFLOP/s counts the tail op's two dots over every token a row sees,
``4 B T H_q D (N + (T + 1) / 2)``. The first row also checks the op against its reference and
the decode side (max |diff|).

``--sweep`` times a grid of the tail kernel's launch plan (BLOCK_M, BLOCK_N, warps, stages,
splits around the default) on the first row and prints each with the best.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from dataclasses import dataclass
from typing import List, Optional

import torch

from minikv_compile.ops import attention_tail as at
from minikv_compile.ops import decode_attention, tail_attention
from minikv_compile.ops._checks import sm_count
from minikv_compile.perf import bench_decode_attention as bda
from minikv_compile.perf.measure import graph_ms, median_ms, row_environment, write_json

H_Q, H_KV, D, RING, GROUP = 32, 8, 128, 128, 16


@dataclass(frozen=True)
class ExperimentConfig:
    B: int
    n_quant: int            # quantized tokens held per sequence (the cache capacity too)
    T: int                  # the chunk's query rows (<= ring)
    bits: int = 2           # 2, 4 or 16
    ring: int = RING        # ring rows (the chunk's room)
    H_q: int = H_Q
    H_kv: int = H_KV
    D: int = D
    group_size: int = GROUP
    dtype: str = "bfloat16"

    @property
    def name(self) -> str:
        return (f"B{self.B} {self.n_quant // 1024}k T{self.T} {self.bits}b "
                f"{self.H_q}/{self.H_kv}h D{self.D}" + (f" R{self.ring}" if self.ring != RING
                                                         else ""))

    def decode_config(self) -> "bda.ExperimentConfig":
        return bda.ExperimentConfig(self.B, self.n_quant, self.bits, self.H_q, self.H_kv, self.D,
                                    self.ring, self.group_size, self.dtype)


@dataclass(frozen=True)
class ExperimentResult:
    config: ExperimentConfig
    tail_ms: float                  # graph replay of one tail_attention call
    tail_eager_ms: float
    decode_ms: float                # graph replay of T decode_attention calls
    speedup: float                  # decode_ms / tail_ms
    tail_tflops: float
    tail_us_per_row: float          # tail_ms / T
    max_abs_diff_vs_ref: Optional[float]
    max_abs_diff_vs_decode: Optional[float]
    launch_config: str              # the tail kernel's default plan


def get_configs() -> List[ExperimentConfig]:
    """The issue's row first, then shorter chunks and a 256-token one (in a ring of 256), other
    bits, a batch and a shorter cache."""
    return [ExperimentConfig(1, 32768, 128),
            ExperimentConfig(1, 32768, 16), ExperimentConfig(1, 32768, 64),
            ExperimentConfig(1, 32768, 256, ring=256),
            ExperimentConfig(1, 32768, 128, bits=4), ExperimentConfig(1, 32768, 128, bits=16),
            ExperimentConfig(4, 8192, 128), ExperimentConfig(1, 4096, 128)]


def _inputs(cfg: ExperimentConfig):
    """(q (B, T, H_q, D), the layer's nine buffers with lens = (N, 1), the T per-row lens)."""
    bufs = bda._cache(cfg.decode_config())
    lens = bufs[-1]
    lens[:, 1] = 1
    row_lens = [lens.clone() for _ in range(cfg.T)]
    for t, lt in enumerate(row_lens):
        lt[:, 1] = 1 + t
    q = torch.randn(cfg.B, cfg.T, cfg.H_q, cfg.D, dtype=getattr(torch, cfg.dtype),
                    device="cuda")
    return q, bufs, row_lens


def _plan(cfg: ExperimentConfig) -> "at._TailPlan":
    return at._tail_plan(getattr(torch, cfg.dtype), cfg.bits, cfg.group_size, cfg.D, cfg.B,
                         cfg.T, cfg.H_q, cfg.H_kv, cfg.n_quant, sm_count(torch.device("cuda")))


def _describe(plan) -> str:
    return " ".join(f"{k}={v}" for k, v in plan._asdict().items())


def run_experiment(cfg: ExperimentConfig, check: bool = False) -> ExperimentResult:
    q, bufs, row_lens = _inputs(cfg)
    scale = cfg.D ** -0.5

    def tail():
        return tail_attention(q, *bufs, scale, cfg.bits, cfg.group_size)

    def decode_rows():
        return [decode_attention(q[:, t], *bufs[:-1], row_lens[t], scale, cfg.bits,
                                 cfg.group_size) for t in range(cfg.T)]

    out = tail()  # compile outside any timing
    rows = decode_rows()
    torch.cuda.synchronize()
    diff_ref = diff_decode = None
    if check:
        ref = at.tail_attention_ref(q, *bufs, scale, cfg.bits, cfg.group_size)
        diff_ref = (out.float() - ref.float()).abs().max().item()
        diff_decode = (out.float() - torch.stack(rows, 1).float()).abs().max().item()
        del ref
    del rows
    tail_ms = graph_ms([tail])
    eager_ms = median_ms(tail, warmup=10, rep=100)
    decode_ms = graph_ms([decode_rows])
    flops = 4 * cfg.B * cfg.T * cfg.H_q * cfg.D * (cfg.n_quant + (cfg.T + 1) / 2)
    return ExperimentResult(
        config=cfg, tail_ms=tail_ms, tail_eager_ms=eager_ms, decode_ms=decode_ms,
        speedup=decode_ms / tail_ms, tail_tflops=flops / (tail_ms * 1e-3) / 1e12,
        tail_us_per_row=tail_ms * 1e3 / cfg.T, max_abs_diff_vs_ref=diff_ref,
        max_abs_diff_vs_decode=diff_decode, launch_config=_describe(_plan(cfg)))


def sweep(cfg: ExperimentConfig) -> None:
    """Time candidate plans of the tail kernel on ``cfg``; each is checked against the default's
    output first."""
    q, bufs, _ = _inputs(cfg)
    scale = cfg.D ** -0.5
    base = _plan(cfg)
    expected = at._tail_attention_triton(q, *bufs, scale, cfg.bits, cfg.group_size, base)

    def time_plan(plan) -> Optional[float]:
        try:
            out = at._tail_attention_triton(q, *bufs, scale, cfg.bits, cfg.group_size, plan)
        except Exception as err:  # invalid for this shape or out of resources
            print(f"  skip {_describe(plan)}: {type(err).__name__}: "
                  f"{str(err).splitlines()[0][:80]}")
            return None
        if not torch.allclose(out.float(), expected.float(), rtol=2e-2, atol=2e-2):
            print(f"  skip {_describe(plan)}: output differs from the default plan's")
            return None
        return graph_ms([lambda: at._tail_attention_triton(q, *bufs, scale, cfg.bits,
                                                           cfg.group_size, plan)])

    print(f"\nsweep {cfg.name}; default {_describe(base)}")
    base_ms = time_plan(base)
    print(f"  default: {base_ms:.4f} ms")
    timings = [(base_ms, base)]
    for bm, bn, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (1, 2, 3)):
        plan = base._replace(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
        if plan == base:
            continue
        ms = time_plan(plan)
        if ms is not None:
            timings.append((ms, plan))
            print(f"  {_describe(plan)}: {ms:.4f} ms", flush=True)
    best_ms, best = min(timings, key=lambda t: t[0])
    n = best.num_splits
    for splits in sorted({max(1, n // 2), max(1, n - 2), n + 2, n * 3 // 2, n * 2} - {n}):
        ms = time_plan(best._replace(num_splits=min(splits, at.MAX_SPLITS)))
        if ms is not None:
            print(f"  num_splits={splits}: {ms:.4f} ms")
            if ms < best_ms:
                best_ms, best = ms, best._replace(num_splits=splits)
    print(f"best for {cfg.name}: {best_ms:.4f} ms ({base_ms / best_ms:.2f}x the default)  "
          f"{_describe(best)}")


def print_table(results: List[ExperimentResult]) -> None:
    header = (f"{'case':<28} {'tail ms':>8} {'eager ms':>8} {'T x decode ms':>13} "
              f"{'speedup':>7} {'TFLOP/s':>7} {'us/row':>7}")
    print()
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r.config.name:<28} {r.tail_ms:8.4f} {r.tail_eager_ms:8.4f} {r.decode_ms:13.4f} "
              f"{r.speedup:7.1f} {r.tail_tflops:7.1f} {r.tail_us_per_row:7.2f}")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the results as JSON to this path")
    parser.add_argument("--sweep", action="store_true",
                        help="time launch plans of the tail kernel on the first row")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_tail_attention: needs a CUDA GPU; none found, nothing measured.")
        return 1
    env = row_environment()
    print(f"{env['gpu']}  torch {env['torch']}  triton {env['triton']}  driver {env['driver']}")
    configs = get_configs()
    if args.sweep:
        sweep(configs[0])
        return 0
    results = []
    for i, cfg in enumerate(configs):
        r = run_experiment(cfg, check=i == 0)
        results.append(r)
        print(f"  {cfg.name}: tail {r.tail_ms:.4f} ms, {cfg.T} x decode {r.decode_ms:.4f} ms "
              f"({r.speedup:.1f}x)  {r.launch_config}"
              + (f"  max |tail - ref| {r.max_abs_diff_vs_ref:.2e}, |tail - decode| "
                 f"{r.max_abs_diff_vs_decode:.2e}" if r.max_abs_diff_vs_ref is not None else ""),
              flush=True)
        torch.cuda.empty_cache()
    print_table(results)
    if args.out:
        write_json(args.out, [{**env, **dataclasses.asdict(r)} for r in results])
    return 0


if __name__ == "__main__":
    sys.exit(main())
