"""Benchmark decode_attention (one query token per sequence over the compressed cache) against
SDPA's fp16/bf16 decode attention over the full, uncompressed context.

    python -m minikv_compile.perf.bench_decode_attention [--out results.json] [--bits 2] [--tune]
    python -m minikv_compile.perf.bench_decode_attention --variants [--out variants.json]

Shapes are Llama-3-8B attention (32 query / 8 KV heads, D = 128, bf16), G = 16, a full 128-token
ring. MiniKV keeps 50% of the prompt, so a row with N quantized tokens is compared with SDPA over
2N uncompressed tokens. SDPA is pinned to the FlashAttention backend with ``enable_gqa=True`` (it
reads the 8 KV heads once, like our kernel); should that backend refuse GQA, K/V are expanded to
32 heads *outside* the timed region and the row says so.

Timing: every call is captured into a CUDA graph (the way the engine runs the decode step) and
the replay is timed with ``triton.testing.do_bench`` (median; it flushes L2 before each replay).
When one call reads less than 3x the L2 size, the graph instead calls the op on several copies
of the cache in turn, so every call still reads from HBM, and the time is divided by the count.
The eager call (Python and launch overhead included) is reported too.

Bytes read by our op: K and V codes, their fp16 scales and zeros, the ring (model dtype), q, out
and lens. Achieved TB/s is that over the graph time; "of copy" divides it by the device-to-device
copy bandwidth measured in the same run (``measure.copy_bandwidth``: read + write bytes of a 1 GiB
``dst.copy_(src)``, the fastest of 5 block medians of 40 copies, as in the evidence tool).
Targets (H100/H200): >= 60% of copy bandwidth on large rows; B 8, 16k quantized (bits 2) <= 0.25x
of SDPA over 32k.

``--tune`` times a grid of (BLOCK_N, num_warps, num_stages) of the Triton kernel's plan and split
counts around the best for each row of the first table and prints the best per row.

``--variants`` times the two kernels and launch variants of ``VARIANTS`` side by side
on ``VARIANT_CASES`` (same timing method, one cache set per case shared by all variants), checks
each against the reference on the B 8 rows, and prints one table; about a minute on an H200,
most of it compiling.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F

from minikv_compile.ops import attention_decode as da
from minikv_compile.ops._checks import sm_count
from minikv_compile.perf.measure import (copy_bandwidth, graph_ms, median_ms, replicas,
                                         row_environment, write_json)

H_Q, H_KV, D, RING, GROUP = 32, 8, 128, 128, 16
BATCHES = (1, 8, 32, 64)
LENGTHS = (4096, 16384, 65536, 131072)
# At most this fraction of the free GPU memory goes to one row's buffers.
MEMORY_FRACTION = 0.8


@dataclass(frozen=True)
class ExperimentConfig:
    B: int
    n_quant: int            # quantized tokens held per sequence (the cache capacity too)
    bits: int = 2           # 2, 4 or 16 (16: the "quantized" region is a bf16 cache)
    H_q: int = H_Q
    H_kv: int = H_KV
    D: int = D
    ring: int = RING        # ring tokens held (= ring capacity: the largest step)
    group_size: int = GROUP
    dtype: str = "bfloat16"

    @property
    def sdpa_tokens(self) -> int:
        """Uncompressed context SDPA attends over: MiniKV keeps 50% of the prompt."""
        return 2 * self.n_quant

    @property
    def name(self) -> str:
        return (f"B{self.B} {self.n_quant // 1024}k+{self.ring} {self.bits}b "
                f"{self.H_q}/{self.H_kv}h D{self.D}")


@dataclass(frozen=True)
class ExperimentResult:
    config: ExperimentConfig
    ms: Optional[float]             # graph replay, per call
    eager_ms: Optional[float]
    bytes_read: int
    tb_per_s: Optional[float]
    fraction_of_copy: Optional[float]
    replicas: int                   # cache copies cycled per timed graph (L2 defeat)
    sdpa_ms: Optional[float]        # graph replay over sdpa_tokens uncompressed tokens
    sdpa_bytes: int
    sdpa_tb_per_s: Optional[float]
    ratio: Optional[float]          # ms / sdpa_ms
    sdpa_kv_expanded: bool
    max_abs_diff_vs_ref: Optional[float]
    launch_config: str              # BLOCK_N / warps / stages / NUM_SPLITS of the default
    skipped: Optional[str]


def get_configs(bits: int = 2) -> List[ExperimentConfig]:
    """The target row first (with its 4- and 16-bit twins), then the batch x length sweep."""
    main = [ExperimentConfig(8, 16384, b) for b in (2, 4, 16)]
    sweep = [ExperimentConfig(b, n, bits) for b in BATCHES for n in LENGTHS]
    return main + [c for c in sweep if c not in main]


# ---------------------------------------------------------------------------------------------
# Inputs and byte counts
# ---------------------------------------------------------------------------------------------


def _cache(cfg: ExperimentConfig) -> List[torch.Tensor]:
    """One layer's buffers in the op's argument order (the contract's layout), random contents.

    Codes are random words; scales are small positive and zeros centered, so dequantized values
    look like keys/values (the kernel's cost does not depend on them). Every slot is full.
    """
    B, H, T, Dh, G = cfg.B, cfg.H_kv, cfg.n_quant, cfg.D, cfg.group_size
    dtype = getattr(torch, cfg.dtype)
    z = dict(device="cuda")
    ring_k = torch.randn(B, H, cfg.ring, Dh, dtype=dtype, **z)
    ring_v = torch.randn(B, H, cfg.ring, Dh, dtype=dtype, **z)
    lens = torch.tensor([[T, cfg.ring]] * B, dtype=torch.int32, **z)
    if cfg.bits == 16:
        empty = torch.empty(0, dtype=torch.float16, **z)
        k = torch.randn(B, H, T, Dh, dtype=dtype, **z)
        v = torch.randn(B, H, T, Dh, dtype=dtype, **z)
        return [k, empty, empty, v, empty, empty, ring_k, ring_v, lens]
    P = 32 // cfg.bits

    def words(*shape):
        return torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32, **z)

    def scales(*shape):
        return (torch.rand(*shape, **z) * 0.5 + 0.05).half()

    def zeros(*shape):
        return torch.randn(*shape, **z).half()

    return [words(B, H, T // P, Dh), scales(B, H, T // G, Dh), zeros(B, H, T // G, Dh),
            words(B, H, T, Dh // P), scales(B, H, T, Dh // G), zeros(B, H, T, Dh // G),
            ring_k, ring_v, lens]


def bytes_read(cfg: ExperimentConfig) -> int:
    """HBM bytes one call must read (and write: out): what the bandwidth figures count."""
    elt = torch.finfo(getattr(torch, cfg.dtype)).bits // 8
    values = cfg.B * cfg.H_kv * cfg.n_quant * cfg.D          # per K and per V
    if cfg.bits == 16:
        region = 2 * values * elt
    else:
        region = 2 * (values * cfg.bits // 8 + 2 * 2 * values // cfg.group_size)
    ring = 2 * cfg.B * cfg.H_kv * cfg.ring * cfg.D * elt
    q_out = 2 * cfg.B * cfg.H_q * cfg.D * elt
    return region + ring + q_out + cfg.B * 2 * 4


def sdpa_bytes(cfg: ExperimentConfig) -> int:
    elt = torch.finfo(getattr(torch, cfg.dtype)).bits // 8
    return (2 * cfg.B * cfg.H_kv * cfg.sdpa_tokens * cfg.D + 2 * cfg.B * cfg.H_q * cfg.D) * elt


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def _sdpa_callable(q, k, v) -> Tuple[Callable[[], torch.Tensor], bool]:
    """Decode SDPA (q: (B, H_q, 1, D)) pinned to FlashAttention; (call, K/V expanded?)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(kk, vv, gqa):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, kk, vv, enable_gqa=gqa)

    try:
        run(k, v, True)
        return (lambda: run(k, v, True)), False
    except RuntimeError:
        group = q.shape[1] // k.shape[1]
        ke, ve = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return (lambda: run(ke, ve, False)), True


def _free_bytes() -> int:
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


# ---------------------------------------------------------------------------------------------
# Experiments
# ---------------------------------------------------------------------------------------------


def _plan(cfg: ExperimentConfig, kernel: Optional[str] = None) -> "da._Plan":
    """The launch the op runs for ``cfg`` (``kernel``: that kernel instead)."""
    return da._plan(torch.device("cuda"), getattr(torch, cfg.dtype), cfg.bits, cfg.group_size,
                    cfg.D, cfg.B, cfg.H_q, cfg.H_kv, cfg.n_quant, sm_count(torch.device("cuda")),
                    kernel)


def _describe(plan) -> str:
    return " ".join(f"{k}={v}" for k, v in plan._asdict().items())


def run_experiment(cfg: ExperimentConfig, copy_bps: float, check: bool = False
                   ) -> ExperimentResult:
    from minikv_compile.ops import decode_attention

    nbytes, sbytes = bytes_read(cfg), sdpa_bytes(cfg)
    n_copies = replicas(nbytes)
    empty = dict(ms=None, eager_ms=None, tb_per_s=None, fraction_of_copy=None, sdpa_ms=None,
                 sdpa_tb_per_s=None, ratio=None, sdpa_kv_expanded=False, max_abs_diff_vs_ref=None)
    if nbytes * n_copies > MEMORY_FRACTION * _free_bytes():
        return ExperimentResult(cfg, bytes_read=nbytes, replicas=n_copies, sdpa_bytes=sbytes,
                                launch_config="", skipped="cache exceeds free memory", **empty)

    dtype = getattr(torch, cfg.dtype)
    scale = cfg.D ** -0.5
    q = torch.randn(cfg.B, cfg.H_q, cfg.D, dtype=dtype, device="cuda")
    caches = [_cache(cfg) for _ in range(n_copies)]
    calls = [lambda c=c: decode_attention(q, *c, scale, cfg.bits, cfg.group_size) for c in caches]
    calls[0]()  # compile outside any timing
    torch.cuda.synchronize()
    diff = None
    if check:
        ref = da.decode_attention_ref(q, *caches[0], scale, cfg.bits, cfg.group_size)
        diff = (calls[0]().float() - ref.float()).abs().max().item()
        del ref
    ms = graph_ms(calls)
    eager_ms = median_ms(calls[0], warmup=10, rep=100)
    del calls, caches
    torch.cuda.empty_cache()

    sdpa_ms = None
    expanded = False
    sq = q.view(cfg.B, cfg.H_q, 1, cfg.D)
    sdpa_replicas = replicas(sbytes)
    if sbytes * sdpa_replicas <= MEMORY_FRACTION * _free_bytes():
        kvs = [(torch.randn(cfg.B, cfg.H_kv, cfg.sdpa_tokens, cfg.D, dtype=dtype, device="cuda"),
                torch.randn(cfg.B, cfg.H_kv, cfg.sdpa_tokens, cfg.D, dtype=dtype, device="cuda"))
               for _ in range(sdpa_replicas)]
        sdpa_calls = []
        for k, v in kvs:
            call, expanded = _sdpa_callable(sq, k, v)
            sdpa_calls.append(call)
        sdpa_ms = graph_ms(sdpa_calls)
        del kvs, sdpa_calls
        torch.cuda.empty_cache()

    tbps = nbytes / (ms * 1e-3) / 1e12
    return ExperimentResult(
        config=cfg, ms=ms, eager_ms=eager_ms, bytes_read=nbytes, tb_per_s=tbps,
        fraction_of_copy=tbps * 1e12 / copy_bps, replicas=n_copies,
        sdpa_ms=sdpa_ms, sdpa_bytes=sbytes,
        sdpa_tb_per_s=sbytes / (sdpa_ms * 1e-3) / 1e12 if sdpa_ms else None,
        ratio=ms / sdpa_ms if sdpa_ms else None, sdpa_kv_expanded=expanded,
        max_abs_diff_vs_ref=diff, launch_config=_describe(_plan(cfg)),
        skipped=None if sdpa_ms else "SDPA: uncompressed K/V exceed free memory")


# ---------------------------------------------------------------------------------------------
# --tune
# ---------------------------------------------------------------------------------------------

_CANDIDATES = [(bn, w, st) for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)]


def tune(cfg: ExperimentConfig) -> None:
    """Time (BLOCK_N, warps, stages) candidates of the Triton kernel's plan, then the split
    counts around the best."""
    nbytes = bytes_read(cfg)
    n_copies = replicas(nbytes)
    if nbytes * n_copies > MEMORY_FRACTION * _free_bytes():
        print(f"\n{cfg.name}: skipped (cache exceeds free memory)")
        return
    dtype = getattr(torch, cfg.dtype)
    scale = cfg.D ** -0.5
    q = torch.randn(cfg.B, cfg.H_q, cfg.D, dtype=dtype, device="cuda")
    caches = [_cache(cfg) for _ in range(n_copies)]
    base = _plan(cfg, da.SPLIT)
    expected = da._decode_attention_triton(q, *caches[0], scale, cfg.bits, cfg.group_size, base)

    def time_plan(plan) -> Optional[float]:
        try:
            out = da._decode_attention_triton(q, *caches[0], scale, cfg.bits, cfg.group_size, plan)
        except Exception as err:  # invalid for this shape (block vs group) or out of resources
            print(f"  skip {_describe(plan)}: {type(err).__name__}: "
                  f"{str(err).splitlines()[0][:80]}")
            return None
        if not torch.allclose(out.float(), expected.float(), rtol=2e-2, atol=2e-2):
            print(f"  skip {_describe(plan)}: output differs from the default configuration")
            return None
        return graph_ms([lambda c=c: da._decode_attention_triton(
            q, *c, scale, cfg.bits, cfg.group_size, plan) for c in caches])

    print(f"\ntuning {cfg.name}; default {_describe(base)}")
    base_ms = time_plan(base)
    print(f"  default: {base_ms:.4f} ms")
    timings = []
    for bn, warps, stages in _CANDIDATES:
        # the default register cap is sized for the default warps
        plan = base._replace(block_n=bn, num_warps=warps, num_stages=stages,
                             maxnreg=base.maxnreg if warps == base.num_warps else None)
        ms = time_plan(plan)
        if ms is not None:
            timings.append((ms, plan))
            print(f"  {_describe(plan)}: {ms:.4f} ms")
    best_ms, best = min(timings, key=lambda t: t[0])
    splits = best.num_splits
    around = {splits // 2, splits - 2, splits - 1, splits + 1, splits + 2, splits * 3 // 2,
              splits * 2}
    for n in sorted(n for n in around if 1 <= n <= da.MAX_SPLITS and n != splits):
        ms = time_plan(best._replace(num_splits=n))
        if ms is not None:
            print(f"  num_splits={n}: {ms:.4f} ms")
            if ms < best_ms:
                best_ms, best = ms, best._replace(num_splits=n)
    print(f"best for {cfg.name}: {best_ms:.4f} ms ({base_ms / best_ms:.2f}x the default)  "
          f"{_describe(best)}")


# ---------------------------------------------------------------------------------------------
# --variants
# ---------------------------------------------------------------------------------------------

# (name, the kernel, fields of its plan replaced): the Gluon kernel, the Triton kernel, and the
# Triton kernel with one launch choice changed each, to show which resource binds: registers (no
# cap: 4 instead of 5 programs per SM) and shared-memory traffic (codes staged by cp.async, or
# loaded into registers one block ahead: the default for bits 2).
VARIANTS: List[Tuple[str, str, dict]] = [
    ("fragments (Gluon)", "fragments", {}),
    ("split (Triton)", "split", {}),
    ("split no reg cap", "split", dict(maxnreg=None)),
    ("split cp.async staging", "split", dict(prefetch=False, num_stages=3)),
    ("split register prefetch", "split", dict(prefetch=True, num_stages=1)),
]
VARIANT_CASES = [ExperimentConfig(8, 16384, 2), ExperimentConfig(8, 16384, 4),
                 ExperimentConfig(8, 16384, 16), ExperimentConfig(1, 16384, 2),
                 ExperimentConfig(1, 131072, 2), ExperimentConfig(64, 16384, 2)]


@dataclass(frozen=True)
class VariantResult:
    config: ExperimentConfig
    variant: str
    launch_config: str
    ms: Optional[float]
    tb_per_s: Optional[float]
    fraction_of_copy: Optional[float]
    speedup_vs_first: Optional[float]   # the first variant's ms / this ms
    ratio_vs_sdpa: Optional[float]
    sdpa_ms: Optional[float]
    max_abs_diff_vs_ref: Optional[float]
    error: Optional[str]


def run_variants(cfg: ExperimentConfig, copy_bps: float) -> List[VariantResult]:
    """Every entry of VARIANTS on one cache set of ``cfg`` (bits 16: one row, the default plan),
    plus SDPA over the uncompressed context. A variant that does not cover the case, or fails to
    compile or launch, gets a row saying why; the others still run."""
    nbytes = bytes_read(cfg)
    n_copies = replicas(nbytes)
    if nbytes * n_copies > MEMORY_FRACTION * _free_bytes():
        return [VariantResult(cfg, "-", "", None, None, None, None, None, None, None,
                              "cache exceeds free memory")]
    dtype = getattr(torch, cfg.dtype)
    scale = cfg.D ** -0.5
    q = torch.randn(cfg.B, cfg.H_q, cfg.D, dtype=dtype, device="cuda")
    caches = [_cache(cfg) for _ in range(n_copies)]
    ref = None
    if cfg.B == 8:  # the reference loops over slots on the host: cheap only for small batches
        ref = da.decode_attention_ref(q, *caches[0], scale, cfg.bits, cfg.group_size).float()

    sdpa_ms = None
    sbytes = sdpa_bytes(cfg)
    sdpa_replicas = replicas(sbytes)
    if sbytes * sdpa_replicas <= MEMORY_FRACTION * _free_bytes():
        sq = q.view(cfg.B, cfg.H_q, 1, cfg.D)
        kvs = [(torch.randn(cfg.B, cfg.H_kv, cfg.sdpa_tokens, cfg.D, dtype=dtype, device="cuda"),
                torch.randn(cfg.B, cfg.H_kv, cfg.sdpa_tokens, cfg.D, dtype=dtype, device="cuda"))
               for _ in range(sdpa_replicas)]
        sdpa_ms = graph_ms([_sdpa_callable(sq, k, v)[0] for k, v in kvs])
        del kvs
        torch.cuda.empty_cache()

    results: List[VariantResult] = []
    first_ms = None
    variants = [("(no quantized path)", None, {})] if cfg.bits == 16 else VARIANTS
    for name, kernel, fields in variants:
        launch = ""
        try:
            plan = _plan(cfg, kernel)._replace(**fields)  # refuses what the kernel cannot run
            launch = _describe(plan)
            calls = [lambda c=c, plan=plan: da._decode_attention_triton(
                q, *c, scale, cfg.bits, cfg.group_size, plan) for c in caches]
            out = calls[0]()  # compile outside any timing
            torch.cuda.synchronize()
        except Exception as err:  # e.g. out of shared memory for this shape: report, go on
            msg = f"{type(err).__name__}: {str(err).splitlines()[0][:100]}"
            results.append(VariantResult(cfg, name, launch, None, None, None, None, None,
                                         sdpa_ms, None, msg))
            continue
        diff = (out.float() - ref).abs().max().item() if ref is not None else None
        ms = graph_ms(calls)
        first_ms = first_ms or ms
        tbps = nbytes / (ms * 1e-3) / 1e12
        results.append(VariantResult(
            cfg, name, launch, ms, tbps, tbps * 1e12 / copy_bps, first_ms / ms,
            ms / sdpa_ms if sdpa_ms else None, sdpa_ms, diff, None))
        print(f"  {cfg.name:<26} {name:<24} {ms:.4f} ms"
              + (f", max |out - ref| {diff:.2e}" if diff is not None else ""), flush=True)
    del caches
    torch.cuda.empty_cache()
    return results


def print_variant_table(results: List[VariantResult], copy_bps: float) -> None:
    print(f"\ndevice-to-device copy: {copy_bps / 1e12:.2f} TB/s (read + write); "
          f"'x first' = the case's first variant's ms / ms")
    header = (f"{'case':<26} {'variant':<22} {'ms':>8} {'TB/s':>6} {'of copy':>7} "
              f"{'x first':>7} {'sdpa ms':>8} {'/sdpa':>6} {'|out-ref|':>9}  launch")
    print(header)
    print("-" * len(header))
    for r in results:
        if r.ms is None:
            print(f"{r.config.name:<26} {r.variant:<22} failed: {r.error}")
            continue
        print(f"{r.config.name:<26} {r.variant:<22} {r.ms:8.4f} {r.tb_per_s:6.2f} "
              f"{r.fraction_of_copy:7.0%} {r.speedup_vs_first:7.2f} "
              f"{_fmt(r.sdpa_ms, '8.4f'):>8} {_fmt(r.ratio_vs_sdpa, '6.3f'):>6} "
              f"{_fmt(r.max_abs_diff_vs_ref, '9.2e'):>9}  {r.launch_config}")


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------


def _fmt(x: Optional[float], spec: str) -> str:
    return format(x, spec) if x is not None else "-"


def print_table(results: List[ExperimentResult], copy_bps: float) -> None:
    print(f"\ndevice-to-device copy: {copy_bps / 1e12:.2f} TB/s (read + write)")
    header = (f"{'case':<28} {'ms':>8} {'eager ms':>8} {'GB read':>8} {'TB/s':>6} {'of copy':>7} "
              f"{'sdpa ctx':>8} {'sdpa ms':>8} {'ratio':>6}")
    print(header)
    print("-" * len(header))
    for r in results:
        c = r.config
        if r.ms is None:
            print(f"{c.name:<28} skipped: {r.skipped}")
            continue
        print(f"{c.name:<28} {r.ms:8.4f} {r.eager_ms:8.4f} {r.bytes_read / 1e9:8.3f} "
              f"{r.tb_per_s:6.2f} {r.fraction_of_copy:7.0%} {c.sdpa_tokens // 1024:7d}k "
              f"{_fmt(r.sdpa_ms, '8.4f'):>8} {_fmt(r.ratio, '6.3f'):>6}"
              + ("  (SDPA on expanded K/V)" if r.sdpa_kv_expanded else ""))


def _shapes(text: str) -> List[Tuple[int, int]]:
    """"8x2048,1x16384" -> [(8, 2048), (1, 16384)]."""
    try:
        return [tuple(int(v) for v in item.lower().split("x")) for item in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BATCHxTOKENS[,...], got {text!r}") from None


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the results as JSON to this path")
    parser.add_argument("--bits", type=int, default=2, choices=(2, 4, 16),
                        help="bits of the batch x length sweep (default 2)")
    parser.add_argument("--tune", action="store_true",
                        help="search launch configurations per row, print the best")
    parser.add_argument("--tune-shapes", type=_shapes, default=None,
                        help="with --tune: BATCHxTOKENS rows to tune instead of the defaults")
    parser.add_argument("--variants", action="store_true",
                        help="time the VARIANTS of the kernel side by side on VARIANT_CASES")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode_attention: needs a CUDA GPU; none found, nothing measured.")
        return 1

    env = row_environment()
    print(f"{env['gpu']}  torch {env['torch']}  triton {env['triton']}  driver {env['driver']}")
    configs = get_configs(args.bits)
    if args.tune:
        rows = ([ExperimentConfig(b, n, args.bits) for b, n in args.tune_shapes]
                if args.tune_shapes else
                configs[:3] + [ExperimentConfig(1, 131072, args.bits),
                               ExperimentConfig(64, 16384, args.bits)])
        for cfg in rows:
            tune(cfg)
            torch.cuda.empty_cache()
        return 0

    copy_bps = copy_bandwidth(torch.device("cuda"))["bytes_per_s"]
    torch.cuda.empty_cache()
    if args.variants:
        variant_results: List[VariantResult] = []
        for cfg in VARIANT_CASES:
            variant_results += run_variants(cfg, copy_bps)
        print_variant_table(variant_results, copy_bps)
        if args.out:
            write_json(args.out, [{**env, "copy_tb_per_s": copy_bps / 1e12,
                                   **dataclasses.asdict(r)} for r in variant_results])
        return 0
    results = []
    for i, cfg in enumerate(configs):
        results.append(run_experiment(cfg, copy_bps, check=i < 3))
        r = results[-1]
        print(f"  {cfg.name}: {_fmt(r.ms, '.4f')} ms, ratio {_fmt(r.ratio, '.3f')}"
              + (f", max |out - ref| {r.max_abs_diff_vs_ref:.2e}"
                 if r.max_abs_diff_vs_ref is not None else ""), flush=True)
    print_table(results, copy_bps)
    if args.out:
        write_json(args.out, [{**env, "copy_tb_per_s": copy_bps / 1e12, **dataclasses.asdict(r)}
                              for r in results])
    return 0


if __name__ == "__main__":
    sys.exit(main())
