"""Where a tensor-parallel decode step's time above its floor goes (GPU, under torchrun).

    torchrun --nproc-per-node N perf/experiments/tp_account.py --out FILE.json \\
        [--shape llama3.1-70b] [--cases 1x32768,8x4096] [--steps 20] [--timed-tokens 32]

``--tiny``: the tiny shape on the CPU over gloo where there is no GPU, its plumbing only (no
bandwidth, no kernels: the figures are not the account's).

Every rank builds its shard of a random-weight model (``bench_tp.sharded_model``). Per case
(batch x prompt):

1. ``real``: the engine as it serves (compiled, captured, the collectives inside the step: the
   one-shot all-reduces, or NCCL's with ``MINIKV_ONE_SHOT=0``, and NCCL's logits gather): ms per
   step as ``bench_tp`` times it (``harness.time_decode``), then ``--steps`` steps of the
   runtime under ``torch.profiler``: kernels per step, the collective kernels' time per step,
   and the GPU's idle time per step (the steps' span less the union of their kernels'
   intervals: what the launches between kernels and any wait for the host cost).
2. ``no_collectives``: the same engine with its all-reduces and logits gather replaced by no-ops
   (``TensorParallel`` subclassed; the logits are this rank's slice, zero-padded): every rank
   runs the same kernels on the same shard with no exchange and no wait for the others, so its
   step is the step without the collectives and their synchronization. Its tokens differ between
   ranks; the work of a step does not depend on them. It compiles afresh, in a compile-cache
   folder of its own (the real engine's saved step would be loaded otherwise).
3. ``collectives_alone``: the step's collectives alone, captured in one CUDA graph
   (``bench_tp.step_collectives_ms``, the floor's second term).

The account (rank 0's figures; every rank's step and NCCL time are in the JSON too):
``floor = bytes / copy bandwidth + collectives alone``, and above it
``compute_over_bytes = no_collectives - bytes term`` (kernels slower than the copy, launches),
``collectives_in_step = real - no_collectives`` against ``collectives alone``: the excess is
what the collectives cost inside the step beyond their own transfer (waiting for the slowest
rank, no overlap with the compute around them). Rank 0 writes ``--out`` (JSON) and the same
path with ``.md`` (the table).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from minikv_compile.models import TensorParallel


class NoCollectives(TensorParallel):
    """A ``TensorParallel`` whose step collectives are no-ops (the admission's eager checks
    stay: every rank is given the same requests). At module level: torch.compile's saved
    package names the classes the step's guards hold, and a class local to a function cannot
    be named (the first GPU run failed on it)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        return F.pad(logits, (0, vocab_size - logits.shape[1]))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _profile_steps(rt, steps: int) -> Dict[str, object]:
    """``steps`` steps of a runtime whose slots are admitted, under ``torch.profiler``: per step
    the kernels, the NCCL kernels and their device time, all kernels' device time, and the idle
    time between them (the span from the first kernel's start to the last one's end, less the
    union of the kernels' intervals), and the 16 kernel names of most device time (a kernel
    launched with programmatic dependent launch counts from its early start)."""
    for _ in range(3):
        rt.step()
    _sync()
    kind = "CUDA" if torch.cuda.is_available() else "CPU"  # (the CPU: no kernels to count)
    with torch.profiler.profile(activities=[getattr(torch.profiler.ProfilerActivity, kind)]
                                ) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            rt.step()
        _sync()
        wall = time.perf_counter() - start
    spans: List[Tuple[float, float]] = []
    kernels = nccl = 0
    nccl_us = total_us = 0.0
    by_name: Dict[str, List[float]] = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        kernels += 1
        total_us += e.device_time_total
        named = by_name.setdefault(e.name[:120], [0, 0.0])
        named[0] += 1
        named[1] += e.device_time_total
        if "nccl" in e.name.lower() or "one_shot_all_reduce" in e.name:  # NCCL's, one-shot's
            nccl += 1
            nccl_us += e.device_time_total
        spans.append((e.time_range.start, e.time_range.end))
    spans.sort()
    busy, end = 0.0, float("-inf")
    for s, e in spans:  # the union of the intervals
        if e > end:
            busy += e - max(s, end)
            end = e
    span = spans[-1][1] - spans[0][0] if spans else 0.0
    return {"kernels_per_step": kernels / steps, "nccl_kernels_per_step": nccl / steps,
            "nccl_ms_per_step": nccl_us / steps / 1e3, "kernel_ms_per_step": total_us / steps / 1e3,
            "busy_ms_per_step": busy / steps / 1e3, "idle_ms_per_step": (span - busy) / steps / 1e3,
            "profiled_wall_ms_per_step": 1e3 * wall / steps,
            "top_kernels": [{"name": n, "per_step": c / steps, "us_per_step": us / steps}
                            for n, (c, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:16]]}


def _measure(model, tp, batch: int, prompt_len: int, summary: dict, args) -> Dict[str, object]:
    """One engine (of the ``TensorParallel`` class in use): ms per step, then its profile."""
    from minikv_compile.graphs.runtime import Request
    from minikv_compile.perf.harness import EngineRunner, make_prompts, time_decode

    runner = EngineRunner(model, "minikv", batch=batch, prompt_len=prompt_len,
                          new_tokens=args.timed_tokens + 1, tensor_parallel=tp.world)
    prompts = make_prompts(batch, prompt_len, summary["vocab"])
    timing = time_decode(runner, prompts, args.warm_tokens, args.timed_tokens)
    rt = runner.engine.runtime
    for slot in range(batch):
        rt.admit(slot, Request(prompts[slot].tolist(), args.timed_tokens + 1))
    prof = _profile_steps(rt, min(args.steps, args.timed_tokens - 4))
    rt.release_all()
    out = {"ms_per_step": timing["ms_per_token"], "setup": runner.setup_info(), **prof}
    runner.close()
    return out


def _every_rank(value) -> list:
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every


def _free() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _markdown(result: dict) -> str:
    lines = [f"# Tensor-parallel step account: {result['shape']} over {result['ranks']} "
             f"{result['env']['device']} (git {result['env']['git']})", "",
             "| case | floor: bytes + collectives alone | step | no collectives | compute over "
             "bytes | collectives in step | over alone | kernels / step (collective) | GPU idle / "
             "step (real / none) |", "|---|---|---|---|---|---|---|---|---|"]
    for c in result["cases"]:
        r, n = c["real"], c["no_collectives"]
        lines.append(
            f"| {c['batch']} x {c['prompt_len']} | {c['bytes_ms']:.2f} + {c['collectives_alone_ms']:.2f}"
            f" = {c['floor_ms']:.2f} | {r['ms_per_step']:.2f} (x{c['x_floor']:.2f}) | "
            f"{n['ms_per_step']:.2f} | {c['compute_over_bytes_ms']:.2f} | "
            f"{c['collectives_in_step_ms']:.2f} | {c['collectives_over_alone_ms']:+.2f} | "
            f"{r['kernels_per_step']:.0f} ({r['nccl_kernels_per_step']:.0f}) | "
            f"{r['idle_ms_per_step']:.2f} / {n['idle_ms_per_step']:.2f} |")
    env = ", ".join(f"{k}={v}" for k, v in sorted(result["nccl_env"].items()))
    lines += ["", f"ms per step, rank 0; all-reduces {result['all_reduce']}; environment: "
              f"{env or 'default'}. Every rank's step and "
              "collective kernel time (NCCL's and one-shot's) per step:", ""]
    for c in result["cases"]:
        lines.append(f"- {c['batch']} x {c['prompt_len']}: real "
                     + ", ".join(f"{m['ms_per_step']:.2f} ({m['nccl_ms_per_step']:.2f} coll.)"
                                 for m in c["real_every_rank"])
                     + "; no collectives "
                     + ", ".join(f"{m['ms_per_step']:.2f}" for m in c["no_collectives_every_rank"]))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from minikv_compile import engine as engine_module
    from minikv_compile.models.parallel import ONE_SHOT_BYTES, join_torchrun
    from minikv_compile.perf.argtypes import shape_list
    from minikv_compile.perf.bench_tp import sharded_model, step_collectives_ms
    from minikv_compile.perf.harness import floor_figures, model_summary
    from minikv_compile.perf.measure import copy_bandwidth, git_info, write_json

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default=None, help="default llama3.1-70b (tiny with --tiny)")
    ap.add_argument("--cases", type=shape_list, default=None,
                    help="BxL comma list (default 1x32768,8x4096; 1x96,2x64 with --tiny)")
    ap.add_argument("--warm-tokens", type=int, default=4)
    ap.add_argument("--timed-tokens", type=int, default=32,
                    help="as bench_tp's run (its saved compiled step is then loaded)")
    ap.add_argument("--steps", type=int, default=20, help="profiled steps")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not (cuda or args.tiny):
        raise SystemExit("tp_account: needs CUDA (--tiny: the plumbing on the CPU)")
    args.shape = args.shape or ("tiny" if args.tiny else "llama3.1-70b")
    args.cases = args.cases or ([(1, 96), (2, 64)] if args.tiny else [(1, 32768), (8, 4096)])
    device = join_torchrun("tp_account", None, cuda, timeout_s=900)
    tp = TensorParallel.from_default_group(dist.get_world_size())
    dtype = torch.bfloat16 if cuda else torch.float32
    bandwidth = copy_bandwidth(device) if cuda else {"bytes_per_s": float("nan")}
    model = sharded_model(args.shape, tp, device, dtype)
    summary = model_summary(model)
    result = {"shape": args.shape, "ranks": tp.world, "bandwidth": bandwidth,
              "all_reduce": (f"one-shot up to {ONE_SHOT_BYTES // 1024} KiB, NCCL above"
                             if tp.one_shot else "NCCL"),
              "nccl_env": {k: v for k, v in os.environ.items()
                           if k.startswith(("NCCL_", "MINIKV_"))},
              "summary_per_rank": summary, "cases": [],
              "env": {"device": torch.cuda.get_device_name(device) if cuda else "cpu",
                      "torch": torch.__version__,
                      "git": os.environ.get("MINIKV_GIT_SHA") or git_info(Path.cwd()).get("sha")}}
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    for batch, prompt_len in args.cases:
        real = _measure(model, tp, batch, prompt_len, summary, args)
        _free()
        engine_module.TensorParallel = NoCollectives
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(cache or "/tmp/torchinductor_tp")
                                                    / "tp_account_no_collectives")
        try:
            none = _measure(model, tp, batch, prompt_len, summary, args)
        finally:
            engine_module.TensorParallel = TensorParallel
            if cache is None:
                del os.environ["TORCHINDUCTOR_CACHE_DIR"]
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        _free()
        alone = step_collectives_ms(tp, batch, summary["hidden"], summary["layers"],
                                    model.lm_head.weight.shape[0], dtype, device)
        floor = floor_figures(model, "minikv", prompt_len, batch, args.timed_tokens // 2, None,
                              None)
        bytes_ms = 1e3 * (floor["weight_bytes_read"] + floor["kv_bytes_read"] // tp.world) \
            / bandwidth["bytes_per_s"]
        case = {"batch": batch, "prompt_len": prompt_len, "real": real, "no_collectives": none,
                "bytes_ms": bytes_ms, "collectives_alone_ms": alone, "floor_ms": bytes_ms + alone,
                "x_floor": real["ms_per_step"] / (bytes_ms + alone),
                "compute_over_bytes_ms": none["ms_per_step"] - bytes_ms,
                "collectives_in_step_ms": real["ms_per_step"] - none["ms_per_step"],
                "collectives_over_alone_ms": real["ms_per_step"] - none["ms_per_step"] - alone,
                "real_every_rank": _every_rank(real),
                "no_collectives_every_rank": _every_rank(none)}
        result["cases"].append(case)
        if tp.rank == 0:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            write_json(args.out, result)
            Path(args.out).with_suffix(".md").write_text(_markdown(result))
            print(_markdown(result), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
