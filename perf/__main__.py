"""``python -m minikv_compile.perf <command> --out DIR``: evidence for adopting the engine.

Commands (``--help`` on each for its options; ``perf/README.md`` for what each measures):

    engine-vs-hf   decode ms/token of MiniKV vs HF StaticCache against the bandwidth floor
    latency        streamed TTFT and ms/token over context (batch 1) and over batch size
    throughput     decode tokens/s up to the largest batch that fits each method
    max-prompt     longest batch-1 prompt per method under a memory cap (binary search)
    prefill        prefill time and peak memory against prompt length
    memory-claim   the paper's 2.4 GB vs 0.33 GB claim, from the engine's allocated buffers
    prompt-cache   a cached compressed prompt: TTFT, an 8-turn chat and save/load against a
                   fresh prefill, the disk and the host link (issue 46)
    serve          streamed HTTP load: this engine's server vs HF continuous batching
                   (TTFT, ITL, tokens/s against Poisson rates; serve-worker is its server)
    report         redraw markdown and plots of every report in --out, write summary.md

Every command writes ``<out>/<command>.json`` and ``.md`` after each measurement, stops
starting measurements once ``--budget-seconds`` would be exceeded (recording what it skipped),
and with ``--tiny`` runs end to end on a tiny random model, on the CPU if there is no GPU.
"""
from __future__ import annotations

import argparse
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from .argtypes import comma_list, positive_float, positive_int, shape_list
from .prompt_cache_bench import PRESET as PROMPT_CACHE_PRESET, cmd_prompt_cache

PROG = "python -m minikv_compile.perf"
ALL_METHODS = ("hf-eager", "hf-static", "full", "kivi", "minikv", "minikv-pyramid")
PREFILL_METHODS = ALL_METHODS + ("hf-eager-attn",)
ENGINE_ONLY = ("full", "kivi", "minikv", "minikv-pyramid")
# engine-vs-hf only (harness.py): SpeCache, and the GPU copies it runs on
SPECACHE_METHODS = ("kivi-specache", "minikv-specache", "kivi-specache-b16",
                    "kivi-g64-hadamard-specache", "kivi-g64", "kivi-g64-hadamard", "kivi1-g64",
                    "kivi1-g64-hadamard-specache", "kivi-g128-hadamard",
                    "kivi-g128-hadamard-specache", "kivi-g32-hadamard-specache",
                    "kivi-g64-hadamard-specache128")
MODELS = ("llama3.1-8b", "llama2-7b", "smollm2-135m", "smollm2-135m-real", "tiny")
NO_GPU = "no CUDA device: this measurement needs a GPU (--tiny runs the plumbing on the CPU)"

# Sized settings per command: "full" is the definition, "tiny" a CPU plumbing run.
# Any option given on the command line wins over both.
PRESETS: Dict[str, Dict[str, Dict[str, object]]] = {
    "engine-vs-hf": {
        "full": dict(model="llama3.1-8b", shapes=[(1, 32768), (8, 4096)], methods=["hf-static", "minikv"],
                     warm_tokens=8, timed_tokens=64),
        "tiny": dict(model="tiny", shapes=[(1, 96), (2, 64)], methods=["hf-static", "minikv"],
                     warm_tokens=2, timed_tokens=8),
    },
    "latency": {
        "full": dict(model="llama3.1-8b", contexts=[1024, 2048, 4096, 8192, 16384, 32768, 65536],
                     batches=[1, 4, 16], batch_prompt=4096, methods=list(ALL_METHODS),
                     warm_tokens=4, timed_tokens=32),
        "tiny": dict(model="tiny", contexts=[32, 64], batches=[2], batch_prompt=48,
                     methods=["hf-static", "minikv"], warm_tokens=2, timed_tokens=4),
    },
    "throughput": {
        "full": dict(model="llama3.1-8b", prompts=[2048, 4096], gen_tokens=1024, methods=list(ALL_METHODS),
                     warm_tokens=4, timed_tokens=32, max_batch=256, batches=[], retries=2),
        "tiny": dict(model="tiny", prompts=[48], gen_tokens=8, methods=["hf-static", "minikv"],
                     warm_tokens=2, timed_tokens=6, max_batch=3, batches=[1], retries=1),
    },
    "max-prompt": {
        "full": dict(model="llama2-7b", memory_cap_gb=24.0, methods=list(ALL_METHODS), new_tokens=512,
                     probes=6, resolution=1024, calibration=[1024, 4096], max_len=131072),
        "tiny": dict(model="tiny", memory_cap_gb=None, methods=["hf-static", "minikv"], new_tokens=8,
                     probes=5, resolution=16, calibration=[32, 64], max_len=512),
    },
    "prefill": {
        "full": dict(model="llama2-7b", lengths=[1024, 2048, 4096, 8192, 16384, 32768],
                     methods=["minikv", "full", "hf-eager", "hf-eager-attn"]),
        "tiny": dict(model="tiny", lengths=[32, 64], methods=["minikv", "full", "hf-eager", "hf-eager-attn"]),
    },
    "memory-claim": {
        "full": dict(model="llama2-7b", prompt_len=4096, new_tokens=512, methods=list(ENGINE_ONLY)),
        "tiny": dict(model="tiny", prompt_len=64, new_tokens=16, methods=list(ENGINE_ONLY)),
    },
    "prompt-cache": PROMPT_CACHE_PRESET,
}


# -- argument parsing ---------------------------------------------------------------------------


def _int_list(text: str) -> List[int]:
    items = [t for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return [positive_int(t.strip()) for t in items]


def _int_list_or_empty(text: str) -> List[int]:
    return _int_list(text) if text.strip() else []


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Evidence for adopting the engine: decode "
                                     "speed, throughput, memory and longest prompt against HF transformers.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="See perf/README.md for definitions and the committed results.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def common(p, methods=ALL_METHODS):
        p.add_argument("--out", required=True,
                       help="folder for JSON / markdown / PNG; '{gpu}' is replaced by the device, "
                            "e.g. perf/results/{gpu}")
        p.add_argument("--tiny", action="store_true",
                       help="tiny random model and sizes: checks the plumbing (runs on the CPU)")
        p.add_argument("--budget-seconds", type=positive_float, default=None,
                       help="start no measurement expected to end after this many seconds; "
                            "the rest is reported as skipped (time budget)")
        p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
        p.add_argument("--model", choices=MODELS, default=None, help="model shape (random weights)")
        p.add_argument("--methods", type=comma_list(methods, "methods"), default=None,
                       help=f"comma-separated, from: {', '.join(methods)}")
        p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")

    def decode_tokens(p):
        p.add_argument("--warm-tokens", type=positive_int, default=None)
        p.add_argument("--timed-tokens", type=positive_int, default=None)

    p = sub.add_parser("engine-vs-hf", help="MiniKV vs HF StaticCache decode, against the floor")
    common(p, ALL_METHODS + SPECACHE_METHODS)
    p.add_argument("--shapes", type=shape_list, default=None, help="BATCHxPROMPT list, e.g. 1x32768,8x4096")
    decode_tokens(p)

    p = sub.add_parser("latency", help="TTFT and ms/token over context and batch size")
    common(p)
    p.add_argument("--contexts", type=_int_list, default=None, help="prompt lengths at batch 1")
    p.add_argument("--batches", type=_int_list_or_empty, default=None,
                   help="batch sizes at --batch-prompt ('' for none)")
    p.add_argument("--batch-prompt", type=positive_int, default=None)
    decode_tokens(p)

    p = sub.add_parser("throughput", help="decode tokens/s up to the largest batch that fits")
    common(p)
    p.add_argument("--prompts", type=_int_list, default=None, help="prompt lengths")
    p.add_argument("--gen-tokens", type=positive_int, default=None,
                   help="generated tokens the caches are sized for (the definition: 1024)")
    decode_tokens(p)
    p.add_argument("--max-batch", type=positive_int, default=None, help="cap on the batch-size search")
    p.add_argument("--batches", type=_int_list_or_empty, default=None,
                   help="extra batch sizes below each method's limit, for the curve ('' for none)")
    p.add_argument("--retries", type=int, default=None, help="smaller batches tried after an OOM")

    p = sub.add_parser("max-prompt", help="longest batch-1 prompt under a memory cap")
    common(p, PREFILL_METHODS)
    p.add_argument("--memory-cap-gb", type=positive_float, default=None,
                   help="per-process cap in GiB (torch.cuda.set_per_process_memory_fraction)")
    p.add_argument("--new-tokens", type=positive_int, default=None, help="generated tokens accounted for")
    p.add_argument("--probes", type=positive_int, default=None, help="probes per method (calibration included)")
    p.add_argument("--resolution", type=positive_int, default=None, help="search resolution in tokens")
    p.add_argument("--calibration", type=_int_list, default=None, help="first probe lengths")
    p.add_argument("--max-len", type=positive_int, default=None, help="longest prompt tried")

    p = sub.add_parser("prefill", help="prefill time and peak memory against prompt length")
    common(p, PREFILL_METHODS)
    p.add_argument("--lengths", type=_int_list, default=None)

    p = sub.add_parser("memory-claim", help="KV bytes allocated vs the paper's 2.4 / 0.33 GB")
    common(p, ENGINE_ONLY)
    p.add_argument("--prompt-len", type=positive_int, default=None)
    p.add_argument("--new-tokens", type=positive_int, default=None)

    from .prompt_cache_bench import add_parser as add_prompt_cache_parser

    add_prompt_cache_parser(sub, common, positive_int)

    from .serve_bench import add_parsers as add_serve_parsers

    add_serve_parsers(sub)

    p = sub.add_parser("report", help="redraw markdown + plots of --out and write summary.md")
    p.add_argument("--out", required=True)
    return parser


def apply_presets(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill every option left unset from the command's preset (tiny or full), then check."""
    if args.command == "report":
        return
    preset = PRESETS[args.command]["tiny" if args.tiny else "full"]
    for key, value in preset.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.command == "throughput" and args.retries is not None and args.retries < 0:
        parser.error(f"--retries: expected >= 0, got {args.retries}")
    if args.command == "max-prompt" and args.calibration and min(args.calibration) >= args.max_len:
        parser.error(f"--calibration: expected lengths below --max-len={args.max_len}, got {args.calibration}")
    if args.command == "memory-claim" and args.model == "smollm2-135m-real":
        parser.error("--model: memory-claim counts bytes of a shape; use smollm2-135m for SmolLM2")
    if args.seed < 0:
        parser.error(f"--seed: expected >= 0, got {args.seed}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device is available here (use --device auto)")


# -- a run --------------------------------------------------------------------------------------


class Progress:
    """One line per measurement (start and result) on stderr; a tqdm bar on a terminal."""

    def __init__(self, budget):
        self.budget, self.count, self.bar = budget, 0, None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=None, unit="meas", file=sys.stderr, leave=False)
            except ImportError:
                pass

    def _say(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def _clock(self) -> str:
        limit = f"/{self.budget.seconds:.0f}" if self.budget.seconds else ""
        return f"{self.budget.elapsed:.0f}{limit}s"

    def start(self, label: str) -> None:
        self._say(f"[perf {self._clock()}] {label} ...")
        if self.bar is not None:
            self.bar.set_description(label[:60])

    def done(self, label: str, row: Dict[str, object]) -> None:
        self.count += 1
        status = row.get("status")
        if status == "ok":
            head = next((f"{k}={_short(row[k])}" for k in ("ms_per_token", "decode_tokens_per_s",
                         "longest_prompt", "prefill_s", "total_bytes", "seconds") if row.get(k) is not None), "")
            text = f"ok {head}"
        else:
            text = f"{status}: {str(row.get('reason'))[:160]}"
        self._say(f"[perf {self._clock()}] {label}: {text}")
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _short(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


class Session:
    """What every command shares: device, report, budget, NVML sampler, progress."""

    def __init__(self, args: argparse.Namespace, argv: Sequence[str]):
        import torch
        import transformers

        from . import harness as H
        from . import measure as M
        from .report import Report

        self.H, self.M, self.torch, self.args = H, M, torch, args
        transformers.utils.logging.set_verbosity_error()
        if args.device == "cpu" or not torch.cuda.is_available():
            self.device = torch.device("cpu")
        else:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.on_gpu = self.device.type == "cuda"
        self.dtype = torch.bfloat16 if self.on_gpu else torch.float32
        out = Path(args.out.replace("{gpu}", M.gpu_slug(self.device)))
        env = M.environment(self.device)
        self.report = Report(out, args.command, [PROG, *argv], vars(args), env)
        self.budget = H.Budget(args.budget_seconds)
        self.sampler = M.NvmlSampler(self.device)
        if not self.sampler.available:
            self.report.note(f"NVML sampling off ({self.sampler.reason}): peak memory is the PyTorch "
                             "allocator's only")
        if not self.on_gpu and args.command != "memory-claim":
            self.report.note("CPU run: no memory figures, no compile (the engine compiles and captures "
                             "only on CUDA; HF auto-compiles only on CUDA); timings are plumbing only")
        self.progress = Progress(self.budget)
        H.raise_recompile_limit()

    @property
    def out_dir(self) -> Path:
        return self.report.out_dir

    def usable(self) -> bool:
        """False (and a note) when real shapes were asked for without a GPU."""
        return self.on_gpu or self.args.tiny

    def skip_all(self, experiment: str, methods: Sequence[str], reason: str, **fields) -> None:
        for m in methods:
            self.report.add({"experiment": experiment, "method": m, **fields, "status": "skipped",
                             "reason": reason})

    def run(self, row: Dict[str, object], fn: Callable[[], Optional[Dict[str, object]]],
            kind: Optional[str] = None) -> Dict[str, object]:
        """Measure ``fn`` into ``row``: budget check, memory watch, errors and OOMs as results."""
        H = self.H
        kind = kind or f"{row.get('experiment')}:{row.get('method')}"
        label = _row_label(row)
        why = self.budget.check(kind)
        if why is not None:
            row.update(status="skipped", reason=why)
            self.report.add(row)
            self.progress.done(label, row)
            return row
        self.progress.start(label)
        start = time.perf_counter()
        watch = H.MemoryWatch(self.device, self.sampler)
        try:
            with watch:
                metrics = fn() or {}
            row.update(metrics)
            row["status"] = "ok"
        except H.Skip as e:
            row.update(status="skipped", reason=str(e))
        except Exception as e:  # recorded, never fatal: the report must complete
            row.update(H.describe_exception(e))
            if H.is_oom(e):
                row["status"] = "oom"
            else:
                row["status"] = "error"
                tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
                row["traceback"] = tb[-4000:]
                print(tb[-2500:], file=sys.stderr)
            del e
        row.update(watch.result)
        row["seconds"] = time.perf_counter() - start
        row["time"] = self.M.now_iso()
        self.budget.note(kind, row["seconds"])
        H.release()
        self.report.add(row)
        self.progress.done(label, row)
        return row

    def load_model(self, name: str):
        """The model (or None, with the reason recorded) and its facts in the report context."""
        H = self.H
        holder = {}

        def build():
            model = H.build_model(name, self.device, self.dtype)
            holder["model"] = model
            facts = {"name": name, "description": H.SHAPES[name].description, **H.model_summary(model)}
            self.report.set_context("model", facts)
            return {"parameters": facts["parameters"], "weight_bytes": facts["weight_bytes"]}

        row = self.run({"experiment": "setup", "what": f"build model {name}", "method": "-"}, build,
                       kind="model")
        if holder.get("model") is None:
            self.model_failure = f"model {name} not built: {row.get('status')}: {row.get('reason')}"
        return holder.get("model")

    def bandwidth(self) -> Optional[Dict[str, object]]:
        """Copy bandwidth measured now (the floor's denominator), or None with the reason."""
        H = self.H
        try:
            bw = self.M.copy_bandwidth(self.device)
        except H.Skip as e:
            bw = {"reason": str(e)}
        except Exception as e:
            bw = H.describe_exception(e)
        self.report.set_context("bandwidth", bw)
        return bw if bw.get("bytes_per_s") else None

    def finish(self, interrupted: Optional[str]) -> None:
        self.progress.close()
        self.report.finish(self.budget.elapsed, interrupted)
        print(f"[perf] wrote {self.report.json_path} and {self.report.md_path}", file=sys.stderr)


def _row_label(row: Dict[str, object]) -> str:
    parts = [str(row.get("experiment")), str(row.get("method", ""))]
    if row.get("batch") is not None:
        parts.append(f"b={row['batch']}")
    if row.get("prompt_len") is not None:
        parts.append(f"L={row['prompt_len']}")
    if row.get("what"):
        parts.append(str(row["what"]))
    return " ".join(p for p in parts if p and p != "-")


# -- commands -----------------------------------------------------------------------------------


def cmd_memory_claim(s: Session, a) -> None:
    """KV bytes of each engine method at the paper's setting, from the engine's own buffers.

    The engine is built on a weightless (meta) copy of the model: its cache buffers get the
    exact shapes and dtypes they get on a GPU, so the byte counts are exact and no GPU is needed.
    """
    H = s.H
    from minikv_compile import minikv_compile

    meta = H.meta_model(a.model)
    facts = {"name": a.model, "description": H.SHAPES[a.model].description, **H.model_summary(meta)}
    s.report.set_context("model", facts)
    L, G = a.prompt_len, a.new_tokens
    width = facts["kv_heads"] * facts["head_dim"]
    paper = {"shape": H.SHAPES[a.model].description, "prompt_len": L, "new_tokens": G,
             "budgets": "25% heavy hitters + 25% recent window",
             "fp16_bytes": H.paper_fp16_kv_bytes(facts["layers"], width, L, G),
             "minikv_bytes": H.paper_minikv_kv_bytes(facts["layers"], width, L, G),
             "paper_fp16_gb": 2.4, "paper_minikv_gb": 0.33}
    s.report.set_context("paper", paper)
    for method in a.methods:
        def measure(method=method):
            cfg = H.engine_config(method, max_batch_size=1, max_prompt_len=L, max_new_tokens=G,
                                  compile=False, cuda_graphs=False)
            rep = minikv_compile(meta, cfg).kv_memory(L, G)
            total = rep.total_bytes
            return {"bits": rep.bits, "total_bytes": total,
                    "codes_bytes": sum(x.codes for x in rep.layers),
                    "scale_zero_bytes": sum(x.scale_zero for x in rep.layers),
                    "ring_bytes": rep.ring_bytes, "counters_bytes": sum(x.counters for x in rep.layers),
                    "padding_bytes": rep.padding_bytes, "quantized_region_bytes": rep.quantized_region_bytes,
                    "formula_bytes": rep.formula_bytes, "fp16_bytes": rep.fp16_bytes, "ratio": rep.ratio,
                    "fp16_matches_paper": rep.fp16_bytes == paper["fp16_bytes"],
                    "formula_matches_paper": rep.formula_bytes == paper["minikv_bytes"],
                    "over_paper_minikv_bytes": total - paper["minikv_bytes"],
                    "report_text": str(rep)}
        s.run({"experiment": "memory-claim", "method": method, "batch": 1, "prompt_len": L,
               "new_tokens": G}, measure, kind="memory")


def cmd_engine_vs_hf(s: Session, a) -> None:
    H = s.H
    if not s.usable():
        for B, L in a.shapes:
            s.skip_all("decode", a.methods, NO_GPU, batch=B, prompt_len=L)
        return
    model = s.load_model(a.model)
    if model is None:
        for B, L in a.shapes:
            s.skip_all("decode", a.methods, s.model_failure, batch=B, prompt_len=L)
        return
    bw = s.bandwidth()
    vocab = model.config.vocab_size
    capacity = a.warm_tokens + a.timed_tokens + 1
    # Shape-major: both methods of one shape run back to back, so a killed run keeps pairs.
    for B, L in a.shapes:
        prompts = H.make_prompts(B, L, vocab, a.seed)
        for method in a.methods:
            def measure(method=method, B=B, L=L, prompts=prompts):
                runner = H.make_runner(model, method, batch=B, prompt_len=L, new_tokens=capacity)
                try:
                    m = H.time_decode(runner, prompts, a.warm_tokens, a.timed_tokens)
                    m.update(runner.setup_info())
                    m["kv_bytes"] = runner.kv_bytes()
                finally:
                    runner.close()
                m.update(H.floor_figures(model, method, L, B, m["generated_mid"], m["ms_per_token"], bw))
                # The target's reference: the MiniKV floor, whatever method this row measures.
                mk = H.floor_figures(model, "minikv", L, B, m["generated_mid"], m["ms_per_token"], bw)
                m["minikv_floor_ms"] = mk.get("floor_ms")
                return m
            s.run({"experiment": "decode", "method": method, "batch": B, "prompt_len": L}, measure,
                  kind=f"decode:{method}")
            if H.is_engine(method):
                H.release(model, compiled_state=True)


def cmd_latency(s: Session, a) -> None:
    H = s.H
    if not s.usable():
        s.skip_all("latency", a.methods, NO_GPU)
        return
    model = s.load_model(a.model)
    if model is None:
        s.skip_all("latency", a.methods, s.model_failure)
        return
    bw = s.bandwidth()
    vocab = model.config.vocab_size
    capacity = a.warm_tokens + a.timed_tokens + 1
    contexts = sorted(a.contexts)
    for method in a.methods:
        # Context sweep at batch 1. One engine serves every context (cost tracks the tokens held,
        # not the capacity), so it compiles once; HF gets a cache sized to each context.
        held: Dict[str, object] = {}
        for L in contexts:
            prompts = H.make_prompts(1, L, vocab, a.seed)
            first = held.get("runner") is None

            def measure(method=method, L=L, prompts=prompts):
                runner = held.get("runner")
                fresh = runner is None or not H.is_engine(method)
                if fresh:
                    if runner is not None:
                        runner.close()
                    held["runner"] = None
                    H.release()
                    runner = H.make_runner(model, method, batch=1, new_tokens=capacity,
                                           prompt_len=contexts[-1] if H.is_engine(method) else L)
                    held["runner"] = runner
                m = H.time_stream(runner, prompts, a.warm_tokens, a.timed_tokens)
                if fresh:
                    m.update(runner.setup_info())
                m["kv_bytes"] = runner.kv_bytes(L)
                m.update(H.floor_figures(model, method, L, 1, m["generated_mid"], m["ms_per_token"], bw))
                return m
            row = s.run({"experiment": "latency", "sweep": "context", "method": method, "batch": 1,
                         "prompt_len": L}, measure,
                        kind=f"latency:{method}:{'setup' if first or not H.is_engine(method) else 'point'}")
            if row["status"] != "ok" and held.get("runner") is not None:
                held["runner"].close()
                held["runner"] = None
        if held.get("runner") is not None:
            held["runner"].close()
        held.clear()
        H.release(model, compiled_state=True)
        # Batch sweep at a fixed prompt: one runner (one compile) per batch size.
        for B in a.batches:
            prompts = H.make_prompts(B, a.batch_prompt, vocab, a.seed)

            def measure_batch(method=method, B=B, prompts=prompts):
                runner = H.make_runner(model, method, batch=B, prompt_len=a.batch_prompt, new_tokens=capacity)
                try:
                    m = H.time_stream(runner, prompts, a.warm_tokens, a.timed_tokens)
                    m.update(runner.setup_info())
                    m["kv_bytes"] = runner.kv_bytes()
                finally:
                    runner.close()
                m.update(H.floor_figures(model, method, a.batch_prompt, B, m["generated_mid"],
                                         m["ms_per_token"], bw))
                return m
            s.run({"experiment": "latency", "sweep": "batch", "method": method, "batch": B,
                   "prompt_len": a.batch_prompt}, measure_batch, kind=f"latency:{method}:batch")
            if H.is_engine(method):
                H.release(model, compiled_state=True)
        H.release(model, compiled_state=True)


def cmd_throughput(s: Session, a) -> None:
    H = s.H
    if not s.usable():
        for L in a.prompts:
            s.skip_all("throughput", a.methods, NO_GPU, prompt_len=L)
        return
    model = s.load_model(a.model)
    if model is None:
        for L in a.prompts:
            s.skip_all("throughput", a.methods, s.model_failure, prompt_len=L)
        return
    bw = s.bandwidth()
    vocab = model.config.vocab_size
    capacity = max(a.gen_tokens, a.warm_tokens + a.timed_tokens + 1)
    facts = H.model_summary(model)
    kv_per_token = 2 * facts["layers"] * facts["kv_heads"] * facts["head_dim"] * 2
    s.report.note(f"decode tokens/s = batch x timed steps / their seconds, over {a.timed_tokens} steps "
                  f"after {a.warm_tokens} warm-up tokens; caches are sized for {a.gen_tokens} generated "
                  "tokens; prefill is timed apart; end-to-end tokens/s = batch x gen / (prefill + "
                  "(gen - 1) x step), with the step measured early in generation (a lower bound on "
                  "the average step for caches that grow)")

    def point(method: str, L: int, B: int) -> Dict[str, object]:
        prompts = H.make_prompts(B, L, vocab, a.seed)

        def measure():
            runner = H.make_runner(model, method, batch=B, prompt_len=L, new_tokens=capacity)
            try:
                m = H.time_decode(runner, prompts, a.warm_tokens, a.timed_tokens)
                m.update(runner.setup_info())
                m["kv_bytes"] = runner.kv_bytes()
            finally:
                runner.close()
            m.update(H.floor_figures(model, method, L, B, m["generated_mid"], m["ms_per_token"], bw))
            steps_s = (a.gen_tokens - 1) * m["ms_per_token"] / 1e3
            m["e2e_tokens_per_s"] = B * a.gen_tokens / (m["prefill_s"] + steps_s)
            if method == "hf-eager":  # DynamicCache grows; only the timed tokens were verified
                m["kv_growth_unverified_bytes"] = B * kv_per_token * max(0, a.gen_tokens - capacity)
            return m
        row = s.run({"experiment": "throughput", "method": method, "batch": B, "prompt_len": L,
                     "gen_tokens": a.gen_tokens}, measure, kind=f"throughput:{method}")
        if H.is_engine(method):
            H.release(model, compiled_state=True)
        return row

    # Three phases, so that a time budget cuts the least useful points: every method's limit
    # first (predicted from memory, confirmed by running, smaller after an OOM), then one
    # refinement per method from the memory it really used, then the extra points of the curve.
    limits = []
    for L in a.prompts:
        for method in a.methods:
            limit = {"experiment": "limit", "method": method, "prompt_len": L, "gen_tokens": a.gen_tokens,
                     "attempts": [], "verified_limit": None}
            limits.append(limit)
            per_seq, fixed = _bytes_per_sequence(H, model, method, L, capacity)
            limit.update(bytes_per_sequence=per_seq, fixed_bytes=fixed)
            try:
                mem = H.device_memory(s.device)
                margin = max(2**30, int(0.04 * mem["total_bytes"]))
                predicted = max(0, int((mem["usable_bytes"] - margin - fixed) // per_seq))
                limit.update(usable_bytes=mem["usable_bytes"], margin_bytes=margin, predicted_limit=predicted)
            except H.Skip as e:
                predicted = a.max_batch
                limit.update(predicted_limit=None, prediction_note=f"{e}: batch taken from --max-batch")
            batch = min(predicted, a.max_batch)
            limit["capped_by_max_batch"] = predicted > a.max_batch
            retries = 0
            while batch >= 1:
                row = point(method, L, batch)
                limit["attempts"].append((batch, row["status"]))
                limit["last_row"] = row
                if row["status"] == "ok":
                    limit["verified_limit"] = batch
                    break
                if row["status"] != "oom" or retries >= a.retries or batch == 1:
                    break
                retries += 1
                batch = max(1, int(batch * 0.75))
            limit["retried"] = retries > 0
            H.release(model, compiled_state=True)
    for limit in limits:
        # A larger batch is worth confirming when the bytes per sequence the run really used say
        # that clearly more fit than the prediction (only when the first attempt fitted).
        verified, row = limit["verified_limit"], limit.get("last_row")
        refit = _refit_batch(row, limit) if verified and not limit["retried"] else None
        if refit is not None and 1.15 * verified <= refit <= a.max_batch:
            limit["refit_limit"] = refit
            row = point(limit["method"], limit["prompt_len"], refit)
            limit["attempts"].append((refit, row["status"]))
            if row["status"] == "ok":
                limit["verified_limit"] = refit
            H.release(model, compiled_state=True)
    for limit in limits:
        for b in sorted(set(a.batches)):
            if limit["verified_limit"] is not None and b < limit["verified_limit"]:
                point(limit["method"], limit["prompt_len"], b)
        H.release(model, compiled_state=True)
    for limit in limits:
        method, L = limit["method"], limit["prompt_len"]
        ok = [r for r in s.report.results if r.get("experiment") == "throughput" and r.get("method") == method
              and r.get("prompt_len") == L and r.get("status") == "ok" and r.get("decode_tokens_per_s")]
        best = max(ok, key=lambda r: r["decode_tokens_per_s"]) if ok else None
        last = limit.pop("last_row", None)
        attempts = limit["attempts"]
        limit.update(best_tokens_per_s=best and best["decode_tokens_per_s"], best_batch=best and best["batch"],
                     status="ok" if limit["verified_limit"] else (attempts[-1][1] if attempts else "oom"))
        if not limit["verified_limit"]:
            limit["reason"] = (last["reason"] if last else
                               "predicted limit below one sequence: not even batch 1 fits the memory model")
        s.report.add(limit)


def _refit_batch(row: Dict[str, object], limit: Dict[str, object]) -> Optional[int]:
    """The batch the measured peak predicts: usable memory over measured bytes per sequence."""
    peak, before = row.get("peak_allocated_bytes"), row.get("allocated_before_bytes")
    usable, margin = limit.get("usable_bytes"), limit.get("margin_bytes")
    if None in (peak, before, usable, margin) or row.get("status") != "ok" or peak <= before:
        return None
    per_seq = (peak - before) / row["batch"]
    return int((usable - margin) // per_seq)


def _bytes_per_sequence(H, model, method: str, L: int, capacity: int):
    """(bytes per extra sequence, fixed bytes) of a method's memory model at prompt L."""
    if H.is_engine(method):
        # The engine prefills one prompt at a time: its activations are paid once, not per slot.
        return H.engine_slot_bytes(model, method, L, capacity)["bytes_per_slot"], \
            H.prefill_activation_bytes(model, L)
    return H.hf_bytes_per_sequence(model, method, L, capacity), 0


def cmd_max_prompt(s: Session, a) -> None:
    H, torch = s.H, s.torch
    if not s.usable():
        s.skip_all("max-prompt", a.methods, NO_GPU)
        return
    model = s.load_model(a.model)
    if model is None:
        s.skip_all("max-prompt", a.methods, s.model_failure)
        return
    vocab = model.config.vocab_size
    facts = H.model_summary(model)
    kv_per_token = 2 * facts["layers"] * facts["kv_heads"] * facts["head_dim"] * 2
    emulated = not s.on_gpu
    if s.on_gpu:
        total = torch.cuda.get_device_properties(s.device).total_memory
        cap = int(a.memory_cap_gb * 2**30) if a.memory_cap_gb else total
        fraction = min(1.0, cap / total)
        if facts["weight_bytes"] >= cap:
            s.skip_all("max-prompt", a.methods, f"model weights ({facts['weight_bytes']:,} B) exceed the cap")
            return
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(fraction, s.device)
        s.report.set_context("memory_cap", {"cap_bytes": cap, "fraction": fraction, "device_total_bytes": total,
                                            "emulated": False})
        s.report.note("cap = torch.cuda.set_per_process_memory_fraction(cap / device memory): it bounds "
                      "this process's PyTorch allocator; the CUDA context and library workspaces lie "
                      "outside it")
    else:
        # No allocator cap on the CPU: a probe "fits" when the harness's memory estimate does,
        # with the cap placed so that the search has something to find (plumbing only).
        cap = int(a.memory_cap_gb * 2**30) if a.memory_cap_gb else \
            _estimated_peak(H, model, "hf-static", 6 * a.resolution, a.new_tokens)
        s.report.set_context("memory_cap", {"cap_bytes": cap, "emulated": True})
        s.report.note("CPU run: fits = estimated peak <= cap (emulated); the probes still run")
    s.report.note(f"probe = build the method for prompt L + {a.new_tokens} new tokens (engine: eager, no "
                  "compile/graphs; HF: compile disabled) and generate 2 tokens at batch 1; the cache "
                  f"for all {a.new_tokens} tokens is allocated up front, except HF's DynamicCache, whose "
                  "growth over the remaining tokens is added to the measured peak")
    try:
        for method in a.methods:
            _search(s, H, model, method, a, cap, vocab, kv_per_token, emulated)
            H.release(model, compiled_state=True)
    finally:
        if s.on_gpu:
            torch.cuda.set_per_process_memory_fraction(1.0, s.device)


def _estimated_peak(H, model, method: str, L: int, new_tokens: int) -> int:
    """Weights + the method's KV for L + new tokens + prefill activations (CPU emulation only)."""
    facts = H.model_summary(model)
    if H.is_engine(method):
        kv = H.engine_slot_bytes(model, method, L, new_tokens)["kv_bytes_per_slot"]
        return facts["weight_bytes"] + kv + H.prefill_activation_bytes(model, L)
    return facts["weight_bytes"] + H.hf_bytes_per_sequence(model, method, L, new_tokens)


def _search(s: Session, H, model, method: str, a, cap: int, vocab: int, kv_per_token: int,
            emulated: bool) -> None:
    """Longest prompt that fits: calibration probes, a linear prediction, then bisection."""
    tried: Dict[int, Dict[str, object]] = {}
    state = {"lo": 0, "hi": None, "stop": False}
    res = a.resolution

    def probe(L: int) -> None:
        prompts = H.make_prompts(1, L, vocab, a.seed)

        def measure():
            runner = H.make_runner(model, method, batch=1, prompt_len=L, new_tokens=a.new_tokens,
                                   compiled=False)
            try:
                call = runner.generate(prompts, 2)
                m = {"prefill_s": call.prefill_s if call.prefill_s is not None else call.wall_s,
                     "kv_bytes": runner.kv_bytes()}
            finally:
                runner.close()
            if method in ("hf-eager", "hf-eager-attn"):
                m["kv_growth_bytes"] = kv_per_token * max(0, a.new_tokens - 2)
            if emulated:
                m["emulated_peak_bytes"] = _estimated_peak(H, model, method, L, a.new_tokens)
            return m
        row = s.run({"experiment": "probe", "method": method, "batch": 1, "prompt_len": L,
                     "new_tokens": a.new_tokens}, measure, kind=f"probe:{method}")
        tried[L] = row
        if row["status"] == "ok":
            peak = row.get("emulated_peak_bytes") if emulated else row.get("peak_allocated_bytes")
            row["need_bytes"] = peak + (row.get("kv_growth_bytes") or 0)
            row["fits"] = row["need_bytes"] <= cap
        elif row["status"] == "oom":
            row["fits"] = False
        else:
            row["fits"] = None
            state["stop"] = True
        if row["fits"]:
            state["lo"] = max(state["lo"], L)
        elif row["fits"] is False:
            state["hi"] = L if state["hi"] is None else min(state["hi"], L)
        s.report.write()

    def predict() -> Optional[int]:
        pts = sorted((L, r["need_bytes"]) for L, r in tried.items() if r.get("fits"))
        if len(pts) < 2:
            return None
        (l1, p1), (l2, p2) = pts[-2], pts[-1]
        slope = (p2 - p1) / (l2 - l1)
        return int(l2 + (0.98 * cap - p2) / slope) if slope > 0 else None

    def round_down(x: float) -> int:
        return max(res, int(x // res) * res)

    def next_length(pred: Optional[int]) -> Optional[int]:
        lo, hi = state["lo"], state["hi"]
        if hi is not None and hi - lo <= res:
            return None
        if hi is None:
            cand = round_down(pred) if pred and pred > lo else round_down(max(2 * lo, res))
            if cand <= lo or cand in tried:
                cand = round_down(lo * 1.1 + res)
            cand = min(cand, a.max_len)
            return cand if cand > lo and cand not in tried else None
        mid = round_down((lo + hi) / 2)
        cand = round_down(pred) if pred and lo < pred < hi else mid
        if not lo < cand < hi or cand in tried:
            cand = mid
        return cand if lo < cand < hi and cand not in tried else None

    for L in sorted(a.calibration):
        if len(tried) >= a.probes or state["stop"] or L > a.max_len:
            break
        probe(L)
        if not tried[L].get("fits"):
            break
    pred = None
    while len(tried) < a.probes and not state["stop"]:
        pred = predict() or pred
        L = next_length(pred)
        if L is None:
            break
        probe(L)
    lo, hi = state["lo"], state["hi"]
    summary = {"experiment": "max-prompt", "method": method, "batch": 1, "new_tokens": a.new_tokens,
               "longest_prompt": lo or None, "shortest_failing": hi, "predicted_prompt": pred,
               "probes": len(tried), "cap_bytes": cap, "at_max_len": lo >= a.max_len,
               "status": "ok" if lo else "oom" if hi else "skipped"}
    if not lo:
        reasons = [r.get("reason") for r in tried.values() if r.get("reason")]
        summary["reason"] = reasons[-1] if reasons else "no probe fitted"
    s.report.add(summary)


def cmd_prefill(s: Session, a) -> None:
    H = s.H
    if not s.usable():
        s.skip_all("prefill", a.methods, NO_GPU)
        return
    model = s.load_model(a.model)
    if model is None:
        s.skip_all("prefill", a.methods, s.model_failure)
        return
    vocab = model.config.vocab_size
    s.report.note("prefill s: engine = its own prefill_seconds; HF = one generate call with one new token. "
                  "transient peak = allocator peak during that call minus what was allocated before it "
                  "(weights, and the engine's preallocated cache; HF's DynamicCache is created inside)")
    for method in a.methods:
        failed_at = None
        for L in sorted(a.lengths):
            row = {"experiment": "prefill", "method": method, "batch": 1, "prompt_len": L}
            if failed_at is not None:
                row.update(status="skipped", reason=f"longer than {failed_at}, which ran out of memory")
                s.report.add(row)
                continue
            prompts = H.make_prompts(1, L, vocab, a.seed)

            def measure(method=method, L=L, prompts=prompts):
                runner = H.make_runner(model, method, batch=1, prompt_len=L, new_tokens=1, compiled=False)
                try:
                    m = H.time_prefill(runner, prompts, s.device)
                    m["kv_bytes"] = runner.kv_bytes()
                finally:
                    runner.close()
                return m
            row = s.run(row, measure, kind=f"prefill:{method}")
            if row["status"] == "oom":
                failed_at = L
        H.release(model, compiled_state=True)


COMMANDS = {
    "engine-vs-hf": cmd_engine_vs_hf,
    "latency": cmd_latency,
    "throughput": cmd_throughput,
    "max-prompt": cmd_max_prompt,
    "prefill": cmd_prefill,
    "memory-claim": cmd_memory_claim,
    "prompt-cache": cmd_prompt_cache,
}


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("serve", "serve-worker"):
        from .serve_bench import main as serve_main

        return serve_main(parser, args, argv)
    apply_presets(parser, args)
    if args.command == "report":
        from .report import rerender
        from .serve_report import has_parts, rebuild

        out = Path(args.out)
        if not out.is_dir():
            parser.error(f"--out: expected a folder of reports, got {args.out!r}")
        found, message = rerender(out)
        if has_parts(out):
            found.append("serve")
            message = message or rebuild(out)[1]
        print(f"[perf] redrew {', '.join(found) or 'no reports'}; wrote {out / 'summary.md'}", file=sys.stderr)
        if message:
            print(f"[perf] {message}", file=sys.stderr)
        return 0
    try:
        session = Session(args, argv)
    except OSError as e:  # the output folder cannot be created or written
        parser.error(f"--out: cannot write reports to {args.out!r} ({e.strerror or e})")
    previous = None
    try:
        previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    except ValueError:  # not the main thread
        pass
    interrupted, code = None, 0
    try:
        COMMANDS[args.command](session, args)
    except KeyboardInterrupt as e:
        interrupted, code = f"interrupted: {e or 'SIGINT'}", 130
    except Exception as e:  # a bug of the tool itself: keep what was measured, say what broke
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        print(tb, file=sys.stderr)
        session.report.note(f"the command stopped on an error of the tool: {type(e).__name__}: {e}")
        session.report.data["error_traceback"] = tb[-4000:]
        interrupted, code = f"error: {type(e).__name__}", 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        session.finish(interrupted)
    return code


if __name__ == "__main__":
    sys.exit(main())
