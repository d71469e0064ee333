"""The command line: flags, the model's loading, the engine and scheduler built, then served."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
from pathlib import Path
from typing import List, Optional, Tuple

import torch

from minikv_compile.models.parallel import join_torchrun

from ..config import BY_BITS, PRESETS, RESYNCS, MiniKVConfig
from ..inputs import check_int
from ..ranks import follow
from ..scheduler import Scheduler, check_prefix_cache
from .app import create_app
from .security import ServeOptions, allowed_hosts
from .cache import use_compile_cache
from .parallel import RANK_TIMEOUT_S, leave_ranks
from .replicas import plan_replicas, serve_front
from .server import run_server

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_log = logging.getLogger("minikv_compile.serve")


def parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: the data-parallel front rewrites its replicas' flags by their full
    # names (TLS flags dropped, --host / --port its own), which an abbreviation would slip past
    p = argparse.ArgumentParser(
        prog="python -m minikv_compile.serve", allow_abbrev=False,
        description="An OpenAI-compatible server (completions and chat, streaming) over a "
                    "MiniKV-compressed, CUDA-graph-replayed engine.")
    p.add_argument("--model", required=True,
                   help="a local HF model directory, or 'smollm2' (SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients pass as 'model' (default: --model as given)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="default: cuda when available, else cpu")
    p.add_argument("--dtype", choices=tuple(_DTYPES), default=None,
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--data-parallel", type=int, default=1, metavar="N",
                   help="N replicas of the engine, each a server process on its own GPUs "
                        "(--tensor-parallel of them), behind this one (default: 1)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting for a slot at most, beyond those the free slots "
                        "take; past it, 429 (default: 64)")
    sched = p.add_argument_group("Scheduler", "how prompts are admitted between decode steps")
    sched.add_argument("--prefill-ms", type=float, default=50.0, metavar="MS",
                       help="milliseconds of prefill (whole layers, at least one) between two "
                            "decode steps while other requests stream (default: 50)")
    sched.add_argument("--prefill-layers", type=int, default=None, metavar="INT",
                       help="and at most this many layers (default: no limit)")
    sched.add_argument("--prefill-batch-tokens", type=int, default=2048, metavar="INT",
                       help="waiting prompts are prefilled in one pass up to this many tokens "
                            "together (default: 2048)")
    sched.add_argument("--prefill-batch-requests", type=int, default=8, metavar="INT",
                       help="and at most this many prompts a pass (default: 8)")
    reuse = p.add_argument_group("Prefix cache", "compressed contexts kept after a request "
                                 "(its prompt; a chat's prompt and answer) and reused by the "
                                 "requests whose prompts start with them")
    reuse.add_argument("--prefix-cache-gpu-bytes", type=int, default=0, metavar="INT",
                       help="device bytes of kept contexts, beside the slots' cache (start-up "
                            "checks the longest prompt fits with them full); least recently "
                            "used out first; 0: no reuse (default: 0)")
    reuse.add_argument("--prefix-cache-host-bytes", type=int, default=0, metavar="INT",
                       help="host memory for contexts evicted from the device, moved back on "
                            "a hit (default: 0, none)")
    reuse.add_argument("--prefix-cache-dir", default=None, metavar="DIR",
                       help="contexts also saved there as PromptCache files and loaded on a "
                            "miss, so that a restarted server reuses them (not bounded: the "
                            "folder is yours to clean; default: none)")
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="where torch.compile and Triton keep their compiled artifacts and the "
                        "engine its compiled decode step, so that a restart compiles nothing "
                        "(default: $TORCHINDUCTOR_CACHE_DIR "
                        "if set, else compile/ in the project's cache folder, $MINIKV_CACHE or "
                        "~/.cache/minikv_compile)")
    _door_flags(p)
    group = p.add_argument_group("MiniKVConfig", "the engine's fields (see MiniKVConfig)")
    group.add_argument("--preset", choices=sorted(PRESETS), default=None,
                       help="MiniKVConfig.preset(NAME) instead of the library's default "
                            "config, the field flags on top ('minikv': the MiniKV paper's)")
    for f in dataclasses.fields(MiniKVConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name in BY_BITS:  # None: chosen by --bits
            low_bits, full = BY_BITS[f.name]
            group.add_argument(flag, dest=f.name, type=type(low_bits), default=None,
                               metavar=type(low_bits).__name__.upper(),
                               help=f"default: {low_bits}, or {full} with --bits 16")
        elif f.name == "recall_resync":
            group.add_argument(flag, dest=f.name, choices=RESYNCS, default=None,
                               help="after a missed guess of the next token, one step puts "
                                    "recall's speculation back in phase: for greedy requests, "
                                    "for all, or off (the paper's). Default: greedy with recall "
                                    "(--recall-top-k above 0), off without")
        elif f.default is None:  # compile, cuda_graphs: None lets the engine choose by device
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=None, help="default: on for CUDA, off on the CPU")
        else:
            group.add_argument(flag, dest=f.name, type=type(f.default), default=None,
                               metavar=type(f.default).__name__.upper(),
                               help=f"default: {f.default}")
    return p


def _load(model: str, device: str, dtype: torch.dtype, tensor_parallel: int):
    """(model, tokenizer): ``smollm2`` or a local HF model directory; with several ranks, this
    rank's shard of a directory's checkpoint, read alone (``models.load_shard``)."""
    if model == "smollm2":
        from minikv_compile.models.smollm2 import load_smollm2
        return load_smollm2(dtype=dtype, device=device)
    if not Path(model).is_dir():
        raise ValueError(f"--model: expected a local HF model directory or 'smollm2', got "
                         f"{model!r}")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model)
    if tensor_parallel > 1:
        from minikv_compile.models import TensorParallel, load_shard
        return load_shard(model, TensorParallel.from_default_group(tensor_parallel), device,
                          dtype), tokenizer
    hf_model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
    return hf_model.to(device).eval(), tokenizer


def engine_config(args: argparse.Namespace) -> MiniKVConfig:
    """The flags' config: ``--preset``'s (or the library's default) with every field flag given
    on top."""
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(MiniKVConfig)
              if getattr(args, f.name) is not None}
    return MiniKVConfig.preset(args.preset, **fields)


def main(argv: Optional[List[str]] = None) -> int:
    """Parse the flags, build the engine, listen, warm up in the background, serve."""
    from ..engine import minikv_compile

    flags = parser()
    args = flags.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = _DTYPES[args.dtype or ("bfloat16" if device == "cuda" else "float32")]
    try:
        config = engine_config(args)
        check_int("--max-queue", args.max_queue, lo=1)
        check_int("--port", args.port, lo=0, hi=65535)
        for flag in ("prefill_batch_tokens", "prefill_batch_requests", "prefill_layers"):
            if getattr(args, flag) is not None:  # before the model loads, not after
                check_int("--" + flag.replace("_", "-"), getattr(args, flag), lo=1)
        for flag in ("prefix_cache_gpu_bytes", "prefix_cache_host_bytes"):
            check_int("--" + flag.replace("_", "-"), getattr(args, flag), lo=0)
        # on every rank, before any waits for another (rank 0 alone refusing it later would
        # leave the others in a collective)
        check_prefix_cache(args.prefix_cache_gpu_bytes, args.prefix_cache_dir,
                           config.tensor_parallel)
        if not args.prefill_ms > 0:
            raise ValueError(f"--prefill-ms: expected a positive number, got {args.prefill_ms}")
        options, tls = _door_options(args)
        if args.data_parallel != 1:  # this process is the front alone (serve/replicas.py)
            check_int("--data-parallel", args.data_parallel, lo=1)
            replicas = plan_replicas(sys.argv[1:] if argv is None else argv, args.data_parallel,
                                     config.tensor_parallel, device,
                                     slots=config.max_batch_size, api_key=args.api_key)
            return serve_front(replicas, args.host, args.port, options,
                               keep_alive=args.timeout_keep_alive, **tls)
        use_compile_cache(args.compile_cache)
        if config.tensor_parallel > 1:
            n = config.tensor_parallel
            device = str(join_torchrun(f"--tensor-parallel {n}", n, device.startswith("cuda"),
                                       RANK_TIMEOUT_S))
        model, tokenizer = _load(args.model, device, dtype, config.tensor_parallel)
        engine = minikv_compile(model, config)
        if engine.adapter.tp.rank != 0:  # rank 0 serves; this rank makes its calls
            # torchrun's SIGTERM (and a terminal's Ctrl-C, SIGINT) reaches every rank at once:
            # this one ends when rank 0, shutting down, sends its stop (ended now, it would fail
            # rank 0's last collective)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            follow(engine)
            leave_ranks(0)
        _log.info("%s", _memory_line(engine))
        scheduler = Scheduler(engine, tokenizer, max_queue=args.max_queue,
                              prefill_ms=args.prefill_ms, prefill_layers=args.prefill_layers,
                              prefill_batch_tokens=args.prefill_batch_tokens,
                              prefill_batch_requests=args.prefill_batch_requests,
                              prefix_cache_gpu_bytes=args.prefix_cache_gpu_bytes,
                              prefix_cache_host_bytes=args.prefix_cache_host_bytes,
                              prefix_cache_dir=args.prefix_cache_dir)
    except (ValueError, NotImplementedError) as e:
        flags.error(str(e))
    name = args.served_model_name or args.model
    app = create_app(scheduler, tokenizer, name, config, options)
    status = run_server(app, scheduler, name, args.host, args.port,
                        read_timeout=args.request_read_timeout,
                        keep_alive=args.timeout_keep_alive, **tls)
    if config.tensor_parallel > 1:
        leave_ranks(status)
    return status


def _door_flags(p: argparse.ArgumentParser) -> None:
    door = p.add_argument_group("Security and limits", "what a request must carry and how "
                                "much of it the server reads (see serve/security.py)")
    door.add_argument("--api-key", default=os.environ.get("MINIKV_API_KEY"), metavar="KEY",
                      help="every /v1/* request must carry 'Authorization: Bearer KEY' (else "
                           "401); /health and /metrics stay open (default: $MINIKV_API_KEY, "
                           "else no key)")
    door.add_argument("--allowed-origins", nargs="+", default=(), metavar="ORIGIN",
                      help="browser origins (https://app.example:443) allowed to call the "
                           "server, with CORS; '*' for any (default: none, a request with an "
                           "Origin header is refused)")
    door.add_argument("--allowed-hosts", nargs="+", default=(), metavar="HOST",
                      help="Host header names accepted besides the bound address (and "
                           "localhost when it is a loopback one); '*' turns the check off "
                           "(default: none; bound to 0.0.0.0 or :: with none given, no check)")
    door.add_argument("--max-body-bytes", type=int, default=None, metavar="INT",
                      help="a larger request body is answered 413 before it is read whole "
                           "(default: a prompt of max-prompt-len tokens at 12 bytes a "
                           "character of the tokenizer's longest token, + 64 KiB)")
    door.add_argument("--request-read-timeout", type=float, default=20.0, metavar="S",
                      help="seconds a client has to send a request's header (from when it "
                           "connected or its last answer), and then its body; past it, the "
                           "connection is closed (default: 20)")
    door.add_argument("--timeout-keep-alive", type=float, default=5.0, metavar="S",
                      help="an idle connection is closed this long after its last answer "
                           "(default: 5)")
    door.add_argument("--ssl-keyfile", default=None, metavar="PEM",
                      help="serve HTTPS with this private key (with --ssl-certfile)")
    door.add_argument("--ssl-certfile", default=None, metavar="PEM",
                      help="and this certificate chain")
    door.add_argument("--parse-special-tokens", action=argparse.BooleanOptionalAction,
                      default=False,
                      help="chat message content with special-token text (<|im_start|>...) "
                           "tokenized as control tokens, as HF's apply_chat_template does (a "
                           "user message can then forge a turn). Default: off, such text is "
                           "tokenized as text; content without it gets HF's ids either way")


def _memory_line(engine) -> str:
    """The cache's allocation at start-up (``KVMemoryReport.allocation``): the device's bytes
    and, with recall, the pinned host copy's, sized at construction (which refuses a host that
    cannot hold it). With tensor parallel: rank 0's shard, as much again on every other rank."""
    cfg, world = engine.config, engine.adapter.tp.world
    line = (f"KV cache: {cfg.max_batch_size} slots of {cfg.max_prompt_len} + "
            f"{cfg.max_new_tokens} tokens, {engine.kv_memory().allocation()}")
    if world > 1:
        line += f" (rank 0's shard; each of the {world} ranks allocates as much)"
    return line


def _door_options(args) -> Tuple[ServeOptions, dict]:
    """(the app's ``ServeOptions``, uvicorn's TLS arguments) of the flags, checked."""
    for flag in ("request_read_timeout", "timeout_keep_alive"):
        value = getattr(args, flag)
        if not 0 < value <= 3600:
            raise ValueError(f"--{flag.replace('_', '-')}: expected seconds in (0, 3600], got "
                             f"{value}")
    if args.max_body_bytes is not None:
        check_int("--max-body-bytes", args.max_body_bytes, lo=1024)
    if args.api_key is not None and not (args.api_key and args.api_key.isprintable()
                                         and " " not in args.api_key):
        raise ValueError("--api-key: expected a non-empty key without spaces or control "
                         "characters, got one with them (or an empty one)")
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ValueError(f"--ssl-keyfile, --ssl-certfile: expected both or neither, got "
                         f"{'--ssl-keyfile' if args.ssl_keyfile else '--ssl-certfile'} alone")
    for flag in ("ssl_keyfile", "ssl_certfile"):
        path = getattr(args, flag)
        if path is not None and not Path(path).is_file():
            raise ValueError(f"--{flag.replace('_', '-')}: expected a PEM file, got {path!r} "
                             f"(no such file)")
    options = ServeOptions(api_key=args.api_key, allowed_origins=tuple(args.allowed_origins),
                           allowed_hosts=allowed_hosts(args.host, args.allowed_hosts),
                           max_body_bytes=args.max_body_bytes,
                           read_timeout=args.request_read_timeout,
                           parse_special_tokens=args.parse_special_tokens)
    _log.info("chat message content: special tokens %s", "parsed (--parse-special-tokens)"
              if options.parse_special_tokens else "tokenized as text")
    return options, {"ssl_keyfile": args.ssl_keyfile, "ssl_certfile": args.ssl_certfile}
