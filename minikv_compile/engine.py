"""``minikv_compile(model)``: the compiled model object users hold."""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch
from torch import nn

from minikv_compile.graphs import budget
from minikv_compile.graphs.cache import KVMemoryReport, kv_memory_report
from minikv_compile.graphs.decode import MAX_EOS_IDS
from minikv_compile.graphs.runtime import Request, SlotRuntime
from minikv_compile.graphs.sampling import Sampling
from minikv_compile.models import get_adapter

from .config import MiniKVConfig

_DTYPES_CUDA = (torch.float16, torch.bfloat16)
_DTYPES_CPU = (torch.float16, torch.bfloat16, torch.float32)

Prompts = Union[torch.Tensor, Sequence[Sequence[int]]]


@dataclass
class GenerationOutput:
    """What ``generate`` returns.

    sequences: generated token ids per sequence (the prompt excluded; cut after the eos token,
    which is included). stop_reasons: ``"eos"`` or ``"length"`` per sequence.
    """

    sequences: List[List[int]]
    stop_reasons: List[str]
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int
    batch_bucket: int
    timings: Dict[str, float] = field(default_factory=dict)

    @property
    def decode_tokens_per_second(self) -> float:
        """Generated tokens per second of decode (all sequences of the batch, steps x batch)."""
        n = self.decode_steps * len(self.sequences)
        return n / self.decode_seconds if self.decode_seconds > 0 else float("nan")


class MiniKVModel:
    """An HF causal LM whose KV cache is MiniKV-compressed and whose decode loop is compiled.

    Built by ``minikv_compile``; holds the model (weights are shared, not copied) and the
    runtime of ``config.max_batch_size`` slots (``runtime``): the static cache, the per-slot
    state and one compiled / captured decode step per batch-size bucket (powers of two up to
    ``max_batch_size``) and mode (greedy, sample, teacher): the largest greedy bucket at
    construction, the others when first used. On CUDA the q/k/v and gate/up weights of each
    layer are concatenated in place (the model's own modules then hold views into them, and
    keep working); ``unfuse_projections()`` gives every module its own weights back.

    One call at a time: ``generate``, ``teacher_force`` and the slot methods hold one lock, so
    threads sharing a model are served one after another.
    """

    def __init__(self, model: nn.Module, config: MiniKVConfig):
        self.model, self.config = model, config
        self.device, self.dtype = _model_device_and_dtype(model)
        on_cuda = self.device.type == "cuda"
        use_compile = on_cuda if config.compile is None else config.compile
        use_graphs = on_cuda if config.cuda_graphs is None else config.cuda_graphs
        if use_graphs and not on_cuda:
            raise ValueError(f"cuda_graphs=True: expected a model on a CUDA device, got {self.device}")
        allowed = _DTYPES_CUDA if on_cuda else _DTYPES_CPU
        if self.dtype not in allowed:
            raise ValueError(f"model dtype: expected one of {allowed} on {self.device.type}, got {self.dtype}")
        # On CUDA, q/k/v and gate/up weights are concatenated (the modules keep views into
        # them): fewer, larger GEMVs per decode step. The CPU keeps HF's exact kernels.
        self.adapter = get_adapter(model, config.max_prompt_len + config.max_new_tokens,
                                   fuse_projections=on_cuda)
        a = self.adapter
        if a.num_q_heads % a.num_kv_heads:
            raise NotImplementedError(f"expected num_attention_heads % num_key_value_heads == 0, "
                                      f"got {a.num_q_heads} % {a.num_kv_heads}")
        if a.head_dim % config.group_size:
            raise ValueError(f"group_size: expected a divisor of head_dim={a.head_dim}, got {config.group_size}")
        self._lock = threading.RLock()
        with _engine_mode():
            self.runtime = SlotRuntime(a, config, device=self.device, dtype=self.dtype,
                                       compile=use_compile, cuda_graphs=use_graphs)
            if use_graphs:
                # The full bucket is captured now; smaller buckets and other modes on first use
                # (each costs one compile, so a batch-1 user of a batch-64 engine pays only for 1).
                self.runtime.prepare(self.runtime.buckets[-1], "greedy")

    # -- public ------------------------------------------------------------------------------

    def generate(self, input_ids: Prompts, attention_mask: Optional[torch.Tensor] = None,
                 max_new_tokens: int = 256, do_sample: bool = False, temperature: float = 1.0,
                 top_k: Optional[int] = None, top_p: Optional[float] = None,
                 eos_token_id: Union[int, Sequence[int], None] = None,
                 streamer: Optional[Callable[[List[Optional[int]]], None]] = None,
                 eos_check_every: int = 8, seed: Optional[int] = None) -> GenerationOutput:
        """Generate up to ``max_new_tokens`` tokens for each prompt.

        input_ids: ``(B, L)`` int64 (with ``attention_mask (B, L)`` marking real tokens, left or
            right padding), or a list of ``B`` token-id lists of any lengths.
        streamer: called once per generated position with one entry per sequence (the new token,
            or ``None`` once that sequence has stopped). Streaming syncs with the host every step.
        eos_check_every: steps between host checks of "all sequences finished" (each is a sync).
        seed: sampling seed of the first sequence (sequence ``i`` draws with ``seed + i``); None
            draws seeds from torch's global generator.
        """
        prompts = self._check_prompts(input_ids, attention_mask)
        eos = tuple(_eos_list(eos_token_id))
        sampling = _check_sampling(do_sample, temperature, top_k, top_p)
        self._check_new_tokens(max_new_tokens)
        requests = [Request(p, max_new_tokens, eos, _seeded(sampling, seed, i))
                    for i, p in enumerate(prompts)]
        with self._lock, _engine_mode():
            return self._run(requests, streamer, eos_check_every)

    def teacher_force(self, input_ids: Prompts, targets: Sequence[Sequence[int]],
                      attention_mask: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
        """Log-probabilities of ``targets[i]`` after ``input_ids[i]``, through the decode path.

        The prompt is prefilled (and compressed) as in ``generate``; then each target token is
        fed through the same compiled / captured decode step instead of a chosen one, so flushes
        and the ring are exercised exactly as in generation. Returns one (len(targets[i]),) fp32
        CPU tensor per sequence: ``log p(targets[i][j] | prompt, targets[i][:j])``.
        """
        prompts = self._check_prompts(input_ids, attention_mask)
        if len(targets) != len(prompts):
            raise ValueError(f"targets: expected one list per prompt ({len(prompts)}), got {len(targets)}")
        rows = [_token_list(t, self.adapter.vocab_size, f"targets[{i}]") for i, t in enumerate(targets)]
        if any(len(t) == 0 for t in rows):
            raise ValueError("targets: expected at least one token per sequence, got an empty list")
        cap = self.config.max_new_tokens
        if max(len(t) for t in rows) > cap:
            raise ValueError(f"targets: expected at most {cap} tokens per sequence (max_new_tokens), "
                             f"got {max(len(t) for t in rows)}")
        requests = [Request(p, len(t), (), Sampling(), forced=t) for p, t in zip(prompts, rows)]
        with self._lock, _engine_mode():
            self._run(requests, None, 1 << 30)
            logprobs = self.runtime.state.logprobs[: len(rows)].cpu()
        return [logprobs[i, : len(t)].clone() for i, t in enumerate(rows)]

    def kv_memory(self, prompt_len: Optional[int] = None, new_tokens: Optional[int] = None) -> KVMemoryReport:
        """Bytes the cache allocated, against the fp16 cache for the configured maxima."""
        L = prompt_len or self.config.max_prompt_len
        kept = budget.kept_per_layer(self.config, L, self.adapter.num_layers)
        return kv_memory_report(self.runtime.cache, kept=kept, prompt_len=L,
                                new_tokens=new_tokens or self.config.max_new_tokens)

    def unfuse_projections(self) -> None:
        """Give the model's q/k/v and gate/up modules their own weights back (undoing the
        in-place concatenation done on CUDA); this engine must not be used afterwards."""
        with self._lock:
            self.adapter.unfuse()
            self.runtime = None

    @property
    def stats(self) -> Dict[str, object]:
        """Compiles and replays so far: proof that the decode step is compiled once per bucket
        and really replayed from CUDA graphs."""
        r = self.runtime.runner
        return {"compiles": r.compiles, "replays": r.replays, "graphs": r.graphs,
                "compile_seconds": dict(r.compile_seconds), "capture_seconds": dict(r.capture_seconds)}

    # -- internals -----------------------------------------------------------------------------

    def _run(self, requests: List[Request], streamer, eos_check_every: int) -> GenerationOutput:
        """Admit every request (slots 0..B-1), replay until all finished, collect, release."""
        rt, B = self.runtime, len(requests)
        slots = list(range(B))
        rt.release_all()  # whatever an interrupted call left behind
        try:
            t0 = time.perf_counter()
            for slot, request in zip(slots, requests):
                rt.admit(slot, request)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            t1 = time.perf_counter()
            finished = rt.finished(slots) if streamer is not None else None
            if streamer is not None:
                streamer([out[0] for out in rt.outputs(slots)])
            last = max(r.max_new_tokens for r in requests) - 1  # steps after the first token
            steps = 0
            eos = any(r.eos_ids for r in requests)
            while steps < last:
                if eos and steps and steps % eos_check_every == 0 and all(rt.finished(slots)):
                    break
                rt.step()
                steps += 1
                if streamer is not None:
                    outs = rt.outputs(slots)
                    streamer([None if f else out[-1] for f, out in zip(finished, outs)])
                    finished = rt.finished(slots)
                    if all(finished):
                        break
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            t2 = time.perf_counter()
            sequences = rt.outputs(slots)
        finally:
            rt.release_all()
        reasons = ["eos" if seq and seq[-1] in r.eos_ids else "length"
                   for seq, r in zip(sequences, requests)]
        bucket = next(b for b in rt.buckets if b >= B)
        return GenerationOutput(sequences=sequences, stop_reasons=reasons, prefill_seconds=t1 - t0,
                                decode_seconds=t2 - t1, decode_steps=steps, batch_bucket=bucket)

    def _check_prompts(self, input_ids, attention_mask) -> List[List[int]]:
        cfg = self.config
        prompts = _prompts(input_ids, attention_mask, self.adapter.vocab_size)
        if len(prompts) > cfg.max_batch_size:
            raise ValueError(f"batch: expected at most max_batch_size={cfg.max_batch_size} prompts, "
                             f"got {len(prompts)}")
        for i, p in enumerate(prompts):
            if not 1 <= len(p) <= cfg.max_prompt_len:
                raise ValueError(f"prompt {i}: expected 1..{cfg.max_prompt_len} tokens "
                                 f"(max_prompt_len), got {len(p)}")
        return prompts

    def _check_new_tokens(self, n) -> None:
        cap = self.config.max_new_tokens
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= cap:
            raise ValueError(f"max_new_tokens: expected 1..{cap} (the configured capacity), got {n!r}")


def minikv_compile(model: nn.Module, config: Optional[MiniKVConfig] = None) -> MiniKVModel:
    """Wrap an HF causal LM with a MiniKV-compressed static cache and a compiled decode loop.

    Allocates the cache for ``config.max_batch_size x (kept prompt tokens + max_new_tokens)``,
    compiles the decode step with ``torch.compile(fullgraph=True)`` and, on CUDA, captures it into
    one CUDA graph per batch-size bucket. The model's weights are used in place.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: expected a transformers causal LM (nn.Module), got {type(model).__name__}")
    config = MiniKVConfig() if config is None else config
    if not isinstance(config, MiniKVConfig):
        raise ValueError(f"config: expected a MiniKVConfig, got {type(config).__name__}")
    return MiniKVModel(model, config)


def _model_device_and_dtype(model: nn.Module):
    params = list(model.parameters())
    if not params:
        raise ValueError("model: expected parameters, got a module without any")
    devices = {p.device for p in params}
    if len(devices) != 1:
        raise ValueError(f"model: expected every parameter on one device, got {sorted(map(str, devices))}")
    dtypes = {p.dtype for p in params if p.is_floating_point()}
    if len(dtypes) != 1:
        raise ValueError(f"model: expected one floating dtype, got {sorted(map(str, dtypes))}")
    return devices.pop(), dtypes.pop()


def _prompts(input_ids: Prompts, attention_mask, vocab: int) -> List[List[int]]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids: expected a (B, L) integer tensor, got {tuple(input_ids.shape)} "
                             f"{input_ids.dtype}")
        rows = input_ids.tolist()
        if attention_mask is not None:
            if tuple(attention_mask.shape) != tuple(input_ids.shape):
                raise ValueError(f"attention_mask: expected shape {tuple(input_ids.shape)}, "
                                 f"got {tuple(attention_mask.shape)}")
            mask = attention_mask.bool().tolist()
            rows = [[t for t, m in zip(r, mr) if m] for r, mr in zip(rows, mask)]
    else:
        if attention_mask is not None:
            raise ValueError("attention_mask: expected None with a list of token lists, got a mask")
        try:
            rows = [[int(t) for t in r] for r in input_ids]
        except TypeError as e:
            raise ValueError(f"input_ids: expected a (B, L) tensor or a list of token-id lists ({e})")
    if not rows:
        raise ValueError("input_ids: expected at least one prompt, got none")
    return [_token_list(r, vocab, f"prompt {i}") for i, r in enumerate(rows)]


def _token_list(tokens, vocab: int, what: str) -> List[int]:
    tokens = [int(t) for t in tokens]
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"{what}: expected token ids in [0, {vocab}), got {bad[:5]}")
    return tokens


def _eos_list(eos_token_id) -> List[int]:
    if eos_token_id is None:
        return []
    eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if len(eos) > MAX_EOS_IDS or not all(isinstance(t, int) and t >= 0 for t in eos):
        raise ValueError(f"eos_token_id: expected up to {MAX_EOS_IDS} non-negative ints, got {eos_token_id!r}")
    return eos


def _check_sampling(do_sample, temperature, top_k, top_p) -> Sampling:
    """The sampling parameters for these arguments (greedy unless ``do_sample``)."""
    if not do_sample:
        return Sampling()
    if not temperature > 0:
        raise ValueError(f"temperature: expected > 0, got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k: expected a positive int or None, got {top_k!r}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p: expected a value in (0, 1], got {top_p!r}")
    return Sampling(greedy=False, temperature=float(temperature), top_k=top_k,
                    top_p=1.0 if top_p is None else float(top_p))


def _seeded(sampling: Sampling, seed: Optional[int], index: int) -> Sampling:
    """``sampling`` with the seed of sequence ``index`` of a call (``seed + index``)."""
    if seed is None or sampling.greedy:
        return sampling
    return dataclasses.replace(sampling, seed=seed + index)


@contextlib.contextmanager
def _engine_mode():
    """No autograd, and never inference mode: the engine's buffers are ordinary tensors that a
    later call may update in place, whether or not the caller is under ``inference_mode()``."""
    with torch.inference_mode(False), torch.no_grad():
        yield
