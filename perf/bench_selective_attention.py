"""Benchmark selective_attention (attention + per-key scores) against the fastest SDPA.

    python -m minikv_compile.perf.bench_selective_attention [--out results.json]
    python -m minikv_compile.perf.bench_selective_attention --tune [--out tune.json]

Both sides run causal prefill attention on the same bf16 q/k/v. The baseline is the fastest
SDPA a user can get: SDPA is timed under its default backend selection (no context manager)
and pinned to each of cuDNN attention, FlashAttention and memory-efficient attention, always
with ``enable_gqa=True`` so it reads the un-expanded KV heads exactly like our kernel. A backend
that refuses GQA is retried on K/V expanded to H_q heads *outside* the timed region (listed in
``sdpa_kv_expanded``); one that refuses both records ``"error: ..."``. ``ratio`` divides our
time by the fastest backend's (``baseline_backend``); every backend's time is in
``sdpa_backends``. ``default_backend_choice`` is what SDPA's default selection picks for these
inputs. SDPA's causal-prefill times from an earlier measurement on one H200 (torch 2.11: 0.89 ms
at 8k, 12.86 ms at 32k) are printed as a reference column (``anchor_sdpa_ms``): they come from
another run, so compare ratios only within one run.

Reported per shape: median milliseconds (``triton.testing.do_bench``, L2 flushed before each
call), the ratio to the fastest SDPA, the achieved TFLOP/s (causal FLOPs: SDPA does q k^T and
P v, 4 * B * H_q * D * L * (L + 1) / 2; selective attention additionally recomputes q k^T in its
score pass, 6 * ... / 2), and the peak memory each call allocates beyond its inputs, total and
beyond its returned ``out``. Our two launches are also timed apart: ``pass1_ms`` (forward +
log-sum-exp, forward FLOPs) and ``pass2_ms`` (scores from q, k and pass 1's log-sum-exp, q k^T
FLOPs). The first call (Triton compilation) is timed apart.

Targets (H100/H200): ratio <= 2.0 at 8k and 32k, extra memory beyond out < 16 MiB at 32k.

``--tune`` times each pass separately over a grid (BLOCK_M in {64, 128}, BLOCK_N in
{32, 64, 128}, num_warps in {4, 8}, num_stages in {2, 3, 4}; pass 2 also tries 256-key
blocks) at each length of ``--tune-lengths`` for the head dims of ``--tune-dims``, and prints
the best config of each pass at each length plus the one with the best geometric mean over the
lengths, as ``_PassConfig`` lines to paste into ``ops/attention_prefill.py``. Every config is
compiled first by ``--tune-jobs`` worker processes (filling Triton's on-disk cache), then
checked against the default config's results and timed; the search stops starting configs once
``--tune-budget-s`` is spent.
"""
import argparse
import dataclasses
import importlib
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from minikv_compile.ops import attention_prefill as sa
from minikv_compile.perf.measure import median_ms, row_environment, write_json


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
    sdpa_ms: float                  # the fastest SDPA backend's time
    ratio: float                    # ms / sdpa_ms
    tflops: float
    sdpa_tflops: float
    extra_mib: float
    extra_beyond_out_mib: float
    sdpa_extra_mib: float           # of the fastest backend
    sdpa_extra_beyond_out_mib: float
    first_call_s: float
    max_abs_diff_vs_sdpa: float     # against the fastest backend
    kv_expanded: bool               # whether the fastest backend ran on expanded K/V
    pass1_ms: float                 # our forward + LSE launch alone
    pass2_ms: float                 # our score launch alone
    pass1_tflops: float             # forward FLOPs (q k^T, P v) / pass1_ms
    pass2_tflops: float             # q k^T FLOPs / pass2_ms
    baseline_backend: str           # name of the fastest SDPA backend ("none" if all failed)
    sdpa_backends: Dict[str, Union[float, str]] = field(default_factory=dict)
    sdpa_kv_expanded: List[str] = field(default_factory=list)
    sdpa_max_abs_diff: Dict[str, float] = field(default_factory=dict)
    default_backend_choice: str = "unknown"
    anchor_sdpa_ms: Optional[float] = None
    # (block_m, block_n, num_warps, num_stages) each of our passes ran with
    pass1_config: Tuple[int, ...] = ()
    pass2_config: Tuple[int, ...] = ()


# SDPA causal prefill measured before this benchmark existed (one H200, torch 2.11.0+cu130, B=1,
# 32 q / 8 KV heads, D=128, bf16), keyed by (L, H_q, H_kv, D, B).
ANCHOR_SDPA_MS = {(8192, 32, 8, 128, 1): 0.89, (32768, 32, 8, 128, 1): 12.86}

# name -> torch.nn.attention.SDPBackend member name (None: SDPA's default selection).
SDPA_BACKENDS = {
    "default": None,
    "cudnn": "CUDNN_ATTENTION",
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
}


def get_configs() -> List[ExperimentConfig]:
    # Llama-3-8B attention shape at four lengths; SmolLM2-135M's (9 q / 3 KV heads, D = 64).
    llama = [ExperimentConfig(L, 32, 8, 128) for L in (1024, 4096, 8192, 32768)]
    smol = [ExperimentConfig(L, 9, 3, 64) for L in (4096, 8192)]
    return llama + smol


def causal_flops(cfg: ExperimentConfig, matmuls: int) -> float:
    """FLOPs of ``matmuls`` causal (L x L lower triangle) x D matmuls over all query heads."""
    return 2.0 * matmuls * cfg.B * cfg.H_q * cfg.D * cfg.L * (cfg.L + 1) / 2


def _inputs(cfg: ExperimentConfig, device: str = "cuda"
            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dtype = getattr(torch, cfg.dtype)
    q = torch.randn(cfg.B, cfg.H_q, cfg.L, cfg.D, dtype=dtype, device=device)
    k = torch.randn(cfg.B, cfg.H_kv, cfg.L, cfg.D, dtype=dtype, device=device)
    v = torch.randn(cfg.B, cfg.H_kv, cfg.L, cfg.D, dtype=dtype, device=device)
    return q, k, v


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


# ---------------------------------------------------------------------------------------------
# SDPA baselines
# ---------------------------------------------------------------------------------------------

def _first_line(text: str, limit: int = 160) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return (lines[0] if lines else "")[:limit]


def _sdpa_call(q, k, v, backend: Optional[str], gqa: bool) -> torch.Tensor:
    if backend is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(getattr(SDPBackend, backend)):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)


def _try_sdpa(q, k, v, backend: Optional[str], gqa: bool) -> Optional[str]:
    """None if SDPA runs with these settings, else why not (error plus SDPA's reasons)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            _sdpa_call(q, k, v, backend, gqa)
            torch.cuda.synchronize()
            return None
        except Exception as err:  # "No available kernel", unsupported arch / dtype, ...
            reasons = "; ".join(_first_line(w.message, 120) for w in caught[:3])
            message = f"{type(err).__name__}: {_first_line(err)}"
            return message + (f" ({reasons})" if reasons else "")


def _sdpa_callables(q, k, v) -> Dict[str, Union[Tuple[Callable[[], torch.Tensor], bool], str]]:
    """Per backend name: (call, whether K/V were expanded beforehand), or an ``error: ...`` str.

    enable_gqa=True first; if refused, K/V expanded to H_q heads (once, outside any timing).
    """
    group = q.shape[1] // k.shape[1]
    expanded: List[torch.Tensor] = []
    calls: Dict[str, Union[Tuple[Callable[[], torch.Tensor], bool], str]] = {}
    for name, backend in SDPA_BACKENDS.items():
        err_gqa = _try_sdpa(q, k, v, backend, True)
        if err_gqa is None:
            calls[name] = ((lambda b=backend: _sdpa_call(q, k, v, b, True)), False)
            continue
        if not expanded:
            expanded += [k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)]
        ke, ve = expanded
        err_exp = _try_sdpa(q, ke, ve, backend, False)
        if err_exp is None:
            calls[name] = ((lambda b=backend: _sdpa_call(q, ke, ve, b, False)), True)
        else:
            calls[name] = f"error: enable_gqa: {err_gqa} | expanded K/V: {err_exp}"
    return calls


def _default_backend_choice(q, k, v) -> str:
    """The backend SDPA's default selection picks for these inputs (private torch API)."""
    try:
        from torch.nn.attention import SDPBackend

        choice = torch._fused_sdp_choice(q, k, v, None, 0.0, True, scale=None, enable_gqa=True)
        return SDPBackend(choice).name.lower()
    except Exception as err:
        return f"unknown ({type(err).__name__})"


# ---------------------------------------------------------------------------------------------
# One shape
# ---------------------------------------------------------------------------------------------

def run_experiment(cfg: ExperimentConfig) -> ExperimentResult:
    from minikv_compile.ops import selective_attention

    q, k, v = _inputs(cfg)
    scale = 1 / math.sqrt(cfg.D)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out, _ = selective_attention(q, k, v)
    torch.cuda.synchronize()
    first_call_s = time.perf_counter() - start

    ms = median_ms(lambda: selective_attention(q, k, v))
    # Each launch alone: pass 1 through the launcher's fwd_only flag; pass 2 on pass 1's LSE.
    fwd_config, scores_config = sa._default_configs(cfg.D, q.device, cfg.L)
    pass1_ms = median_ms(lambda: sa._selective_attention_triton(q, k, v, scale, fwd_only=True))
    _, lse = sa._selective_attention_triton(q, k, v, scale, fwd_only=True)
    qk_scale = scale * sa._LOG2E
    pass2_ms = median_ms(lambda: sa._launch_scores(q, k, lse, qk_scale, scores_config))
    extra, extra_beyond_out = _peak_extra_bytes(lambda: selective_attention(q, k, v)[0])

    backends: Dict[str, Union[float, str]] = {}
    diffs: Dict[str, float] = {}
    expanded_names: List[str] = []
    timed = {}
    for name, entry in _sdpa_callables(q, k, v).items():
        if isinstance(entry, str):
            backends[name] = entry
            continue
        call, was_expanded = entry
        diffs[name] = (out.float() - call().float()).abs().max().item()
        backends[name] = median_ms(call)
        timed[name] = (call, was_expanded)
        if was_expanded:
            expanded_names.append(name)
    del out

    mib = 2.0**20
    nan = float("nan")
    if timed:
        baseline = min(timed, key=lambda name: backends[name])
        sdpa_ms = backends[baseline]
        sdpa_call, kv_expanded = timed[baseline]
        sdpa_extra, sdpa_extra_beyond_out = _peak_extra_bytes(sdpa_call)
    else:
        baseline, sdpa_ms, kv_expanded, sdpa_extra, sdpa_extra_beyond_out = "none", nan, False, 0, 0
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
        max_abs_diff_vs_sdpa=diffs.get(baseline, nan),
        kv_expanded=kv_expanded,
        pass1_ms=pass1_ms,
        pass2_ms=pass2_ms,
        pass1_tflops=causal_flops(cfg, 2) / pass1_ms * 1e-9,
        pass2_tflops=causal_flops(cfg, 1) / pass2_ms * 1e-9,
        baseline_backend=baseline,
        sdpa_backends=backends,
        sdpa_kv_expanded=expanded_names,
        sdpa_max_abs_diff=diffs,
        default_backend_choice=_default_backend_choice(q, k, v),
        anchor_sdpa_ms=ANCHOR_SDPA_MS.get((cfg.L, cfg.H_q, cfg.H_kv, cfg.D, cfg.B)),
        pass1_config=dataclasses.astuple(fwd_config),
        pass2_config=dataclasses.astuple(scores_config),
    )


# ---------------------------------------------------------------------------------------------
# --tune
# ---------------------------------------------------------------------------------------------

# (block_m, block_n, num_warps, num_stages). Pass 1 needs block_m % block_n == 0.
PASS1_GRID = [
    (bm, bn, w, s)
    for bm in (64, 128) for bn in (32, 64, 128) if bm % bn == 0
    for w in (4, 8) for s in (2, 3, 4)
]
# Pass 2 holds block_n keys per program; 256-key blocks halve the q traffic per FLOP.
PASS2_GRID = [
    (bm, bn, w, s) for bm in (64, 128) for bn in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)
] + [(64, 256, 8, s) for s in (2, 3)]
TUNE_SHAPES = {128: (32, 8), 64: (9, 3)}  # D -> (H_q, H_kv): Llama-3-8B, SmolLM2-135M
PRECOMPILE_L = 512


def _grid_configs(grid):
    return [sa._PassConfig(*entry) for entry in grid]


def _run_pass(which: str, q, k, v, lse, scale: float, config):
    """One launch of pass ``which`` ("fwd": returns (out, lse); "scores": returns scores)."""
    if which == "fwd":
        return sa._selective_attention_triton(q, k, v, scale, fwd_config=config, fwd_only=True)
    return sa._launch_scores(q, k, lse, scale * sa._LOG2E, config)


def _precompile_worker(task) -> List[Tuple[str, int, tuple, Optional[str]]]:
    """Spawned process: compile (and launch once on tiny inputs) a share of the configs.

    Fills Triton's on-disk cache, so the parent process only loads the binaries. A config that
    cannot launch (e.g. OutOfResources: shared memory) is reported with its error.
    """
    items, = task
    torch.cuda.init()
    inputs = {}
    results = []
    for which, D, entry in items:
        if D not in inputs:
            H_q, H_kv = TUNE_SHAPES[D]
            q, k, v = _inputs(ExperimentConfig(PRECOMPILE_L, H_q, H_kv, D))
            scale = 1 / math.sqrt(D)
            _, lse = sa._selective_attention_triton(q, k, v, scale, fwd_only=True)
            inputs[D] = (q, k, v, lse, scale)
        q, k, v, lse, scale = inputs[D]
        try:
            _run_pass(which, q, k, v, lse, scale, sa._PassConfig(*entry))
            torch.cuda.synchronize()
            results.append((which, D, entry, None))
        except Exception as err:
            results.append((which, D, entry, f"{type(err).__name__}: {_first_line(err, 100)}"))
    return results


def _precompile(tasks: List[Tuple[str, int, tuple]], jobs: int) -> Dict[tuple, str]:
    """Compile every (pass, D, config) in ``jobs`` processes; returns {task: error} of failures.

    On any trouble with the worker pool the parent simply compiles on first use. A config that
    failed in a worker is still tried by the parent (an error in a worker can poison the rest
    of its share), which skips it if it fails there too.
    """
    if jobs <= 0 or not tasks:
        return {}
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    jobs = min(jobs, len(tasks))
    # Round-robin shares: heavy and light configs spread evenly over the workers.
    shares = [tasks[i::jobs] for i in range(jobs)]
    start = time.perf_counter()
    failures: Dict[tuple, str] = {}
    # Through the module's import name, not __main__, so spawned workers can unpickle it.
    worker = importlib.import_module(__spec__.name if __spec__ else __name__)._precompile_worker
    try:
        with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as pool:
            for results in pool.map(worker, [(share,) for share in shares]):
                for which, D, entry, error in results:
                    if error is not None:
                        failures[(which, D, entry)] = error
    except Exception as err:
        print(f"  precompile pool failed ({type(err).__name__}: {_first_line(err)}); "
              "compiling in this process instead")
        return {}
    print(f"  precompiled {len(tasks)} kernels in {jobs} processes: "
          f"{time.perf_counter() - start:.0f} s, {len(failures)} cannot launch")
    return failures


def _geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(x) for x in values) / len(values))


def _tune_pass(which: str, D: int, lengths: Sequence[int], grid, deadline: float) -> dict:
    """Time every config of ``grid`` for pass ``which`` at each length; returns a summary."""
    H_q, H_kv = TUNE_SHAPES[D]
    fwd_default, scores_default = sa._default_configs(D, torch.device("cuda"))
    default = fwd_default if which == "fwd" else scores_default
    scale = 1 / math.sqrt(D)
    data = {}
    for L in lengths:
        q, k, v = _inputs(ExperimentConfig(L, H_q, H_kv, D))
        out_ref, lse = sa._selective_attention_triton(q, k, v, scale, fwd_only=True)
        scores_ref = sa._launch_scores(q, k, lse, scale * sa._LOG2E, scores_default)
        data[L] = (q, k, v, lse, out_ref, scores_ref)

    # The default first, so it is timed (and compared against) even if the budget runs out.
    configs = [default] + [c for c in _grid_configs(grid) if c != default]
    times: Dict[tuple, Dict[int, float]] = {}
    skipped = []
    for config in configs:
        entry = dataclasses.astuple(config)
        if time.perf_counter() > deadline:
            skipped.append(entry)
            continue
        row = {}
        for L, (q, k, v, lse, out_ref, scores_ref) in data.items():
            try:
                result = _run_pass(which, q, k, v, lse, scale, config)
                torch.cuda.synchronize()
            except Exception as err:
                print(f"  {which} {entry}: skip, {type(err).__name__}: {_first_line(err, 100)}")
                break
            # Same math in another tile order: out to bf16 rounding, LSE and scores closely.
            if which == "fwd":
                ok = (torch.allclose(result[0].float(), out_ref.float(), rtol=2e-2, atol=2e-2)
                      and torch.allclose(result[1], lse, rtol=1e-4, atol=1e-3))
            else:
                ok = torch.allclose(result, scores_ref, rtol=1e-3, atol=1e-5)
            if not ok:
                print(f"  {which} {entry}: skip, results differ from the default config's")
                break
            row[L] = median_ms(lambda: _run_pass(which, q, k, v, lse, scale, config),
                                warmup=5, rep=30)
        else:
            times[entry] = row
            print(f"  {which} {entry}: " + "  ".join(f"L={L}: {ms:.3f}" for L, ms in row.items()),
                  flush=True)
    del data
    torch.cuda.empty_cache()
    if skipped:
        print(f"  {which}: budget spent, {len(skipped)} configs not timed: {skipped}")
    if not times:
        return {"pass": which, "D": D, "times": {}, "skipped": skipped}

    best_per_length = {}
    for L in lengths:
        entry = min(times, key=lambda e: times[e][L])
        best_per_length[L] = (entry, times[entry][L])
    # One config for all lengths: best geometric mean of (time / best time at that length).
    overall = min(times, key=lambda e: _geomean([times[e][L] / best_per_length[L][1]
                                                 for L in lengths]))
    default_entry = dataclasses.astuple(default)
    return {
        "pass": which,
        "D": D,
        "default": default_entry,
        "times": {str(e): {str(L): ms for L, ms in row.items()} for e, row in times.items()},
        "best_per_length": {str(L): {"config": e, "ms": ms}
                            for L, (e, ms) in best_per_length.items()},
        "best_overall": overall,
        "best_overall_ms": {str(L): times[overall][L] for L in lengths},
        "default_ms": {str(L): times[default_entry][L] for L in lengths}
        if default_entry in times else {},
        "skipped": skipped,
    }


def _print_tune_summary(summary: dict) -> None:
    which, D = summary["pass"], summary["D"]
    if not summary["times"]:
        print(f"\npass {which} D={D}: nothing timed")
        return
    label = "pass 1 (forward + LSE)" if which == "fwd" else "pass 2 (scores)"
    print(f"\n{label}, D={D}, default {summary['default']} "
          "(block_m, block_n, num_warps, num_stages):")
    for L, best in summary["best_per_length"].items():
        default_ms = summary["default_ms"].get(L)
        vs = f" (default {default_ms:.3f} ms)" if default_ms is not None else ""
        print(f"  best at L={L}: {best['config']}  {best['ms']:.3f} ms{vs}")
    overall = summary["best_overall"]
    ms = "  ".join(f"L={L}: {t:.3f}" for L, t in summary["best_overall_ms"].items())
    table = "_GPU_FWD_CONFIGS" if which == "fwd" else "_GPU_SCORES_CONFIGS"
    print(f"  best over all lengths: {overall}  {ms}")
    print(f"  paste: {table}[{D}] = _PassConfig{tuple(overall)}")


def tune(dims: Sequence[int], lengths: Sequence[int], budget_s: float, jobs: int) -> List[dict]:
    start = time.perf_counter()
    deadline = start + budget_s
    grids = {"fwd": PASS1_GRID, "scores": PASS2_GRID}
    tasks = [(which, D, entry) for D in dims for which, grid in grids.items() for entry in grid]
    print(f"tuning D in {list(dims)} at L in {list(lengths)}: {len(tasks)} kernels, "
          f"budget {budget_s:.0f} s")
    # Failures are only reported: every config is tried again (and skipped if it fails) below.
    for (which, D, entry), error in sorted(_precompile(tasks, jobs).items()):
        print(f"  precompile {which} D={D} {entry}: {error}")
    summaries = []
    for D in dims:
        # The longest lengths cost the most per config; SmolLM2's shape is tuned at <= 8k.
        dim_lengths = [L for L in lengths if D == 128 or L <= 8192] or list(lengths)[:1]
        for which in ("fwd", "scores"):
            print(f"\n{which}, D={D}, H={TUNE_SHAPES[D]}, L in {dim_lengths} "
                  f"({time.perf_counter() - start:.0f} s so far)")
            summaries.append(_tune_pass(which, D, dim_lengths, grids[which], deadline))
    print(f"\n==== tune summary ({time.perf_counter() - start:.0f} s) ====")
    for summary in summaries:
        _print_tune_summary(summary)
    return summaries


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------

def print_table(results: List[ExperimentResult]) -> None:
    header = (
        f"{'shape':<30} {'ms':>8} {'pass1':>7} {'pass2':>7} {'sdpa ms':>8} {'baseline':>9} "
        f"{'ratio':>6} {'anchor':>7} {'TFLOP/s':>8} {'p1 TF/s':>8} {'p2 TF/s':>8} "
        f"{'sdpa TF/s':>9} {'beyond out':>10} {'sdpa MiB':>9} {'1st call s':>10}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        anchor = f"{r.anchor_sdpa_ms:7.2f}" if r.anchor_sdpa_ms is not None else f"{'-':>7}"
        print(
            f"{r.config.name:<30} {r.ms:8.3f} {r.pass1_ms:7.3f} {r.pass2_ms:7.3f} "
            f"{r.sdpa_ms:8.3f} {r.baseline_backend:>9} {r.ratio:6.2f} {anchor} {r.tflops:8.1f} "
            f"{r.pass1_tflops:8.1f} {r.pass2_tflops:8.1f} {r.sdpa_tflops:9.1f} "
            f"{r.extra_beyond_out_mib:10.1f} {r.sdpa_extra_mib:9.1f} {r.first_call_s:10.2f}"
            + ("  (SDPA on expanded K/V)" if r.kv_expanded else "")
        )
    print("\nSDPA by backend (ms; * = K/V expanded outside the timed region; "
          "anchor = an earlier H200 run):")
    names = list(SDPA_BACKENDS)
    print(f"{'shape':<30} " + " ".join(f"{n:>10}" for n in names) + f" {'picks':>16} {'anchor':>7}")
    errors = []
    for r in results:
        cells = []
        for name in names:
            value = r.sdpa_backends.get(name, "error: not run")
            if isinstance(value, str):
                cells.append(f"{'error':>10}")
                errors.append(f"  {r.config.name} {name}: {value}")
            else:
                star = "*" if name in r.sdpa_kv_expanded else ""
                cells.append(f"{value:>9.3f}{star or ' '}")
        anchor = f"{r.anchor_sdpa_ms:7.2f}" if r.anchor_sdpa_ms is not None else f"{'-':>7}"
        print(f"{r.config.name:<30} " + " ".join(cells)
              + f" {r.default_backend_choice:>16} {anchor}")
    if errors:
        print("backend errors:")
        print("\n".join(errors))


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the results (or the tune summary) as JSON here")
    parser.add_argument("--tune", action="store_true",
                        help="time each pass over a grid of block configs, print the best")
    parser.add_argument("--tune-dims", type=int, nargs="+", default=[128, 64],
                        choices=sorted(TUNE_SHAPES), help="head dims to tune (default 128 64)")
    parser.add_argument("--tune-lengths", type=int, nargs="+", default=[4096, 8192, 32768],
                        help="lengths to time each config at (D=64 uses those <= 8192)")
    parser.add_argument("--tune-budget-s", type=float, default=170.0,
                        help="stop starting new configs after this many seconds (default 170)")
    parser.add_argument("--tune-jobs", type=int, default=min(12, os.cpu_count() or 1),
                        help="processes compiling the configs up front (0: compile on first use)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_selective_attention: needs a CUDA GPU; none found, nothing measured.")
        return 1

    env = row_environment()
    print(f"{env['gpu']}  torch {env['torch']}  triton {env['triton']}  driver {env['driver']}"
          f"  git {env['git_sha']}")
    if args.tune:
        summaries = tune(args.tune_dims, args.tune_lengths, args.tune_budget_s, args.tune_jobs)
        if args.out:
            write_json(args.out, {**env, "tune": summaries})
        return 0

    results = []
    for cfg in get_configs():
        results.append(run_experiment(cfg))
        torch.cuda.empty_cache()
    print_table(results)
    if args.out:
        write_json(args.out, [{**env, **dataclasses.asdict(r)} for r in results])
    return 0


if __name__ == "__main__":
    sys.exit(main())
