"""Device experiment: admitting N short prompts one by one against in batched (varlen) prefill
passes (``SlotRuntime.admit`` vs ``admit_batch``), on the Llama-3.1-8B shape with random weights.

    python perf/experiments/prefill_batch.py                    # after perf/gpu_check.sh
    python perf/experiments/prefill_batch.py --tiny             # CPU plumbing check

Prompts of random lengths in ``[min_len, max_len]`` (the same for every row), in arrival order;
a batched row groups them as the scheduler does (``Scheduler.prefill_batch_tokens`` and
``prefill_batch_requests``): in order, while their tokens total at most the row's threshold and
the pass holds at most its number of prompts. Each row is timed from the first prompt to
the last first token (synchronized), the median of ``--repeats`` after one warm-up, the rows
alternating; "mean TTFT" is the mean over prompts of the time their pass ends (all arrived
at 0). The one-by-one
row also times each prompt alone and fits ``t(L) = F + c * L``: ``F`` is the fixed cost of a
pass (the weight read and the per-layer launches), what batching shares. On CUDA one more run of
each row goes under ``torch.profiler``: "device ms" is the kernels' busy time (against the wall
time it says how host-bound the eager prefill is) and "kernels" the launches.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import List, Optional

import torch


@dataclass(frozen=True)
class ExperimentConfig:
    label: str                    # "one by one", "<= T tokens, <= P prompts", "all in one pass"
    batch_tokens: int             # a pass's tokens at most (its first prompt whatever its length)
    batch_requests: int           # a pass's prompts at most


@dataclass(frozen=True)
class ExperimentResult:
    label: str
    passes: int
    total_ms: float
    mean_ttft_ms: float
    tokens_per_s: float
    speedup: float                # one by one's total over this row's
    device_ms: Optional[float]    # kernel busy time of one run (CUDA only)
    kernels: Optional[int]        # kernel launches of one run (CUDA only)


def get_configs(thresholds: List[tuple]) -> List[ExperimentConfig]:
    return [ExperimentConfig("one by one", 1, 1)] + [
        ExperimentConfig(f"<= {t} tokens, <= {n} prompts", t, n) for t, n in thresholds] + [
        ExperimentConfig("all in one pass", 1 << 62, 1 << 62)]


def group(lengths: List[int], config: ExperimentConfig) -> List[List[int]]:
    """Indices of the prompts of each pass: in order, while the pass's tokens stay within
    ``batch_tokens`` (the first of a pass whatever its length) and its prompts within
    ``batch_requests``, as the scheduler groups them."""
    passes, tokens = [], 0
    for i, L in enumerate(lengths):
        if (passes and tokens + L <= config.batch_tokens
                and len(passes[-1]) < config.batch_requests):
            passes[-1].append(i)
            tokens += L
        else:
            passes.append([i])
            tokens = L
    return passes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_once(cm, requests, passes: List[List[int]], device: torch.device) -> List[float]:
    """Admit ``requests`` pass by pass (slot i for prompt i), then release them: the seconds
    from the start at which each prompt's pass ended (synchronized)."""
    rt, ends = cm.runtime, []
    _sync(device)
    t0 = time.perf_counter()
    for idx in passes:
        rt.admit_batch(idx, [requests[i] for i in idx])
        _sync(device)
        ends += [time.perf_counter() - t0] * len(idx)
    rt.release_all()
    return ends


def run_experiments(cm, requests, configs: List[ExperimentConfig], repeats: int,
                    device: torch.device) -> List[tuple]:
    """Per config: (total ms, mean ttft ms, passes, device busy ms, kernels). The configs
    alternate within each repeat (a drift of the machine spreads over all of them); the
    profiled runs come last (a profiler session slows every later launch on the host)."""
    plans = [group([len(r.prompt) for r in requests], c) for c in configs]
    ends = [[] for _ in configs]
    for rep in range(repeats + 1):  # the first is the warm-up
        for i, passes in enumerate(plans):
            e = time_once(cm, requests, passes, device)
            if rep:
                ends[i].append(e)
    out = []
    for i, passes in enumerate(plans):
        out.append([statistics.median(e[-1] for e in ends[i]) * 1e3,
                    statistics.median(statistics.fmean(e) for e in ends[i]) * 1e3,
                    len(passes), None, None])
    if device.type == "cuda":
        from minikv_compile.perf.measure import kernel_times

        for row, passes in zip(out, plans):
            us, counts = kernel_times(lambda: time_once(cm, requests, passes, device))
            row[3:] = sum(us.values()) / 1e3, sum(counts.values())
    return [tuple(row) for row in out]


def fit_pass_cost(cm, requests, repeats: int, device: torch.device) -> tuple:
    """Least-squares ``t = F + c * L`` over each prompt prefilled alone -> (F ms, c us/token)."""
    rt, xs, ys = cm.runtime, [], []
    for r in requests:
        times = []
        for rep in range(repeats + 1):
            _sync(device)
            t0 = time.perf_counter()
            rt.admit(0, r)
            _sync(device)
            if rep:
                times.append(time.perf_counter() - t0)
            rt.release(0)
        xs.append(len(r.prompt))
        ys.append(statistics.median(times) * 1e3)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    c = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(
        sum((x - mx) ** 2 for x in xs), 1e-12)
    return my - c * mx, c * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="the tiny shape on the CPU, fp32")
    p.add_argument("--shape", default="llama3.1-8b")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--thresholds", default=None,
                   help="TOKENS:PROMPTS pass limits to compare (default 1024:32,2048:32,"
                        "4096:32,2048:4,2048:8,2048:16; --tiny 64:32,128:32,128:2)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--host-profile", type=int, default=0, metavar="N",
                   help="print the N functions of most host time of the first and last row")
    args = p.parse_args(argv)

    from minikv_compile import MiniKVConfig, minikv_compile
    from minikv_compile.graphs.runtime import Request
    from minikv_compile.perf import harness

    if args.tiny:
        device, dtype, shape = torch.device("cpu"), torch.float32, "tiny"
        args.prompts, args.repeats = min(args.prompts, 6), min(args.repeats, 1)
        args.min_len, args.max_len = min(args.min_len, 16), min(args.max_len, 48)
        env = {"device": "cpu", "torch": torch.__version__}
    else:
        if not torch.cuda.is_available():
            p.error("needs CUDA (or --tiny for the CPU)")
        from minikv_compile.perf.measure import row_environment

        device, dtype, shape = torch.device("cuda"), torch.bfloat16, args.shape
        env = row_environment()
    model = harness.build_model(shape, device, dtype)
    config = MiniKVConfig.preset("snapkv", max_batch_size=args.prompts, max_prompt_len=args.max_len,
                          max_new_tokens=16, compile=False, cuda_graphs=False)
    cm = minikv_compile(model, config)
    rng = random.Random(args.seed)
    vocab = model.config.vocab_size
    requests = [Request([rng.randrange(3, vocab) for _ in range(rng.randint(args.min_len,
                                                                            args.max_len))], 1)
                for _ in range(args.prompts)]
    n_tokens = sum(len(r.prompt) for r in requests)
    print(f"{shape} {dtype} on {env.get('gpu') or env.get('device')}: {args.prompts} prompts of "
          f"{args.min_len}..{args.max_len} tokens, {n_tokens} in all; "
          f"{', '.join(f'{k} {v}' for k, v in env.items() if k not in ('gpu', 'device'))}")
    fixed_ms, per_token_us = fit_pass_cost(cm, requests, args.repeats, device)
    print(f"one prompt alone: t(L) = {fixed_ms:.2f} ms + {per_token_us:.2f} us x L "
          f"(the fixed cost is worth {fixed_ms * 1e3 / max(per_token_us, 1e-9):.0f} tokens)")
    spec = args.thresholds or ("64:32,128:32,128:2" if args.tiny else
                               "1024:32,2048:32,4096:32,2048:4,2048:8,2048:16")
    thresholds = [tuple(int(x) for x in t.split(":")) for t in spec.split(",") if t]
    configs = get_configs(thresholds)
    rows = run_experiments(cm, requests, configs, args.repeats, device)
    base = rows[0][0]
    results = [ExperimentResult(c.label, passes, total, ttft, n_tokens / total * 1e3,
                                base / total, busy, launches)
               for c, (total, ttft, passes, busy, launches) in zip(configs, rows)]
    print(f"{'grouping':>30} {'passes':>6} {'total ms':>9} {'mean TTFT ms':>12} "
          f"{'tokens/s':>10} {'speedup':>7} {'device ms':>9} {'kernels':>7}")
    for r in results:
        busy = "-" if r.device_ms is None else f"{r.device_ms:.1f}"
        print(f"{r.label:>30} {r.passes:>6} {r.total_ms:>9.1f} {r.mean_ttft_ms:>12.1f} "
              f"{r.tokens_per_s:>10.0f} {r.speedup:>6.2f}x {busy:>9} {r.kernels or '-':>7}")
    if args.host_profile:
        import cProfile
        import pstats

        for c in (configs[0], configs[-1]):
            passes = group([len(r.prompt) for r in requests], c)
            prof = cProfile.Profile()
            prof.runcall(time_once, cm, requests, passes, device)
            print(f"-- host time, {c.label}")
            pstats.Stats(prof).sort_stats("tottime").print_stats(args.host_profile)
    print({"results": [asdict(r) for r in results], "fixed_ms": fixed_ms,
           "per_token_us": per_token_us, **env})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
