"""Measurement machinery of ``python -m minikv_compile.perf``.

What lives here, in reading order:

- model shapes (random weights of real shapes, built straight on the target device) and the real
  SmolLM2-135M-Instruct where it is available offline;
- the compared methods and one runner per kind (HF ``generate`` with ``DynamicCache`` or
  ``StaticCache``, this engine under a ``MiniKVConfig``), all driven through the same calls;
- timing helpers: decode ms/token without host syncs, streamed per-token latency, prefill;
- the memory side: the allocator's peak beside the NVML sampler, predicted per-sequence bytes;
- the physical floor: weight and KV bytes read per step (over the copy bandwidth of
  ``measure.copy_bandwidth``, measured in the same run);
- the budget clock.

Timing primitives, the copy bandwidth, NVML and the environment record live in ``measure``.

Only the public API of ``minikv_compile`` is used (plus ``models.smollm2.load_smollm2`` for the
real model); HF baselines are what a user would run, not re-implementations.
"""
from __future__ import annotations

import gc
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch
from transformers.generation.streamers import BaseStreamer

from minikv_compile import MiniKVConfig, minikv_compile
from minikv_compile.config import PRESETS
from minikv_compile.graphs import budget

from .measure import NvmlSampler, Skip

# -- model shapes -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """A Llama-family shape; ``config`` holds ``LlamaConfig`` keyword arguments.

    RoPE base and scaling are left at their defaults: they change no tensor shape and no
    timing. ``max_position_embeddings`` is raised so long prompts are accepted.
    """

    name: str
    description: str
    config: Dict[str, object] = field(default_factory=dict)
    real: bool = False


SHAPES: Dict[str, ModelShape] = {
    shape.name: shape
    for shape in (
        ModelShape("llama3.1-8b", "Llama-3.1-8B shape: 32 layers, 32 q / 8 KV heads (GQA), head dim 128",
                   dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                        head_dim=128, max_position_embeddings=131072, tie_word_embeddings=False)),
        ModelShape("llama3.1-70b", "Llama-3.1-70B shape: 80 layers, 64 q / 8 KV heads (GQA), head dim 128",
                   dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                        head_dim=128, max_position_embeddings=131072, tie_word_embeddings=False)),
        ModelShape("llama2-7b", "Llama-2-7B shape: 32 layers, 32 heads (MHA), head dim 128",
                   dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                        head_dim=128, max_position_embeddings=131072, tie_word_embeddings=False)),
        ModelShape("smollm2-135m", "SmolLM2-135M shape: 30 layers, 9 q / 3 KV heads (GQA), head dim 64",
                   dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                        head_dim=64, max_position_embeddings=131072, tie_word_embeddings=True)),
        ModelShape("smollm2-135m-real", "SmolLM2-135M-Instruct, real weights (GGUF Q4_1, dequantized)",
                   real=True),
        # CPU plumbing runs: 2 layers, GQA 4/2, head dim 16 (one quantization group).
        ModelShape("tiny", "tiny random Llama: 2 layers, 4 q / 2 KV heads, head dim 16",
                   dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        max_position_embeddings=8192, tie_word_embeddings=False)),
    )
}


def smollm2_available() -> Optional[str]:
    """None when the real SmolLM2 can be loaded without the network, else the reason it cannot."""
    from minikv_compile.models.smollm2 import default_cache_root

    if os.environ.get("MINIKV_SMOLLM2_GGUF"):
        return None
    if (default_cache_root() / "smollm2-135m-instruct" / "config.json").is_file():
        return None
    return ("SmolLM2-135M-Instruct not available offline: set MINIKV_SMOLLM2_GGUF to the .gguf "
            "or MINIKV_CACHE to a folder holding smollm2-135m-instruct/")


def build_model(shape_name: str, device: torch.device, dtype: torch.dtype):
    """The model for ``shape_name`` on ``device`` in ``dtype``, in eval mode, greedy, no eos.

    Random-weight shapes are created directly on the device (a 16 GB model never touches host
    memory). Generation is fixed-length: the eos id is cleared so every method produces exactly
    the tokens asked for.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig

    shape = SHAPES[shape_name]
    if shape.real:
        reason = smollm2_available()
        if reason:
            raise Skip(reason)
        from minikv_compile.models.smollm2 import load_smollm2

        model, _ = load_smollm2(dtype=dtype, device=device)
    else:
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(LlamaConfig(**shape.config), dtype=dtype)
    model.eval()
    gen = model.generation_config
    gen.eos_token_id = None
    gen.pad_token_id = 0
    gen.do_sample = False
    return model


def meta_model(model_or_shape):
    """A weightless copy (``meta`` device) of a model's architecture, for byte counting."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = (LlamaConfig(**SHAPES[model_or_shape].config) if isinstance(model_or_shape, str)
              else model_or_shape.config)
    dtype = torch.bfloat16 if isinstance(model_or_shape, str) else next(model_or_shape.parameters()).dtype
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def model_summary(model) -> Dict[str, object]:
    """Shape facts and weight bytes (all parameters, and those a decode step reads)."""
    cfg = model.config
    params = list(model.parameters())  # shared (tied) parameters appear once
    all_bytes = sum(p.numel() * p.element_size() for p in params)
    emb_in, emb_out = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    tied = emb_in.data_ptr() == emb_out.data_ptr() if emb_in.device.type != "meta" else emb_in is emb_out
    # A step reads B rows of the input embedding, not the table; a tied table is read as lm_head.
    read = all_bytes if tied else all_bytes - emb_in.numel() * emb_in.element_size()
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return {
        "layers": cfg.num_hidden_layers, "q_heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
        "hidden": cfg.hidden_size, "intermediate": cfg.intermediate_size, "vocab": cfg.vocab_size,
        "tied_embeddings": bool(tied), "dtype": str(params[0].dtype).replace("torch.", ""),
        "parameters": sum(p.numel() for p in params),
        "weight_bytes": all_bytes, "weight_bytes_read_per_step": read,
    }


def make_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """(batch, length) int64 on the CPU: the same random prompts for every method."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + length)
    return torch.randint(3, vocab, (batch, length), generator=g)


# -- methods ------------------------------------------------------------------------------------

ENGINE_METHODS: Dict[str, Dict[str, object]] = {
    "full": dict(bits=16, heavy_budget=1.0, recent_budget=1.0),
    "kivi": PRESETS["kivi"],
    # the paper's MiniKV, every field named (the library's default keeps every token)
    "minikv": PRESETS["minikv"],
    "minikv-pyramid": {**PRESETS["minikv"], "budget_policy": "pyramid"},
    # SpeCache: the same GPU copies, 64 positions per KV head recalled from host memory
    "kivi-specache": PRESETS["specache"],
    "minikv-specache": {**PRESETS["snapkv"], "recall_top_k": 64},
    # the same 64 positions ranked and read in blocks of 16 (a 16x shorter top-k)
    "kivi-specache-b16": {**PRESETS["specache"], "recall_block": 16},
    # group 64 + Hadamard + recall: the most accurate of the accuracy harness
    "kivi-g64-hadamard-specache": PRESETS["accurate"],
    # its GPU copy without recall, with and without the rotation, and the 1-bit copies
    "kivi-g64": {**PRESETS["kivi"], "group_size": 64},
    "kivi-g64-hadamard": {**PRESETS["kivi"], "group_size": 64, "rotation": "hadamard"},
    "kivi1-g64": {**PRESETS["kivi"], "bits": 1, "group_size": 64},
    "kivi1-g64-hadamard-specache": {**PRESETS["accurate"], "bits": 1},
    # keys grouped over 128 tokens (values over min(128, head dim)), with and without recall
    "kivi-g128-hadamard": {**PRESETS["kivi"], "group_size": 128, "rotation": "hadamard"},
    "kivi-g128-hadamard-specache": {**PRESETS["accurate"], "group_size": 128},
    # issue 47's candidates for the default beside "accurate": keys over 32 tokens (18.75% of
    # fp16's bytes by formula), or 128 positions recalled
    "kivi-g32-hadamard-specache": {**PRESETS["accurate"], "group_size": 32},
    "kivi-g64-hadamard-specache128": {**PRESETS["accurate"], "recall_top_k": 128},
}
HF_METHODS = ("hf-eager", "hf-static")
# Prefill-only comparator (the paper's Table 3): eager attention materializes L x L scores.
PREFILL_ONLY_METHODS = ("hf-eager-attn",)
METHODS = HF_METHODS + tuple(ENGINE_METHODS)
METHOD_LABELS = {
    "hf-eager": "HF eager, DynamicCache (SDPA)",
    "hf-static": "HF StaticCache + auto-compiled decode",
    "hf-eager-attn": "HF eager attention (materialized scores)",
    "full": "engine, full cache (16 bit)",
    "kivi": "engine, KIVI (2 bit, no eviction)",
    "minikv": "engine, MiniKV (2 bit, 25%/25%)",
    "minikv-pyramid": "engine, MiniKV-pyramid",
    "kivi-specache": "engine, KIVI + SpeCache (K 64)",
    "minikv-specache": "engine, preset snapkv (25%/25%) + SpeCache (K 64)",
    "kivi-specache-b16": "engine, KIVI + SpeCache (K 64 in blocks of 16)",
    "kivi-g64-hadamard-specache": "engine, KIVI group 64 + Hadamard + SpeCache (K 64)",
    "kivi-g64": "engine, KIVI group 64",
    "kivi-g64-hadamard": "engine, KIVI group 64 + Hadamard",
    "kivi1-g64": "engine, KIVI 1 bit, group 64",
    "kivi1-g64-hadamard-specache": "engine, KIVI 1 bit, group 64 + Hadamard + SpeCache (K 64)",
    "kivi-g128-hadamard": "engine, KIVI group 128 + Hadamard",
    "kivi-g128-hadamard-specache": "engine, KIVI group 128 + Hadamard + SpeCache (K 64)",
    "kivi-g32-hadamard-specache": "engine, KIVI group 32 + Hadamard + SpeCache (K 64)",
    "kivi-g64-hadamard-specache128": "engine, KIVI group 64 + Hadamard + SpeCache (K 128)",
}


def is_engine(method: str) -> bool:
    return method in ENGINE_METHODS


def engine_config(method: str, **capacity) -> MiniKVConfig:
    """The MiniKVConfig of an engine method with the given capacity / compile settings, the
    speculation's resync off: random weights guess the next token at random, so it would
    pre-decode every other step; the step is what these timings compare (the resync's steps
    per token are measured on the real model: ``perf/experiments/demo_resync.py``)."""
    return MiniKVConfig(**{"recall_resync": "off", **ENGINE_METHODS[method]}, **capacity)


def shape_fields(shape: str) -> Dict[str, object]:
    """Config fields a benchmark of a named config on ``shape`` sets beside the config's own:
    on random weights the speculation's resync off (as ``engine_config``), on real ones none."""
    return {} if SHAPES[shape].real else {"recall_resync": "off"}


@dataclass
class CallTiming:
    """One ``generate`` call: wall seconds (synchronized) and what the method itself reports."""

    wall_s: float
    new_tokens: int                         # tokens produced per sequence
    prefill_s: Optional[float] = None       # engine only
    decode_s: Optional[float] = None        # engine only
    decode_steps: Optional[int] = None      # engine only
    token_times: Optional[List[float]] = None  # streamed: seconds from the call's start per token


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class EngineRunner:
    """This engine for one method and one capacity (``max_batch_size`` x prompt + new tokens).

    ``compiled=False`` builds an eager engine (no torch.compile, no CUDA graphs): cheap to
    construct, used where only memory and prefill matter (probes of the max-prompt search).
    """

    def __init__(self, model, method: str, *, batch: int, prompt_len: int, new_tokens: int,
                 compiled: bool = True, tensor_parallel: int = 1):
        self.model, self.method = model, method
        self.device = next(model.parameters()).device
        self.prompt_len, self.new_tokens = prompt_len, new_tokens
        extra = {} if compiled else dict(compile=False, cuda_graphs=False)
        extra["tensor_parallel"] = tensor_parallel  # a shard of each rank (perf/bench_tp.py)
        self.config = engine_config(method, max_batch_size=batch, max_prompt_len=prompt_len,
                                    max_new_tokens=new_tokens, **extra)
        start = time.perf_counter()
        self.engine = minikv_compile(model, self.config)
        _sync(self.device)
        self.build_s = time.perf_counter() - start

    def setup_info(self) -> Dict[str, object]:
        """Compile and capture seconds of the construction, apart from any timed figure."""
        stats = self.engine.stats
        compile_s = sum(stats["compile_seconds"].values()) if stats["compile_seconds"] else None
        capture_total = sum(stats["capture_seconds"].values())
        return {"build_s": self.build_s, "compile_s": compile_s,
                # prepare() times compile + warm-up + capture together; the capture is the rest.
                "capture_s": max(0.0, capture_total - (compile_s or 0.0)) if capture_total else None,
                "compiles": stats["compiles"], "graphs": len(stats["graphs"])}

    def generate(self, prompts, n: int, stream: bool = False) -> CallTiming:
        """prompts: (B, L) int64 tensor, or a list of B token-id lists (any lengths)."""
        times: List[float] = []
        start = time.perf_counter()
        streamer = (lambda _tokens: times.append(time.perf_counter() - start)) if stream else None
        out = self.engine.generate(prompts, max_new_tokens=n, streamer=streamer,
                                   eos_token_id=[])  # exactly n tokens, as HFRunner
        wall = time.perf_counter() - start
        made = min(len(s) for s in out.sequences)
        if made != n:
            raise RuntimeError(f"{self.method}: expected {n} new tokens per sequence, got {made}")
        return CallTiming(wall, n, out.prefill_seconds, out.decode_seconds, out.decode_steps,
                          times if stream else None)

    def kv_bytes(self, prompt_len: Optional[int] = None) -> int:
        return self.engine.kv_memory(prompt_len or self.prompt_len, self.new_tokens).total_bytes

    def close(self) -> None:
        self.engine = None


class _Clock(BaseStreamer):
    """An HF streamer that only notes when each ``put`` arrives (the first put is the prompt)."""

    def __init__(self, start: float):
        self.start, self.times = start, []

    def put(self, value) -> None:
        self.times.append(time.perf_counter() - self.start)

    def end(self) -> None:
        pass


class HFRunner:
    """HF ``generate`` as users run it: ``hf-eager`` (DynamicCache, SDPA), ``hf-static``
    (a preallocated ``StaticCache``; transformers auto-compiles the decode step on CUDA with its
    default ``CompileConfig``: ``mode="reduce-overhead"``), ``hf-eager-attn`` (DynamicCache with
    ``attn_implementation="eager"``, which materializes the attention probabilities).

    For ``hf-static`` one cache of ``prompt_len + new_tokens`` is allocated per runner and reset
    between calls, so calls with different ``max_new_tokens`` reuse the compiled step.
    """

    def __init__(self, model, method: str, *, batch: int, prompt_len: int, new_tokens: int,
                 compiled: bool = True):
        from transformers import StaticCache

        self.model, self.method = model, method
        self.device = next(model.parameters()).device
        self.batch, self.prompt_len, self.new_tokens = batch, prompt_len, new_tokens
        self.compiled = compiled and method == "hf-static" and self.device.type == "cuda"
        # Rounded up to 64 positions, as a user would size it: SDPA's masked kernels want the
        # mask's last dim aligned, and the extra slots are never attended (they are masked).
        self.cache_len = -(-(prompt_len + new_tokens) // 64) * 64
        self.cache = (StaticCache(config=model.config, max_cache_len=self.cache_len)
                      if method == "hf-static" else None)
        self.build_s = 0.0
        self._kv_bytes: Optional[int] = None
        self._cache_used = False

    def setup_info(self) -> Dict[str, object]:
        # transformers compiles inside the first generate call; its cost is that call's warm_s.
        return {"build_s": self.build_s, "compile_s": None, "capture_s": None,
                "auto_compile": self.compiled}

    def _cache(self):
        from transformers import DynamicCache

        if self.cache is not None:
            if self._cache_used:  # a never-used cache is not initialized yet (lazy allocation)
                self.cache.reset()
            self._cache_used = True
            return self.cache
        try:
            return DynamicCache(config=self.model.config)
        except TypeError:  # older signature
            return DynamicCache()

    def generate(self, prompts: torch.Tensor, n: int, stream: bool = False) -> CallTiming:
        ids = prompts.to(self.device)
        cache = self._cache()
        kwargs = dict(attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=n,
                      do_sample=False, pad_token_id=0)
        if not self.compiled:
            kwargs["disable_compile"] = True
        restore = None
        if self.method == "hf-eager-attn":
            restore = self.model.config._attn_implementation
            _set_attention(self.model, "eager")
        try:
            _sync(self.device)
            start = time.perf_counter()
            clock = _Clock(start) if stream else None
            out = self.model.generate(ids, streamer=clock, **kwargs)
            _sync(self.device)
            wall = time.perf_counter() - start
        finally:
            if restore is not None:
                _set_attention(self.model, restore)
        made = out.shape[1] - ids.shape[1]
        if made != n:
            raise RuntimeError(f"{self.method}: expected {n} new tokens per sequence, got {made}")
        # Count the cache now and let a DynamicCache go: holding it into the next call would
        # double the KV memory that call measures.
        self._kv_bytes = _cache_bytes(cache)
        del cache, out
        return CallTiming(wall, n, token_times=clock.times[1:] if stream else None)

    def kv_bytes(self, prompt_len: Optional[int] = None) -> Optional[int]:
        """Bytes the cache held at the end of the last call (a static cache: all of it)."""
        return self._kv_bytes

    def close(self) -> None:
        self.cache = None


def _cache_bytes(cache) -> int:
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def _set_attention(model, implementation: str) -> None:
    """Switch the attention implementation of a loaded HF model (eager <-> sdpa)."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(implementation)
    else:  # older transformers: the modules read it from the config at call time
        model.config._attn_implementation = implementation


def make_runner(model, method: str, **kw):
    """The runner for ``method`` (see METHODS); keyword arguments as for the runners."""
    if is_engine(method):
        return EngineRunner(model, method, **kw)
    if method in HF_METHODS or method in PREFILL_ONLY_METHODS:
        return HFRunner(model, method, **kw)
    raise ValueError(f"method: expected one of {METHODS + PREFILL_ONLY_METHODS}, got {method!r}")


def release(model=None, *, compiled_state: bool = False) -> None:
    """Give freed device memory back between measurements.

    ``compiled_state=True`` also drops torch.compile caches (dynamo code caches and the CUDA
    graph trees behind HF's compiled step), which otherwise keep their graph pools alive.
    """
    if compiled_state:
        torch._dynamo.reset()
        if model is not None and "_compiled_call" in vars(model):
            del model._compiled_call  # transformers rebuilds it on the next compiled generate
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def raise_recompile_limit() -> None:
    """One compiled step per (batch, cache length) is expected across a sweep: let dynamo keep
    them instead of silently falling back to eager after the default 8."""
    cfg = torch._dynamo.config
    for name, value in (("recompile_limit", 64), ("cache_size_limit", 64),
                        ("accumulated_recompile_limit", 512), ("accumulated_cache_size_limit", 512)):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), value))


# -- timing -------------------------------------------------------------------------------------

WARM_PROMPT = 64  # tokens of the short warm-up prompts: a multiple of 16 like every measured length


def warm_call(runner, prompts: torch.Tensor, n: int) -> float:
    """A warm-up call of ``n`` tokens before anything is timed; returns its seconds.

    It compiles (HF StaticCache's first call; the engine compiled at construction), runs every
    kernel once and grows the allocator to a full-length prefill, so the timed calls pay none of
    that. HF gets the full prompts (its two timed calls are subtracted, so they must cost the
    same). The engine gets the first prompt in full and short prompts in the other slots: it
    prefills one prompt at a time, so one full prompt warms everything, and the batch size (the
    compiled bucket) is the same as in the timed call. Its Triton prefill kernels specialize only
    on divisibility by 16, which every length used here shares.
    """
    start = time.perf_counter()
    if isinstance(runner, EngineRunner):
        rows = [prompts[0].tolist()] + [p[:WARM_PROMPT].tolist() for p in prompts[1:]]
        runner.generate(rows, n)
    else:
        runner.generate(prompts, n)
    return time.perf_counter() - start


def time_decode(runner, prompts: torch.Tensor, warm_tokens: int, timed_tokens: int
                ) -> Dict[str, object]:
    """Decode ms per step with no host sync inside the timed region, plus prefill seconds.

    Both start with ``warm_call``. Engine: then one call of ``timed_tokens + 1`` tokens;
    ms/step = its ``decode_seconds / decode_steps`` (the engine syncs once, at the end).
    HF: then two calls with ``warm_tokens`` and
    ``warm_tokens + timed_tokens`` new tokens on the same cache; ms/step is the difference of
    their wall times over the token difference, so prefill cancels out. HF's prefill is the
    first call's time less its ``warm_tokens - 1`` decode steps.
    """
    B = prompts.shape[0]
    warm_s = warm_call(runner, prompts, warm_tokens)
    if isinstance(runner, EngineRunner):
        timed = runner.generate(prompts, timed_tokens + 1)
        ms = 1e3 * timed.decode_s / timed.decode_steps
        prefill_s = timed.prefill_s
        generated_mid = timed_tokens // 2  # the timed call starts from a fresh prefill
        raw = {"decode_s": timed.decode_s, "decode_steps": timed.decode_steps, "call_s": timed.wall_s}
    else:
        for _ in range(3):  # a pair whose difference is not positive was disturbed: measure again
            first = runner.generate(prompts, warm_tokens)
            second = runner.generate(prompts, warm_tokens + timed_tokens)
            ms = 1e3 * (second.wall_s - first.wall_s) / timed_tokens
            if ms > 0:
                break
        prefill_s = max(0.0, first.wall_s - (warm_tokens - 1) * ms / 1e3)
        generated_mid = warm_tokens + timed_tokens // 2  # the steps between the two calls' ends
        raw = {"call_s": [first.wall_s, second.wall_s], "call_tokens": [warm_tokens, warm_tokens + timed_tokens]}
    if not ms > 0:
        raise RuntimeError(f"timing noise: the decode time difference is {ms:.3f} ms per token; "
                           "use more --timed-tokens")
    return {"ms_per_token": ms, "decode_tokens_per_s": B * 1e3 / ms,
            "prefill_s": prefill_s, "prefill_tokens_per_s": B * prompts.shape[1] / prefill_s if prefill_s else None,
            "warm_s": warm_s, "timed_tokens": timed_tokens, "generated_mid": generated_mid, "raw": raw}


def percentiles(values: Sequence[float]) -> Dict[str, float]:
    """p10 / p50 / p90 / min / max / mean of ``values`` (nearest-rank on the sorted list)."""
    v = sorted(values)
    if not v:
        return {}
    pick = lambda q: v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))]  # noqa: E731
    return {"p10": pick(0.10), "p50": pick(0.50), "p90": pick(0.90), "min": v[0], "max": v[-1],
            "mean": statistics.fmean(v), "n": len(v)}


def time_stream(runner, prompts: torch.Tensor, warm_tokens: int, timed_tokens: int
                ) -> Dict[str, object]:
    """Streamed latency, as a user watching tokens sees it: time to the first token, then the
    interval between consecutive tokens (both methods sync with the host every token here)."""
    warm_s = warm_call(runner, prompts, warm_tokens)
    timed = runner.generate(prompts, timed_tokens + 1, stream=True)
    t = timed.token_times
    if not t or len(t) < 2:
        raise RuntimeError(f"streamer saw {len(t or [])} tokens, expected {timed_tokens + 1}")
    gaps_ms = [1e3 * (b - a) for a, b in zip(t, t[1:])]
    stats = percentiles(gaps_ms)
    return {"ttft_s": t[0], "ms_per_token": stats["p50"], "ms_per_token_stats": stats,
            "decode_tokens_per_s": prompts.shape[0] * 1e3 / stats["p50"], "warm_s": warm_s,
            "timed_tokens": timed_tokens, "generated_mid": timed_tokens // 2,
            "raw": {"token_ms": gaps_ms, "call_s": timed.wall_s}}


def time_prefill(runner, prompts: torch.Tensor, device: torch.device) -> Dict[str, object]:
    """Prefill seconds and the allocator's transient peak over what was allocated before it
    (one generated token, so no decode step runs)."""
    warm_call(runner, prompts, 1)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    if before is not None:
        torch.cuda.reset_peak_memory_stats(device)
    call = runner.generate(prompts, 1)
    out = {"prefill_s": call.prefill_s if call.prefill_s is not None else call.wall_s}
    if before is not None:
        out["prefill_peak_extra_bytes"] = torch.cuda.max_memory_allocated(device) - before
    return out


# -- memory -------------------------------------------------------------------------------------


def is_oom(exc: BaseException) -> bool:
    """Out of device memory, also when wrapped (inductor re-raises backend errors)."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)):
            return True
        if isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower():
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


class MemoryWatch:
    """Allocator peak (reset on entry) and the NVML sampler around one measurement."""

    def __init__(self, device: torch.device, sampler: Optional[NvmlSampler]):
        self.device, self.sampler = device, sampler
        self.result: Dict[str, object] = {}

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.result["allocated_before_bytes"] = torch.cuda.memory_allocated(self.device)
        if self.sampler is not None:
            self.sampler.start()
        return self

    def __exit__(self, *exc) -> bool:
        if self.device.type == "cuda":
            try:
                torch.cuda.synchronize(self.device)
            except Exception:  # a failed kernel may leave the device unsynchronizable
                pass
            self.result["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device)
            self.result["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(self.device)
        else:
            self.result["peak_allocated_bytes"] = None
            self.result["memory_reason"] = "no CUDA device: allocator peak not measured"
        if self.sampler is not None:
            self.result.update(self.sampler.stop())
        else:
            self.result.update({"nvml": None, "nvml_reason": "no sampler"})
        return False


def device_memory(device: torch.device, cap_bytes: Optional[int] = None) -> Dict[str, int]:
    """Memory a new allocation can still get: free device memory plus the allocator's unused
    reserve, limited by ``cap_bytes`` (a per-process cap) when given."""
    if device.type != "cuda":
        raise Skip("no CUDA device")
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    usable = free + torch.cuda.memory_reserved(device) - allocated
    if cap_bytes is not None:
        usable = min(usable, cap_bytes - allocated)
    return {"total_bytes": total, "free_bytes": free, "allocated_bytes": allocated, "usable_bytes": usable}


def engine_slot_bytes(model, method: str, prompt_len: int, new_tokens: int) -> Dict[str, int]:
    """Bytes one more batch slot of an engine method costs, from the engine's own buffers.

    Built on a weightless (meta) copy of the model, so nothing is allocated: the KV report of
    a 1-slot and a 2-slot engine differ by exactly one slot's cache. Runner buffers per slot
    (generated / forced tokens, log-probs, sampling noise, the step's fp32 logits) are added.
    """
    meta = meta_model(model)
    per = []
    for b in (1, 2):
        cfg = engine_config(method, max_batch_size=b, max_prompt_len=prompt_len,
                            max_new_tokens=new_tokens, compile=False, cuda_graphs=False)
        per.append(minikv_compile(meta, cfg).kv_memory(prompt_len, new_tokens).total_bytes)
    vocab = model.config.vocab_size
    runner = 20 * new_tokens + 3 * 4 * vocab  # int64 x2 + fp32 per token; noise + logits (x2)
    return {"kv_bytes_per_slot": per[1] - per[0], "kv_bytes_fixed": 2 * per[0] - per[1],
            "runner_bytes_per_slot": runner, "bytes_per_slot": per[1] - per[0] + runner}


def prefill_activation_bytes(model, tokens: int) -> int:
    """A rough peak of one decoder layer's prefill activations for ``tokens`` tokens (bytes):
    residual stream and norms, q/k/v, attention output, the MLP's gate / up / product."""
    s = model_summary(model)
    elt = 2
    per_token = elt * (4 * s["hidden"] + (s["q_heads"] + 2 * s["kv_heads"]) * s["head_dim"] * 2
                       + 3 * s["intermediate"])
    return tokens * per_token


def hf_bytes_per_sequence(model, method: str, prompt_len: int, new_tokens: int) -> int:
    """Predicted bytes one more sequence costs HF: its KV cache (bf16, prompt + new tokens) plus
    its share of the batched prefill: activations, K/V expanded to the query heads over the
    cache length (``repeat_kv`` where SDPA's GQA path is not taken) and, for the static cache,
    the 4-D boolean mask of ``prompt x cache length``."""
    s = model_summary(model)
    positions = prompt_len + new_tokens
    kv = 2 * s["layers"] * s["kv_heads"] * s["head_dim"] * positions * 2
    act = prefill_activation_bytes(model, prompt_len)
    expanded = 2 * s["q_heads"] * s["head_dim"] * (positions if method == "hf-static" else prompt_len) * 2
    mask = prompt_len * positions if method == "hf-static" else 0
    return kv + act + expanded + mask


# -- the floor ----------------------------------------------------------------------------------


def kv_bytes_read(model, method: str, prompt_len: int, generated: int, batch: int) -> int:
    """KV bytes a decode step reads for ``batch`` sequences after ``generated`` new tokens.

    HF and the full engine: every held token in the model dtype. Quantized engine methods: per
    layer the kept prompt tokens plus generated ones, quantized (``bits/8`` code bytes plus an
    fp16 scale and zero per group of ``G`` values, for K and V), except those still in the
    residual ring, held in the model dtype. The ring count follows prefill's split and the
    flush rule (``budget.ring_tokens_after``).
    """
    s = model_summary(model)
    width = s["kv_heads"] * s["head_dim"]
    elt = 2 if s["dtype"] in ("bfloat16", "float16") else 4
    if not is_engine(method):
        return 2 * s["layers"] * width * (prompt_len + generated) * elt * batch
    cfg = engine_config(method)
    total = 0.0
    for layer in range(s["layers"]):
        kept = sum(budget.kept_tokens(cfg, prompt_len, layer, s["layers"]))
        held = kept + generated
        if cfg.bits == 16:
            total += 2 * width * held * elt
            continue
        ring = budget.ring_tokens_after(cfg, kept, generated)
        quant = held - ring
        per_value = budget.bytes_per_kv_value(cfg.bits, cfg.group_size, s["head_dim"])
        total += 2 * width * (quant * per_value + ring * elt)
        # SpeCache: the recalled rows (their host reads are ``host_link_bytes``)
        total += 2 * s["kv_heads"] * min(cfg.recall_top_k, quant) * s["head_dim"] * elt
    return int(total * batch)


def host_link_bytes(model, method: str, prompt_len: int, generated: int, batch: int) -> int:
    """Bytes a SpeCache step moves over the host link: per layer and slot, the K recalled
    rows of k and v per KV head read, and the new token's k and v written; 0 without recall."""
    cfg = engine_config(method) if is_engine(method) else None
    if cfg is None or not cfg.recall_top_k:
        return 0
    s = model_summary(model)
    elt = 2 if s["dtype"] in ("bfloat16", "float16") else 4
    kept = [sum(budget.kept_tokens(cfg, prompt_len, layer, s["layers"]))
            for layer in range(s["layers"])]
    rows = sum(min(cfg.recall_top_k, k + generated) + 1 for k in kept)
    return int(2 * s["kv_heads"] * s["head_dim"] * elt * rows * batch)


def floor_figures(model, method: str, prompt_len: int, batch: int, generated: int,
                  ms_per_token: Optional[float], bandwidth: Optional[Dict]) -> Dict[str, object]:
    """Bytes a step reads after ``generated`` tokens (the middle of the timed steps), the floor
    ``(weight bytes + KV bytes) / copy bandwidth`` and the bandwidth the step achieved."""
    weights = model_summary(model)["weight_bytes_read_per_step"]
    kv = kv_bytes_read(model, method, prompt_len, generated, batch)
    out = {"weight_bytes_read": weights, "kv_bytes_read": kv,
           "host_link_bytes": host_link_bytes(model, method, prompt_len, generated, batch)}
    if bandwidth and ms_per_token:
        bw = bandwidth["bytes_per_s"]
        floor_ms = 1e3 * (weights + kv) / bw
        out.update({"floor_ms": floor_ms, "x_floor": ms_per_token / floor_ms,
                    "achieved_bytes_per_s": (weights + kv) / (ms_per_token / 1e3)})
    return out


# -- the paper's memory formula (docs/algorithm.md, KV bytes; the paper's Appendix I) ----------
# Written as the paper writes it, apart from graphs.budget on purpose: memory-claim checks the
# engine's own arithmetic and allocation against it.


def paper_fp16_kv_bytes(layers: int, width: int, prompt_len: int, new_tokens: int) -> int:
    """``2 * H * d * (L + L_gen) * 2``: K and V, fp16, every token."""
    return 2 * layers * width * (prompt_len + new_tokens) * 2


def paper_minikv_kv_bytes(layers: int, width: int, prompt_len: int, new_tokens: int,
                          heavy: float = 0.25, recent: float = 0.25) -> int:
    """``H * d * (a_HH + a_RW) * L + H * d * L_gen``: 2-bit codes plus fp16 scale and zero per
    16 values is half a byte per value; K and V together make one byte per kept value."""
    return int(layers * width * ((heavy + recent) * prompt_len + new_tokens))


# -- budget -------------------------------------------------------------------------------------


class Budget:
    """Wall-clock budget of a run: a measurement starts only if, from what the same kind of
    measurement took before in this run, it is expected to finish inside the budget. A kind not
    seen yet is expected to take a quarter of the budget, at most a minute (a first compile
    should not start in the last seconds)."""

    def __init__(self, seconds: Optional[float]):
        self.seconds = seconds
        self.start = time.perf_counter()
        self.seen: Dict[str, float] = {}

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def check(self, kind: str) -> Optional[str]:
        """None if a measurement of ``kind`` may start, else the reason it may not."""
        if self.seconds is None:
            return None
        expected = self.seen.get(kind, min(60.0, 0.25 * self.seconds))
        left = self.seconds - self.elapsed
        if left <= 0 or expected > left:
            return (f"time budget: {self.elapsed:.0f}s of {self.seconds:.0f}s used, "
                    f"this kind {'took' if kind in self.seen else 'is allowed'} {expected:.0f}s")
        return None

    def note(self, kind: str, seconds: float) -> None:
        self.seen[kind] = seconds


def describe_exception(exc: BaseException) -> Dict[str, str]:
    """Type and message (one line, trimmed) of an exception for the report."""
    msg = " ".join(str(exc).split())
    return {"error_type": type(exc).__name__, "reason": msg[:600] or type(exc).__name__}



