"""``python -m minikv_compile.perf.accuracy``: the command line (see the package docstring)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional, Sequence

import torch

from .methods import MAIN_METHODS, METHODS, QUICK_METHODS, SELECTIONS, sweep_methods
from .reporting import plot
from .running import MODES, NotComparable, Run, _dtype, load_subject, run_agreement
from .tasks import PLANS, TASKS, build_samples

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "results" / "accuracy"

# -- command line ---------------------------------------------------------------------------------


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m minikv_compile.perf.accuracy",
                                description=__doc__.split("\n\n")[0])
    part = p.add_mutually_exclusive_group()
    part.add_argument("--sweep", action="store_true", help="MiniKV over kept budgets at 2 and 4 bits")
    part.add_argument("--quick", action="store_true", help="a handful of short samples (CPU, minutes)")
    part.add_argument("--agreement", action="store_true", help="compiled CUDA engine against the CPU engine")
    part.add_argument("--plot-only", action="store_true", help="redraw the PNG from the JSON in --out")
    p.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                   help="default: bf16 on CUDA, fp32 on the CPU")
    p.add_argument("--methods", default=None, help="comma-separated names of METHODS (main/quick)")
    p.add_argument("--sweep-selections", default="h2o,snapkv_block",
                   help=f"selection recipes swept over budgets (--sweep), from {sorted(SELECTIONS)}")
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--mode", choices=(*MODES, "both"), default="question-last",
                   help="question-last: the whole prompt compressed at once; context-first: its "
                        "document cached (cache_prompt) before the question, the question prefilled "
                        "through the cache; both: each unit in both, paired")
    p.add_argument("--needle-lengths", default=None,
                   help="comma-separated needle prompt lengths in tokens (default: the part's)")
    p.add_argument("--ppl-prefix", type=int, default=None,
                   help="perplexity prompt tokens (default: the part's)")
    p.add_argument("--ppl-continuation", type=int, default=None,
                   help="perplexity tokens teacher-forced after the prompt (default: the part's)")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step (CUDA)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="run the decode step eagerly")
    p.add_argument("--budget-seconds", type=float, default=None,
                   help="start no unit of work (method x task x prompt length) that the same unit of "
                        "the previous method says would end past this many seconds (counted after "
                        "loading the model and building the samples, ~20 s)")
    p.add_argument("--needle-per-cell", type=int, default=None)
    p.add_argument("--ppl-docs", type=int, default=None)
    p.add_argument("--code-samples", type=int, default=None)
    p.add_argument("--hf-check", type=int, default=None, help="samples per task checked against HF")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: 1 for --quick on the CPU, else torch's own)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--extend", action="store_true",
                   help="go on from the part's JSON in --out (same model, samples, settings, device, "
                        "versions and commit): its units are kept; its methods' missing units and "
                        "those of --methods run")
    p.add_argument("--merge", action="append", default=[], metavar="JSON",
                   help="a run of the same part made beside this one (another GPU of the host, "
                        "its own --out; comparable as for --extend): its units join this run's "
                        "before it runs what is still missing (repeatable)")
    p.add_argument("--out", default=None, help=f"results folder (default {DEFAULT_OUT}, or a quick-* "
                                                 "subfolder for --quick / --model tiny)")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.out is None:  # the committed results are SmolLM2's main and sweep parts
        sub = "tiny" if args.model == "tiny" else "quick-smollm2" if args.quick else ""
        args.out = str(DEFAULT_OUT / sub) if sub else str(DEFAULT_OUT)
    if args.plot_only:
        path = plot(Path(args.out))
        print(path or "no plot written")
        return 0 if path else 1
    if args.agreement:
        return run_agreement(args, argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = _dtype(args.dtype, device)
    part = "sweep" if args.sweep else "quick" if args.quick else "main"
    plan = PLANS[part]
    overrides = {k: v for k, v in (("needle_per_cell", args.needle_per_cell), ("ppl_docs", args.ppl_docs),
                                   ("code_samples", args.code_samples), ("hf_check", args.hf_check))
                 if v is not None}
    if args.needle_lengths:
        try:
            overrides["needle_lengths"] = tuple(int(x) for x in args.needle_lengths.split(",") if x)
        except ValueError:
            raise SystemExit(f"--needle-lengths: expected comma-separated integers, got "
                             f"{args.needle_lengths!r}")
    if args.ppl_prefix is not None:
        overrides["ppl_prefix"] = args.ppl_prefix
    if args.ppl_continuation is not None:
        overrides["ppl_continuation"] = args.ppl_continuation
    plan = replace(plan, **overrides)
    if args.sweep:
        try:
            methods = sweep_methods([s for s in args.sweep_selections.split(",") if s])
        except ValueError as e:
            raise SystemExit(f"--sweep-selections: {e}")
    else:
        names = args.methods.split(",") if args.methods else (QUICK_METHODS if args.quick else MAIN_METHODS)
        unknown = [n for n in names if n not in METHODS]
        if unknown:
            raise SystemExit(f"--methods: unknown {unknown}; expected names from {sorted(METHODS)}")
        methods = [METHODS[n] for n in names]
    tasks = [t for t in args.tasks.split(",") if t]
    if any(t not in TASKS for t in tasks):
        raise SystemExit(f"--tasks: expected names from {TASKS}, got {tasks}")
    on_cuda = device.type == "cuda"
    compile_ = bool(args.compile) and on_cuda
    graphs = on_cuda and not args.no_cuda_graphs
    torch.manual_seed(args.seed)
    # The quick run is mostly one-token decode steps of small ops. On a 2-core machine that other
    # processes also use, two OpenMP threads wait on each other at every op: measured 8.8 min
    # against 2.0 min with one thread (load average 4); unloaded, one thread loses little.
    threads = args.threads or (1 if args.quick and device.type == "cpu" else None)
    previous_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _run_part(args, argv, part, plan, methods, tasks, device, dtype, compile_, graphs)
    finally:
        torch.set_num_threads(previous_threads)


def _run_part(args, argv, part, plan, methods, tasks, device, dtype, compile_, graphs) -> int:
    t0 = time.perf_counter()
    subject = load_subject(args.model, device, dtype)
    samples = build_samples(subject.codec, subject.corpora, plan, tasks, args.seed)
    print(f"accuracy {part}: {subject.name} {dtype} on {device}, {len(methods)} methods, "
          + ", ".join(f"{t} {len(s)}" for t, s in samples.items())
          + f" samples (setup {time.perf_counter() - t0:.0f}s) -> {args.out}", flush=True)
    previous = None
    if args.extend:
        path = Path(args.out) / f"{part}.json"
        if not path.is_file():
            raise SystemExit(f"--extend: expected an earlier run's {path}, found none")
        previous = json.loads(path.read_text())
    merged = []
    for path in map(Path, args.merge):
        if not path.is_file():
            raise SystemExit(f"--merge: expected a run's JSON, found no file {path}")
        try:
            merged.append((str(path), json.loads(path.read_text())))
        except json.JSONDecodeError as e:
            raise SystemExit(f"--merge: expected a run's JSON in {path}, got unreadable JSON ({e})")
    try:
        run = Run(part, subject, plan, methods, samples, Path(args.out), device, dtype, compile_,
                  graphs, args.budget_seconds, argv, previous,
                  modes=MODES if args.mode == "both" else (args.mode,), merged=merged)
    except NotComparable as e:
        raise SystemExit(str(e))
    run.run()
    check = run.data.get("hf_check")
    if check is not None and not check["passed"] and check["exact"]:
        print("accuracy: the full cache does not reproduce the unwrapped model exactly", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
