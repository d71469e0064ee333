"""``python -m minikv_compile.perf serve``: the serving benchmark.

The same streamed load, over HTTP on loopback, against this engine's OpenAI-compatible server
(``minikv``) and against HF transformers' continuous batching (``hf``), on the same model shape,
GPU and requests. Each backend runs in a worker process of its own (``serve-worker``, started and
stopped here, one at a time: they share the GPU); this process is only the client.

Phases, per backend (``--phases``), in this order:

``single``   a few requests one at a time: the batch-1 reference (its ITL p50 is the batch-1
             decode step as a client sees it)
``sweep``    Poisson arrivals at rising rates (doubling from twice the batch-1 rate ``1 / T1``,
             ``T1`` a lone request's time) until p99 TTFT passes ``--ttft-limit`` or output
             tokens/s stop growing, then ``--refine`` geometric bisections; or ``--rates``. The
             saturation rate is the highest sustained one (p99 TTFT under the limit, refused and
             unanswered requests counting as infinitely late)
``half``     Poisson at half the backend's saturation rate
``long``     the same rate with every ``--long-every``-th prompt ``--long-prompt`` tokens long
``offline``  ``--offline-requests`` requests all sent at once
``reuse``    (asked alone, this engine only; not in the default list) multi-turn questions
             about shared documents: ``--reuse-users`` users, Poisson arrivals at
             ``--reuse-rate`` users/s, each on one of ``--reuse-docs`` documents, asking
             ``--reuse-turns`` questions in turn; one upload of each document first (its
             prompt alone). Run twice on the same server (``--reuse-pool-bytes`` of prefix
             cache), reuse off (every request opts out) then on; then as many other users on
             other documents arriving at once (a burst: the server saturated, its sustained
             requests/s), off then on: TTFT, ITL, output tokens/s, requests/s,
             the hit rate and the pool's bytes of each, and their ratios

Every phase leaves ``DIR/serve-parts/<model>.<backend>.<phase>.json`` (every request's figures, the
server's own description and environment); after each, ``DIR/serve.json``, ``serve.md`` and the
plots are rebuilt from all parts in the folder (``serve_report``), so backends and phases run in
separate invocations (each within a 10-minute slot) merge into one report. A phase that could not
run does not replace an earlier successful part of the same phase. ``half`` and ``long`` take the
saturation of the same backend and model from this run's sweep or the folder's.
"""
from __future__ import annotations

import argparse
import math
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from minikv_compile.config import PRESETS as CONFIG_PRESETS

from .argtypes import comma_list, nonneg_int, positive_float, positive_int

MODELS = ("llama3.1-8b", "llama2-7b", "smollm2-135m", "smollm2-135m-real", "tiny")
BACKENDS = ("minikv", "hf")
PHASES = ("single", "sweep", "half", "long", "offline")
# phases asked by name only (not in the default list)
EXTRA_PHASES = ("reuse",)
# Shares of a backend's time left given to each phase still to run (what one does not use
# flows to the next).
_WEIGHTS = {"single": 1.0, "sweep": 4.0, "half": 1.5, "long": 1.5, "offline": 3.0, "reuse": 1.0}
# Our server's /metrics counters, read before and after each phase (the part's "engine" deltas).
ENGINE_COUNTERS = {"steps": "minikv_decode_steps_total",
                   "replays": "minikv_cuda_graph_replays_total",
                   "compiles": "minikv_compiled_graphs_total", "captures": "minikv_cuda_graphs"}
# Behind a data-parallel front, each replica's share of them (its samples labelled replica="i").
REPLICA_COUNTERS = {"tokens": "minikv_completion_tokens_total",
                    "steps": "minikv_decode_steps_total"}

# "full" is the load on the Llama-3.1-8B shape; "tiny" a CPU plumbing run (tests).
PRESETS: Dict[str, Dict[str, object]] = {
    "full": dict(model="llama3.1-8b", backends=list(BACKENDS), phases=list(PHASES),
                 prompt_len=(1024, 16384), output_len=(128, 512), long_prompt=32768,
                 long_every=8, max_batch_size=64, max_queue=1024, prefill_ms=50.0, requests=64,
                 min_requests=16, rate_seconds=60.0, max_rates=8, refine=1, drain_seconds=60.0,
                 ttft_limit=10.0, single_requests=3, offline_requests=256, budget_seconds=510.0,
                 startup_timeout=420.0, reuse_users=32, reuse_turns=4, reuse_docs=4,
                 reuse_doc_len=(8192, 16384), reuse_question_len=(64, 256), reuse_rate=0.5,
                 reuse_pool_bytes=16 << 30),
    "tiny": dict(model="tiny", backends=list(BACKENDS), phases=list(PHASES),
                 prompt_len=(16, 64), output_len=(4, 12), long_prompt=160, long_every=3,
                 max_batch_size=4, max_queue=64, prefill_ms=50.0, requests=8, min_requests=6,
                 rate_seconds=1.0, max_rates=3, refine=0, drain_seconds=10.0, ttft_limit=0.5,
                 single_requests=2, offline_requests=12, budget_seconds=100.0,
                 startup_timeout=90.0, reuse_users=4, reuse_turns=3, reuse_docs=2,
                 reuse_doc_len=(48, 64), reuse_question_len=(4, 8), reuse_rate=4.0,
                 reuse_pool_bytes=64 << 20),
}
# The real SmolLM2 reads 8192 positions: prompts up to 6k, the long ones 7k (+ 512 generated).
MODEL_PRESETS = {"smollm2-135m-real": dict(prompt_len=(1024, 6144), long_prompt=7168)}


# -- arguments ----------------------------------------------------------------------------------

def _range(text: str) -> tuple:
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX (positive integers), got {text!r}")
    lo, hi = (positive_int(p.strip()) for p in parts)
    if lo > hi:
        raise argparse.ArgumentTypeError(f"expected MIN <= MAX, got {text!r}")
    return lo, hi


def _rates(text: str) -> List[float]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected comma-separated rates (req/s), got {text!r}")
    return [positive_float(t) for t in items]


def add_parsers(sub) -> None:
    """The ``serve`` and ``serve-worker`` subcommands."""
    from . import serve_worker

    p = sub.add_parser("serve", help="streamed HTTP load: this engine's server vs HF continuous "
                                     "batching (TTFT, ITL, tokens/s against the offered rate)")
    p.add_argument("--out", required=True,
                   help="folder for serve.json / serve.md / PNG and the parts; '{gpu}' is "
                        "replaced by the device")
    p.add_argument("--tiny", action="store_true",
                   help="tiny random model, a few short requests: checks the plumbing on the CPU")
    p.add_argument("--model", choices=MODELS, default=None,
                   help="model shape (default llama3.1-8b)")
    p.add_argument("--backends", type=comma_list(BACKENDS, "backends", canonical=True), default=None,
                   help="comma-separated, from: minikv, hf (default both, one after the other)")
    p.add_argument("--phases", type=comma_list(PHASES + EXTRA_PHASES, "phases", canonical=True),
                   default=None,
                   help=f"comma-separated, from: {', '.join(PHASES)} (default all); or reuse "
                        f"alone (--backends minikv)")
    p.add_argument("--budget-seconds", type=positive_float, default=None,
                   help="wall-clock bound of the whole invocation, worker start-up included "
                        "(default 510; split evenly between the backends)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--seed", type=nonneg_int, default=0, help="seed of prompts and arrivals")
    g = p.add_argument_group("workload")
    g.add_argument("--prompt-len", type=_range, default=None, metavar="MIN,MAX",
                   help="prompt tokens, uniform (default 1024,16384)")
    g.add_argument("--output-len", type=_range, default=None, metavar="MIN,MAX",
                   help="max_tokens, uniform (default 128,512)")
    g.add_argument("--long-prompt", type=positive_int, default=None,
                   help="tokens of the long prompts of phase 'long' (default 32768)")
    g.add_argument("--long-every", type=positive_int, default=None,
                   help="every K-th request of phase 'long' has the long prompt (default 8)")
    g = p.add_argument_group("sweep and phases")
    g.add_argument("--rates", type=_rates, default=None,
                   help="explicit Poisson rates (req/s) instead of the adaptive sweep")
    g.add_argument("--start-rate", type=positive_float, default=None,
                   help="first rate of the adaptive sweep (default 2 / T1)")
    g.add_argument("--requests", type=positive_int, default=None,
                   help="requests per rate at most (default 64)")
    g.add_argument("--min-requests", type=positive_int, default=None,
                   help="requests per rate at least (default 16)")
    g.add_argument("--rate-seconds", type=positive_float, default=None,
                   help="arrival window per rate: rate x this many requests, within "
                        "[--min-requests, --requests] (default 60)")
    g.add_argument("--max-rates", type=positive_int, default=None,
                   help="rates of the adaptive sweep at most, refinements included (default 8)")
    g.add_argument("--refine", type=nonneg_int, default=None,
                   help="bisections between the last sustained and the first unsustained "
                        "rate (default 1)")
    g.add_argument("--drain-seconds", type=positive_float, default=None,
                   help="a run ends this long after its last arrival at most; what still runs "
                        "is cut (default 60)")
    g.add_argument("--ttft-limit", type=positive_float, default=None,
                   help="a rate is sustained while p99 TTFT stays under this (s, default 10)")
    g.add_argument("--half-rate", type=positive_float, default=None,
                   help="rate of phases half and long (default half the backend's saturation)")
    g.add_argument("--single-requests", type=positive_int, default=None,
                   help="requests of phase single, one at a time (default 3)")
    g.add_argument("--offline-requests", type=positive_int, default=None,
                   help="requests of phase offline, all at once (default 256)")
    g = p.add_argument_group("phase reuse (multi-turn, shared documents, prefix cache on vs off)")
    g.add_argument("--reuse-users", type=positive_int, default=None,
                   help="users (default 32)")
    g.add_argument("--reuse-turns", type=positive_int, default=None,
                   help="questions per user, each sent when the answer before it ended "
                        "(default 4)")
    g.add_argument("--reuse-docs", type=positive_int, default=None,
                   help="shared documents; user u reads document u %% docs (default 4)")
    g.add_argument("--reuse-doc-len", type=_range, default=None, metavar="MIN,MAX",
                   help="document tokens, uniform (default 8192,16384)")
    g.add_argument("--reuse-question-len", type=_range, default=None, metavar="MIN,MAX",
                   help="question tokens, uniform (default 64,256); answers: --output-len")
    g.add_argument("--reuse-rate", type=positive_float, default=None,
                   help="Poisson arrivals of users, per second (default 0.5)")
    g.add_argument("--reuse-pool-bytes", type=positive_int, default=None,
                   help="the server's --prefix-cache-gpu-bytes (default 16 GiB)")
    g = p.add_argument_group("server capacity (both backends accept the same requests)")
    g.add_argument("--max-batch-size", type=positive_int, default=None,
                   help="minikv slots (default 64; HF batches by its own rule)")
    g.add_argument("--max-prompt-len", type=positive_int, default=None,
                   help="longest prompt (default: the longest the workload sends)")
    g.add_argument("--max-new-tokens", type=positive_int, default=None,
                   help="largest max_tokens (default: the output maximum)")
    g.add_argument("--max-queue", type=positive_int, default=None,
                   help="minikv waiting requests before 429 (default 1024)")
    g.add_argument("--preset", choices=sorted(CONFIG_PRESETS), default=None,
                   help="minikv: MiniKVConfig.preset(NAME) instead of the library's default config "
                        "(its parts land in --out like the default's: one folder per config)")
    g.add_argument("--prefill-ms", type=positive_float, default=None,
                   help="minikv ms of prefill between two decode steps (default 50)")
    g.add_argument("--data-parallel", type=positive_int, default=1,
                   help="minikv replicas, one GPU each, behind one front (default 1)")
    g.add_argument("--startup-timeout", type=positive_float, default=None,
                   help="seconds a worker may take to answer /health (default 420)")
    serve_worker.add_parser(sub)


def apply_presets(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill every option left unset from the preset (tiny, or full with the model's own
    lengths), then check the combination; a bad one exits 2 through ``parser.error``."""
    preset = dict(PRESETS["tiny" if args.tiny else "full"])
    model = args.model or preset["model"]
    if not args.tiny:
        preset.update(MODEL_PRESETS.get(model, {}))
    for key, value in preset.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    uses_long = "long" in args.phases
    if "reuse" in args.phases and (args.phases != ["reuse"] or args.backends != ["minikv"]):
        parser.error(f"--phases reuse: expected alone with --backends minikv (its server keeps "
                     f"a prefix cache, which would change the other phases), got phases "
                     f"{','.join(args.phases)} and backends {','.join(args.backends)}")
    if args.max_prompt_len is None:
        args.max_prompt_len = max(args.prompt_len[1], args.long_prompt)
        if "reuse" in args.phases:  # the last turn: the document, every question and answer
            args.max_prompt_len = max(args.max_prompt_len, _last_turn(args))
    if args.max_new_tokens is None:
        args.max_new_tokens = args.output_len[1]
    if args.prompt_len[1] > args.max_prompt_len:
        parser.error(f"--prompt-len: expected prompts up to --max-prompt-len="
                     f"{args.max_prompt_len}, got up to {args.prompt_len[1]}")
    if uses_long and args.long_prompt > args.max_prompt_len:
        parser.error(f"--long-prompt: expected at most --max-prompt-len={args.max_prompt_len}, "
                     f"got {args.long_prompt}")
    if args.output_len[1] > args.max_new_tokens:
        parser.error(f"--output-len: expected outputs up to --max-new-tokens="
                     f"{args.max_new_tokens}, got up to {args.output_len[1]}")
    if "reuse" in args.phases and _last_turn(args) > args.max_prompt_len:
        parser.error(f"--max-prompt-len: expected room for phase reuse's last turn (the "
                     f"longest document, {args.reuse_turns} questions and answers: "
                     f"{_last_turn(args)} tokens), got {args.max_prompt_len}")
    if args.min_requests > args.requests:
        parser.error(f"--min-requests: expected at most --requests={args.requests}, "
                     f"got {args.min_requests}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device is available here (use --device auto)")


def _last_turn(args) -> int:
    """Tokens of phase reuse's longest prompt: the longest document, then every question and
    answer at their longest."""
    return (args.reuse_doc_len[1]
            + args.reuse_turns * (args.reuse_question_len[1] + args.output_len[1]))


# -- the worker process -----------------------------------------------------------------------


class WorkerFailed(Exception):
    """A worker that exited, failed its warm-up or did not answer in time."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    """``python -m minikv_compile.perf serve-worker`` for one backend, its output in ``log``."""

    def __init__(self, backend: str, args, log: Path):
        self.backend, self.log = backend, log
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [sys.executable, "-m", "minikv_compile.perf", "serve-worker",
                     "--backend", backend, "--model", args.model, "--port", str(self.port),
                     "--device", args.device, "--max-batch-size", str(args.max_batch_size),
                     "--max-prompt-len", str(args.max_prompt_len),
                     "--max-new-tokens", str(args.max_new_tokens),
                     "--max-queue", str(args.max_queue), "--prefill-ms", str(args.prefill_ms),
                     "--data-parallel", str(args.data_parallel)]
        if "reuse" in args.phases:
            self.argv += ["--prefix-cache-gpu-bytes", str(args.reuse_pool_bytes)]
        if args.preset is not None and backend == "minikv":
            self.argv += ["--preset", args.preset]
        self.proc: Optional[subprocess.Popen] = None

    def start(self, timeout: float) -> float:
        """Start the worker and wait for ``/health`` 200; the seconds it took."""
        import httpx

        t0 = time.perf_counter()
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT)
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise WorkerFailed(f"the {self.backend} worker exited with status "
                                   f"{self.proc.returncode}: {self.tail()}")
            try:
                r = httpx.get(self.url + "/health", timeout=2.0)
                if r.status_code == 200:
                    return time.perf_counter() - t0
                if r.status_code == 503 and r.json().get("status") == "failed":
                    raise WorkerFailed(f"the {self.backend} worker failed: {r.json().get('error')}")
            except (httpx.TransportError, ValueError):
                pass
            time.sleep(0.3)
        raise WorkerFailed(f"the {self.backend} worker did not answer ready in {timeout:.0f} s: "
                           f"{self.tail()}")

    def info(self) -> Dict[str, object]:
        import httpx

        return httpx.get(self.url + "/info", timeout=30.0).json()

    def metrics(self) -> Optional[Dict[str, float]]:
        """The server's /metrics samples by name (labels included), None if it does not answer."""
        import httpx

        try:
            text = httpx.get(self.url + "/metrics", timeout=5.0).text
        except httpx.HTTPError:
            return None
        samples = (line.partition(" ") for line in text.splitlines()
                   if line and not line.startswith("#"))
        return {name: float(value) for name, _, value in samples}

    def busy(self) -> Optional[int]:
        """Requests the server still holds (its /metrics gauges), None if it cannot tell."""
        values = self.metrics()
        if values is None:
            return None
        return int(sum(values.get(name, 0.0) for name in
                       ("minikv_slots_in_use", "minikv_queue_depth", "hf_requests_in_flight")))

    def counters(self) -> Optional[Dict[str, object]]:
        """The engine's counters (``ENGINE_COUNTERS``) and, behind a data-parallel front,
        ``"replicas"``: each replica's ``REPLICA_COUNTERS`` by index; None for a server without
        them (HF's) or one that does not answer."""
        values = self.metrics()
        if values is None or not all(name in values for name in ENGINE_COUNTERS.values()):
            return None
        out: Dict[str, object] = {key: int(values[name]) for key, name in ENGINE_COUNTERS.items()}
        replicas: Dict[int, Dict[str, int]] = {}
        for key, name in REPLICA_COUNTERS.items():
            for sample, value in values.items():
                m = re.fullmatch(re.escape(name) + r'\{replica="(\d+)"\}', sample)
                if m:
                    replicas.setdefault(int(m.group(1)), {})[key] = int(value)
        if replicas:
            out["replicas"] = replicas
        return out

    def wait_idle(self, timeout: float = 30.0) -> bool:
        end = time.perf_counter() + timeout
        while time.perf_counter() < end:
            if self.busy() == 0:
                return True
            time.sleep(0.1)
        return False

    def tail(self, chars: int = 1500) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# -- a run ------------------------------------------------------------------------------------


def _gpu_slug(device: str) -> str:
    """The folder name ``measure.gpu_slug`` gives the worker's GPU, read through NVML so that
    this client process never creates a CUDA context (memory the servers would not have)."""
    if device == "cpu":
        return "cpu"
    try:
        import pynvml

        pynvml.nvmlInit()
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
    except Exception:  # no NVML, no GPU: the worker runs on the CPU
        return "cpu"
    from .measure import name_slug

    return name_slug(name.decode() if isinstance(name, bytes) else name)


class Bench:
    """One invocation: the backends one after the other, each over the phases asked for."""

    def __init__(self, args, argv: Sequence[str]):
        import torch

        from . import measure as M
        from .serve_report import PartStore

        self.args, self.M = args, M
        self.out = Path(args.out.replace("{gpu}", _gpu_slug(args.device)))
        self.store = PartStore(self.out)  # creates the folder (OSError: unwritable)
        self.argv = ["python -m minikv_compile.perf", *argv]
        self.t0 = time.perf_counter()
        self.deadline = self.t0 + args.budget_seconds
        # Versions and git of this process; the GPU's own record comes from each worker.
        self.environment = M.environment(torch.device("cpu"))
        self.workers: List[Worker] = []

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def say(self, text: str) -> None:
        print(f"[serve {time.perf_counter() - self.t0:.0f}/{self.args.budget_seconds:.0f}s] {text}",
              file=sys.stderr, flush=True)

    def run(self) -> None:
        backends = self.args.backends
        for i, backend in enumerate(backends):
            share_end = time.perf_counter() + self.left() / (len(backends) - i)
            self.backend(backend, share_end)

    def stop_workers(self) -> None:
        for w in self.workers:
            w.stop()

    # -- one backend ----------------------------------------------------------------------------

    def backend(self, backend: str, share_end: float) -> None:
        a = self.args
        log = self.out / "serve-logs" / f"{a.model}.{backend}.log"
        worker = Worker(backend, a, log)
        self.workers.append(worker)
        base = {"model": a.model, "backend": backend, "argv": self.argv,
                "environment": self.environment, "worker_argv": worker.argv,
                "worker_log": str(log.relative_to(self.out))}
        self.say(f"{backend}: starting the worker ({a.model}, log {log})")
        try:
            wait = min(a.startup_timeout, max(1.0, share_end - time.perf_counter()))
            startup = worker.start(wait)
            info = worker.info()
        except WorkerFailed as e:
            self.say(f"{backend}: {e}")
            worker.stop()
            for phase in a.phases:
                self.store.save({**base, "phase": phase, "status": "error", "reason": str(e)})
            return
        self.say(f"{backend}: ready in {startup:.1f} s")
        base.update(server=info, startup_s=startup)
        try:
            ctx = _Context(self, worker, base, info, share_end)
            ctx.warm_up()
            phases = list(a.phases)
            for k, phase in enumerate(phases):
                weights = sum(_WEIGHTS[p] for p in phases[k:])
                now = time.perf_counter()
                box_end = now + max(0.0, share_end - now) * _WEIGHTS[phase] / weights
                ctx.phase(phase, box_end)
        finally:
            worker.stop()


def first_unsustained(runs: List[Dict[str, object]], lo: Optional[float]) -> Optional[float]:
    """The lowest rate of ``runs`` that was not sustained above ``lo``, the highest sustained
    (None: any)."""
    return min((r["rate"] for r in runs if not r["sustained"] and (lo is None or r["rate"] > lo)),
               default=None)


def saturation(runs: List[Dict[str, object]], lo: Optional[float],
               stop: Optional[str]) -> Dict[str, object]:
    """A sweep's saturation: ``lo``, its highest sustained rate (None: none), the lowest
    unsustained rate above it, and how far the runs bound it. One window's p99 TTFT is noisy,
    so a rate can fail at or below one that passed: the bound then says so after its kind."""
    hi = first_unsustained(runs, lo)
    if lo is None:
        bound = "none sustained"
    elif hi is not None:
        bound = "between sustained and unsustained rates"
    elif stop and stop.startswith("output tokens/s"):
        bound = "throughput saturated"
    else:
        bound = "lower bound (no unsustained rate measured)"
    below = sorted({r["rate"] for r in runs if not r["sustained"] and lo is not None
                    and r["rate"] <= lo})
    if below:
        bound += (f"; not monotonic: {', '.join(f'{r:g}' for r in below)}/s unsustained at or "
                  f"below the sustained {lo:g}/s")
    return {"rate": lo, "first_unsustained": hi, "bound": bound, "stopped": stop}


class _Context:
    """One backend's worker during the phases: the workload, the clock, the parts."""

    def __init__(self, bench: Bench, worker: Worker, base: Dict[str, object],
                 info: Dict[str, object], share_end: float):
        from .serve_load import Workload

        a = bench.args
        self.bench, self.a, self.worker, self.base = bench, a, worker, base
        self.share_end = share_end
        self.words = bool(info["model"].get("synthetic_text"))  # one word per token
        self.workload = Workload(a.prompt_len[0], a.prompt_len[1], a.output_len[0], a.output_len[1],
                                 vocab=int(info["model"]["vocab"]), long_prompt=a.long_prompt,
                                 long_every=a.long_every, seed=a.seed)
        self.t1: Optional[float] = None       # a lone request's seconds (the sweep's start)
        self.t1_from: Optional[str] = None
        self.drain: Optional[float] = None    # the last run's seconds after its last arrival
        self.saturation: Optional[Dict[str, object]] = None

    def say(self, text: str) -> None:
        self.bench.say(f"{self.worker.backend}: {text}")

    # -- runs ---------------------------------------------------------------------------------

    def run(self, specs, arrivals, deadline_s: float, label: str, rate: Optional[float]):
        """One run: send, read, summarize; then wait until the server holds nothing."""
        from .serve_load import drive, run_async, summarize

        outcomes, start = run_async(drive(self.worker.url, specs, arrivals, deadline_s, self.words))
        row = summarize(outcomes, self.a.ttft_limit, rate)
        ends = [o._last for o in outcomes if o._last is not None]
        if ends and arrivals:
            self.drain = max(0.0, max(ends) - (start + max(arrivals)))
        row["per_request"] = [o.row() for o in outcomes]
        row["label"] = label
        row["idle_after"] = self.worker.wait_idle()
        self.say(f"{label}: {_line(row)}")
        return row

    def warm_up(self) -> None:
        """Two requests alone, not reported: the longest prompt the phases send, then the
        shortest, 16 tokens each (first-call costs, the allocator grown to a full prefill).
        They also estimate a lone request's time ``T1`` for when phase single does not run:
        the TTFT interpolated to the mean prompt plus the mean output at the short one's step."""
        a, w = self.a, self.workload
        longest = a.long_prompt if "long" in a.phases else a.prompt_len[1]
        tokens = min(16, a.output_len[0])
        rows = []
        for L in (longest, a.prompt_len[0]):
            spec = w.fixed(f"warm-up:{L}", L, tokens)
            rows.append(self.run([spec], [0.0], max(30.0, self.share_end - time.perf_counter()),
                                 f"warm-up L={L}", None))
        self.base["warm_up"] = [{"prompt_len": L, "max_tokens": tokens,
                                 **{k: r[k] for k in ("ttft_p50_s", "e2e_p50_s", "completed")}}
                                for L, r in zip((longest, a.prompt_len[0]), rows)]
        (long_row, short_row) = rows
        ttft_l, ttft_s = long_row.get("ttft_p50_s"), short_row.get("ttft_p50_s")
        itl = [x for r in short_row["per_request"] for x in r["itl_ms"]]
        if ttft_l is None or ttft_s is None or not itl:
            return
        mean_prompt = (a.prompt_len[0] + a.prompt_len[1]) / 2
        span = longest - a.prompt_len[0]
        slope = (ttft_l - ttft_s) / span if span else 0.0
        ttft = ttft_s + slope * (mean_prompt - a.prompt_len[0])
        mean_out = (a.output_len[0] + a.output_len[1]) / 2
        self.t1 = max(ttft, 0.0) + (mean_out - 1) * sum(itl) / len(itl) / 1e3
        self.t1_from = "the warm-up (TTFT at the mean prompt + the mean output at its step)"

    def phase(self, phase: str, box_end: float) -> None:
        left = box_end - time.perf_counter()
        self.say(f"phase {phase} ({left:.0f} s)")
        part = {**self.base, "phase": phase}
        try:
            if self.worker.proc.poll() is not None:
                raise WorkerFailed(f"the {self.worker.backend} worker exited with status "
                                   f"{self.worker.proc.returncode}: {self.worker.tail()}")
            before = self.worker.counters()
            getattr(self, f"_{phase}")(part, box_end)
            part.setdefault("status", "ok")
            after = self.worker.counters()
            if before is not None and after is not None:
                # what the phase cost the engine: every step replayed, nothing compiled or captured
                part["engine"] = {key: after[key] - before[key] for key in ENGINE_COUNTERS}
                if "replicas" in before and "replicas" in after:  # each replica's share
                    part["replicas"] = {
                        str(i): {k: now[k] - before["replicas"].get(i, {}).get(k, 0)
                                 for k in REPLICA_COUNTERS if k in now}
                        for i, now in sorted(after["replicas"].items())}
        except _Skip as e:
            part.update(status="skipped", reason=str(e))
            self.say(f"phase {phase} skipped: {e}")
        except WorkerFailed as e:
            part.update(status="error", reason=str(e))
            self.say(f"phase {phase}: {e}")
        self.bench.store.save(part)

    def _requests_for(self, rate: float) -> int:
        a = self.a
        return min(a.requests, max(a.min_requests, math.ceil(rate * a.rate_seconds)))

    def _poisson(self, rate: float, n: int, stream: str, box_end: float, long: bool = False):
        from .serve_load import poisson_arrivals

        specs = self.workload.requests(n, stream, long=long)
        arrivals = poisson_arrivals(n, rate, self.a.seed, stream)
        deadline = min(arrivals[-1] + self.a.drain_seconds, box_end - time.perf_counter())
        row = self.run(specs, arrivals, max(1.0, deadline), f"{stream} {rate:.3g}/s", rate)
        row["stream"] = stream
        row["cut_by_budget"] = (deadline < arrivals[-1] + self.a.drain_seconds
                                and row["cut"] + row["unsent"] > 0)
        return row

    # -- the phases ---------------------------------------------------------------------------

    def _single(self, part, box_end) -> None:
        from .serve_load import percentile

        a = self.a
        specs = self.workload.requests(a.single_requests, "single")
        rows = []
        for spec in specs:
            left = box_end - time.perf_counter()
            if rows and self.t1 and left < 1.5 * self.t1:
                break
            rows.append(self.run([spec], [0.0], max(5.0, left), f"single #{spec.index}", None))
        reqs = [r for row in rows for r in row["per_request"]]
        itl = [x for r in reqs for x in r["itl_ms"]]
        e2e = [r["e2e_s"] for r in reqs if r["e2e_s"] is not None]
        ttft = [r["ttft_s"] for r in reqs if r["ttft_s"] is not None]
        toks = sum(r["usage_tokens"] or r["tokens"] for r in reqs)
        if e2e:
            self.t1, self.t1_from = sum(e2e) / len(e2e), "single (mean end-to-end)"
        part["runs"] = rows
        # The step: each lone request's mean interval (last token - first) / (tokens - 1),
        # averaged; unlike the ITL p50 it does not shrink when chunks reach the client in bursts.
        steps = [sum(r["itl_ms"]) / len(r["itl_ms"]) for r in reqs if r["itl_ms"]]
        part["batch1"] = {"requests": len(reqs),
                          "completed": sum(r["status"] == "ok" for r in reqs),
                          "ttft_p50_s": percentile(ttft, 0.5), "itl_p50_ms": percentile(itl, 0.5),
                          "itl_p99_ms": percentile(itl, 0.99),
                          "step_ms": sum(steps) / len(steps) if steps else None,
                          "e2e_mean_s": self.t1 if e2e else None,
                          "tokens_per_s": toks / sum(e2e) if e2e else None,
                          "tokens_exact": bool(reqs) and all(
                              r["status"] == "ok"
                              and (r["usage_tokens"] or r["tokens"]) == r["max_tokens"]
                              for r in reqs)}

    def _start_rate(self, part) -> float:
        a = self.a
        if a.start_rate:
            part["start_rate_from"] = "--start-rate"
            return a.start_rate
        if self.t1 is None:
            earlier = self.bench.store.load(a.model, self.worker.backend, "single")
            e2e = ((earlier or {}).get("batch1") or {}).get("e2e_mean_s")
            if e2e:
                self.t1, self.t1_from = e2e, "single (an earlier run in this folder)"
        if self.t1 is None:
            raise _Skip("no lone request was timed (neither phase single nor the warm-up "
                        "completed): pass --start-rate or --rates")
        part["start_rate_from"] = f"2 / T1, T1 = {self.t1:.3g} s from {self.t1_from}"
        return 2.0 / self.t1

    def _sweep(self, part, box_end) -> None:
        a = self.a
        runs: List[Dict[str, object]] = []
        part["runs"] = runs
        lo: Optional[float] = None   # highest sustained rate
        stop = None

        def fits(rate: float) -> bool:
            n = self._requests_for(rate)
            expect = n / rate + (self.drain if self.drain is not None else 2 * (self.t1 or 1.0))
            return expect <= box_end - time.perf_counter()

        def measure(rate: float) -> Dict[str, object]:
            nonlocal lo
            row = self._poisson(rate, self._requests_for(rate), f"sweep-{len(runs)}", box_end)
            runs.append(row)
            if row["sustained"] and not row["cut_by_budget"]:
                lo = rate if lo is None else max(lo, rate)
            return row

        if a.rates:
            for rate in a.rates:
                if runs and not fits(rate):
                    stop = f"time budget: rate {rate:g}/s and later not run"
                    break
                measure(rate)
        else:
            rate = self._start_rate(part)
            previous = None
            while len(runs) < a.max_rates:
                if runs and not fits(rate):
                    stop = f"time budget: the next rate ({rate:.3g}/s) would not end in time"
                    break
                row = measure(rate)
                if not row["sustained"]:
                    if lo is None:
                        rate /= 2  # even the first rate was too much: go down
                        continue
                    stop = f"p99 TTFT over {a.ttft_limit:g} s at {rate:.3g}/s"
                    break
                before = (previous or {}).get("output_tokens_per_s")
                after = row["output_tokens_per_s"] or 0
                if before and after < 1.1 * before:
                    stop = (f"output tokens/s stopped growing ({before:.4g} at "
                            f"{previous['rate']:.3g}/s, {after:.4g} at {rate:.3g}/s)")
                    break
                previous, rate = row, rate * 2
            else:
                stop = stop or f"--max-rates {a.max_rates} reached"
            for _ in range(a.refine):
                hi = first_unsustained(runs, lo)
                if lo is None or hi is None or len(runs) >= a.max_rates + a.refine:
                    break
                rate = math.sqrt(lo * hi)
                if not fits(rate):
                    break
                measure(rate)
        self.saturation = saturation(runs, lo, stop)
        part["saturation"] = self.saturation
        self.say(f"saturation {lo if lo is None else f'{lo:.3g}/s'} "
                 f"({self.saturation['bound']}; {stop})")

    def _half_rate(self, part) -> float:
        a = self.a
        if a.half_rate:
            part["rate_from"] = "--half-rate"
            return a.half_rate
        sat = self.saturation
        source = "this run's sweep"
        if sat is None:
            earlier = self.bench.store.load(a.model, self.worker.backend, "sweep")
            sat = (earlier or {}).get("saturation")
            source = "the sweep of an earlier run in this folder"
        if not sat or not sat.get("rate"):
            raise _Skip("no saturation rate for this backend and model (run phase sweep first, "
                        "or pass --half-rate)")
        part["rate_from"] = f"half the saturation rate {sat['rate']:.4g}/s of {source}"
        part["saturation_rate"] = sat["rate"]
        return sat["rate"] / 2

    def _half(self, part, box_end) -> None:
        rate = self._half_rate(part)
        part["runs"] = [self._poisson(rate, self._requests_for(rate), "half", box_end)]

    def _long(self, part, box_end) -> None:
        rate = self._half_rate(part)
        a = self.a
        # At least two long prompts in the run, however low the rate.
        n = max(self._requests_for(rate), 2 * a.long_every)
        part["runs"] = [self._poisson(rate, n, "long", box_end, long=True)]
        part["long_prompt"], part["long_every"] = a.long_prompt, a.long_every

    def _offline(self, part, box_end) -> None:
        a = self.a
        specs = self.workload.requests(a.offline_requests, "offline")
        deadline = box_end - time.perf_counter()
        if deadline < 5.0:
            raise _Skip(f"time budget: {deadline:.0f} s left for it")
        row = self.run(specs, [0.0] * len(specs), deadline, "offline", None)
        row["cut_by_budget"] = row["cut"] > 0
        part["runs"] = [row]


    def _reuse(self, part, box_end) -> None:
        """Phase reuse: the same users twice on the same server, reuse off then on, arriving
        as a Poisson process (latency under load); then other users on other documents, all
        arriving at once, off then on (the sustained request rate: the server saturated)."""
        from .serve_load import (_spec, conversations, drive_conversations, poisson_arrivals,
                                 run_async, summarize)

        a = self.a
        if not self.words:
            raise _Skip("the answers' ids are read back from the synthetic text: a random "
                        "shape's (token i reads ' i'), not a real tokenizer's")
        loads = {}
        for load in ("poisson", "burst"):
            documents, users = conversations(
                a.reuse_users, a.reuse_turns, a.reuse_docs, a.reuse_doc_len,
                a.reuse_question_len, a.output_len, self.workload.vocab, a.seed,
                "reuse" if load == "poisson" else "reuse-burst")
            arrivals = (poisson_arrivals(len(users), a.reuse_rate, a.seed, "reuse")
                        if load == "poisson" else [0.0] * len(users))
            loads[load] = documents, users, arrivals
        part.update(users=a.reuse_users, turns=a.reuse_turns, docs=a.reuse_docs,
                    doc_lens=[len(d) for d in loads["poisson"][0]],
                    burst_doc_lens=[len(d) for d in loads["burst"][0]], user_rate=a.reuse_rate,
                    pool_bytes_limit=a.reuse_pool_bytes)
        plan = [(load, reuse) for load in ("poisson", "burst") for reuse in (False, True)]
        runs = []
        for k, (load, reuse) in enumerate(plan):
            documents, users, arrivals = loads[load]
            label = f"reuse {'on' if reuse else 'off'}, {load}"
            end = time.perf_counter() + (box_end - time.perf_counter()) / (len(plan) - k)
            extra = None if reuse else {"minikv": {"prefix_cache": False}}
            uploads = [_spec(i, list(d), 1, False, extra) for i, d in enumerate(documents)]
            self.run(uploads, [0.0] * len(uploads), max(5.0, end - time.perf_counter()),
                     f"{label}: the documents' uploads", None)
            before = self.worker.metrics() or {}
            deadline = max(1.0, end - time.perf_counter())
            outcomes, _ = run_async(drive_conversations(self.worker.url, documents, users,
                                                        arrivals, deadline, reuse))
            row = summarize(outcomes, a.ttft_limit, None)
            row["idle_after"] = self.worker.wait_idle()
            after = self.worker.metrics() or {}
            delta = lambda name: after.get(name, 0.0) - before.get(name, 0.0)  # noqa: E731
            prompt = sum(o.prompt_len for o in outcomes if o.cached_tokens is not None)
            cached = sum(o.cached_tokens or 0 for o in outcomes)
            row.update(label=label, load=load, reuse=reuse,
                       per_request=[o.row() for o in outcomes],
                       prompt_tokens=prompt, cached_tokens=cached,
                       hit_rate=cached / prompt if prompt else None,
                       pool_queries=delta("minikv_prefix_cache_queries_total"),
                       pool_hits=delta("minikv_prefix_cache_hits_total"),
                       pool_evictions=delta("minikv_prefix_cache_evictions_total"),
                       pool_bytes=after.get('minikv_prefix_cache_bytes{tier="device"}'),
                       pool_entries=after.get("minikv_prefix_cache_entries"),
                       cut_by_budget=row["cut"] + row["unsent"] > 0)
            for key, name in (("server_ttft_mean_s", "minikv_time_to_first_token_seconds"),
                              ("server_queue_mean_s", "minikv_request_queue_seconds"),
                              ("server_prefill_mean_s", "minikv_request_prefill_seconds")):
                n = delta(f"{name}_count")  # the server's own account of the first tokens
                row[key] = delta(f"{name}_sum") / n if n else None
            self.say(f"{label}: {_line(row)}; {_g(row['requests_per_s'])} requests/s; hit rate "
                     f"{_pct(row['hit_rate'])}, pool {_mib(row['pool_bytes'])} in "
                     f"{row['pool_entries']} contexts; the server's mean TTFT "
                     f"{_g(row['server_ttft_mean_s'])} s = queue {_g(row['server_queue_mean_s'])}"
                     f" + prefill {_g(row['server_prefill_mean_s'])} + the first step")
            runs.append(row)
        part["runs"] = runs
        off, on, burst_off, burst_on = runs

        def ratio(num, den, key):
            return num[key] / den[key] if num.get(key) and den.get(key) else None

        part["reuse"] = {"ttft_p50_on_over_off": ratio(on, off, "ttft_p50_s"),
                         "ttft_p99_on_over_off": ratio(on, off, "ttft_p99_s"),
                         "output_tokens_per_s_on_over_off": ratio(on, off,
                                                                  "output_tokens_per_s"),
                         "itl_p99_ms_on": on.get("itl_p99_ms"),
                         "requests_per_s_on_over_off_burst": ratio(burst_on, burst_off,
                                                                   "requests_per_s"),
                         "itl_p99_ms_on_burst": burst_on.get("itl_p99_ms")}
        table = ["| load | reuse | TTFT p50 s | TTFT p99 s | ITL p99 ms | out tok/s | "
                 "requests/s | completed | hit rate | pool MiB | contexts |",
                 "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in runs:
            table.append(f"| {r['load']} | {'on' if r['reuse'] else 'off'} | "
                         f"{_g(r['ttft_p50_s'])} | {_g(r['ttft_p99_s'])} | "
                         f"{_g(r['itl_p99_ms'])} | {_g(r['output_tokens_per_s'])} | "
                         f"{_g(r['requests_per_s'])} | {r['completed']}/{r['requests']} | "
                         f"{_pct(r['hit_rate'])} | {_mib(r['pool_bytes'])} | "
                         f"{_g(r['pool_entries'])} |")
        part["table"] = table
        print("\n".join(table), file=sys.stderr, flush=True)


def _g(v) -> str:
    return "–" if v is None else f"{v:.4g}"


def _pct(v) -> str:
    return "–" if v is None else f"{100 * v:.1f}%"


def _mib(v) -> str:
    return "–" if v is None else f"{v / 2**20:.1f} MiB"


class _Skip(Exception):
    pass


def _line(row: Dict[str, object]) -> str:
    def f(key, fmt):
        v = row.get(key)
        return "–" if v is None else fmt.format(v)
    return (f"{row['completed']}/{row['requests']} ok, {row['refused']} refused, "
            f"{row['errors']} errors, {row['cut'] + row['unsent']} cut; TTFT p50 "
            f"{f('ttft_p50_s', '{:.3g}')} p99 {f('ttft_p99_s', '{:.3g}')} s; ITL p50 "
            f"{f('itl_p50_ms', '{:.3g}')} p99 {f('itl_p99_ms', '{:.3g}')} ms; "
            f"{f('output_tokens_per_s', '{:.4g}')} tok/s"
            + ("" if row.get("rate") is None else f"; sustained {row['sustained']}"))


def main(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str]) -> int:
    """``serve`` / ``serve-worker``; bad arguments exit 2 through ``parser.error``."""
    if args.command == "serve-worker":
        from . import serve_worker

        return serve_worker.main(args)
    apply_presets(parser, args)
    from .serve_report import rebuild

    try:
        bench = Bench(args, argv)
    except OSError as e:
        parser.error(f"--out: cannot write reports to {args.out!r} ({e.strerror or e})")
    if "minikv" in args.backends:  # parts are named by model, backend and phase, not config
        other = {_preset_of(part.get("worker_argv") or []) for part in bench.store.parts()
                 if part.get("backend") == "minikv"} - {args.preset}
        if other:
            name = lambda p: "the default config" if p is None else f"preset {p!r}"  # noqa: E731
            parser.error(f"--preset: {bench.out} holds parts of this engine with "
                         f"{', '.join(sorted(map(name, other)))}, expected {name(args.preset)} "
                         f"(one --out folder per config)")
    previous = signal.signal(signal.SIGTERM, _interrupt)
    code = 0
    try:
        bench.run()
    except KeyboardInterrupt:
        bench.say("interrupted")
        code = 130
    finally:
        bench.stop_workers()
        signal.signal(signal.SIGTERM, previous)
        written, message = rebuild(bench.out)
        print(f"[serve] wrote {', '.join(str(p) for p in written)}"
              + (f"; {message}" if message else ""), file=sys.stderr)
    return code


def _preset_of(worker_argv: Sequence[str]) -> Optional[str]:
    """The ``--preset`` a worker was started with (None: the library's default config)."""
    return worker_argv[worker_argv.index("--preset") + 1] if "--preset" in worker_argv else None


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")

