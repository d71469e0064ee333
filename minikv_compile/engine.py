"""``minikv_compile(model)``: the compiled model object users hold."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch
from torch import nn

from minikv_compile.graphs.cache import KVMemoryReport, StaticKVCache, kv_memory_report
from minikv_compile.graphs.decode import MAX_EOS_IDS, DecodeRunner, sample_tokens
from minikv_compile.graphs.prefill import capacity_for, prefill
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

    Built by ``minikv_compile``; holds the model (weights are shared, not copied), the static
    cache for ``config.max_batch_size`` sequences, and one compiled / captured decode step per
    batch-size bucket (powers of two up to ``max_batch_size``) and mode (greedy, sample,
    teacher): the largest greedy bucket at construction, the others when first used.
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
        n = a.num_layers
        self.cache = StaticKVCache(
            capacities=[capacity_for(config, layer, n) for layer in range(n)],
            max_batch_size=config.max_batch_size, num_kv_heads=a.num_kv_heads, head_dim=a.head_dim,
            ring=config.residual_length, bits=config.bits, group_size=config.group_size,
            dtype=self.dtype, device=self.device)
        self.runner = DecodeRunner(a, self.cache, max_new_tokens=config.max_new_tokens,
                                   compile=use_compile, cuda_graphs=use_graphs)
        self.buckets = _buckets(config.max_batch_size)
        self.capture_seconds: Dict[tuple, float] = {}
        if use_graphs:
            # The full bucket is captured now; smaller buckets and other modes on first use
            # (each costs one compile, so a batch-1 user of a batch-64 engine pays only for 1).
            with torch.no_grad():
                self._prepare(self.buckets[-1], "greedy")

    # -- public ------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, input_ids: Prompts, attention_mask: Optional[torch.Tensor] = None,
                 max_new_tokens: int = 256, do_sample: bool = False, temperature: float = 1.0,
                 top_k: Optional[int] = None, top_p: Optional[float] = None,
                 eos_token_id: Union[int, Sequence[int], None] = None,
                 streamer: Optional[Callable[[List[Optional[int]]], None]] = None,
                 eos_check_every: int = 8) -> GenerationOutput:
        """Generate up to ``max_new_tokens`` tokens for each prompt.

        input_ids: ``(B, L)`` int64 (with ``attention_mask (B, L)`` marking real tokens, left or
            right padding), or a list of ``B`` token-id lists of any lengths.
        streamer: called once per generated position with one entry per sequence (the new token,
            or ``None`` once that sequence has stopped). Streaming syncs with the host every step.
        eos_check_every: steps between host checks of "all sequences finished" (each is a sync).
        """
        prompts = self._check_prompts(input_ids, attention_mask)
        B = len(prompts)
        eos = _eos_list(eos_token_id)
        mode = _check_sampling(do_sample, temperature, top_k, top_p)
        self._check_new_tokens(max_new_tokens)
        r = self.runner
        bucket, first, prefill_s = self._start(prompts, mode, eos, temperature, top_k, top_p)
        t1 = time.perf_counter()
        if streamer is not None:
            streamer(first.tolist())
            finished = r.done[:B].tolist()
        steps = 0
        for steps in range(1, max_new_tokens):
            if eos and steps % eos_check_every == 0 and bool(r.done[:B].all()):
                steps -= 1  # columns 0..steps-1 were produced
                break
            r.run_step(bucket, mode)
            if streamer is not None:
                col = r.generated[:B, steps].tolist()
                streamer([None if f else t for t, f in zip(col, finished)])
                finished = r.done[:B].tolist()
                if eos and all(finished):
                    break
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()

        gen = r.generated[:B, : steps + 1].tolist()
        sequences, reasons = [], []
        for row in gen:
            cut = next((i for i, t in enumerate(row) if t in eos), None) if eos else None
            sequences.append(row if cut is None else row[: cut + 1])
            reasons.append("length" if cut is None else "eos")
        return GenerationOutput(sequences=sequences, stop_reasons=reasons, prefill_seconds=prefill_s,
                                decode_seconds=t2 - t1, decode_steps=steps, batch_bucket=bucket)

    @torch.no_grad()
    def teacher_force(self, input_ids: Prompts, targets: Sequence[Sequence[int]],
                      attention_mask: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
        """Log-probabilities of ``targets[i]`` after ``input_ids[i]``, through the decode path.

        The prompt is prefilled (and compressed) as in ``generate``; then each target token is
        fed through the same compiled / captured decode step instead of a sampled one, so flushes
        and the ring are exercised exactly as in generation. Returns one (len(targets[i]),) fp32
        CPU tensor per sequence: ``log p(targets[i][j] | prompt, targets[i][:j])``.
        """
        prompts = self._check_prompts(input_ids, attention_mask)
        if len(targets) != len(prompts):
            raise ValueError(f"targets: expected one list per prompt ({len(prompts)}), got {len(targets)}")
        n = max(len(t) for t in targets)
        self._check_new_tokens(n)
        rows = [_token_list(t, self.adapter.vocab_size, f"targets[{i}]") for i, t in enumerate(targets)]
        if any(len(t) == 0 for t in rows):
            raise ValueError("targets: expected at least one token per sequence, got an empty list")
        r = self.runner
        forced = torch.zeros(len(rows), n, dtype=torch.int64)
        for i, t in enumerate(rows):
            forced[i, : len(t)] = torch.tensor(t)
        bucket, _, _ = self._start(prompts, "teacher", [], 1.0, None, None, forced=forced)
        for _ in range(1, n):
            r.run_step(bucket, "teacher")
        logprobs = r.logprobs[: len(rows), :n].cpu()
        return [logprobs[i, : len(t)].clone() for i, t in enumerate(rows)]

    def kv_memory(self, prompt_len: Optional[int] = None, new_tokens: Optional[int] = None) -> KVMemoryReport:
        """Bytes the cache allocated, against the fp16 cache for the configured maxima."""
        L = prompt_len or self.config.max_prompt_len
        n = self.adapter.num_layers
        kept = [sum(self.config.kept_tokens(L, layer, n)) for layer in range(n)]
        return kv_memory_report(self.cache, kept=kept, prompt_len=L,
                                new_tokens=new_tokens or self.config.max_new_tokens)

    @property
    def stats(self) -> Dict[str, object]:
        """Compiles and replays so far: proof that the decode step is compiled once per bucket
        and really replayed from CUDA graphs."""
        r = self.runner
        return {"compiles": r.compiles, "replays": r.replays, "graphs": sorted(r._graphs),
                "compile_seconds": dict(r.compile_seconds), "capture_seconds": dict(self.capture_seconds)}

    # -- internals -----------------------------------------------------------------------------

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

    def _start(self, prompts, mode, eos, temperature, top_k, top_p, forced=None):
        """Prefill every prompt into its slot and set the runner's buffers for step 1.

        Returns (bucket, first tokens (B,), prefill seconds). Everything the previous request
        left behind is reset first, so a failed request never poisons the next one.
        """
        B = len(prompts)
        bucket = next(b for b in self.buckets if b >= B)
        r = self.runner
        self._prepare(bucket, mode)
        self.cache.reset(bucket)
        r.reset()
        r.eos_ids.fill_(-1)
        if eos:
            r.eos_ids[: len(eos)] = torch.tensor(eos, device=self.device)
        r.temperature.fill_(float(temperature))
        r.top_k.fill_(self.adapter.vocab_size if top_k is None else int(top_k))
        r.top_p.fill_(1.0 if top_p is None else float(top_p))
        if forced is not None:
            r.forced[:B, : forced.shape[1]] = forced.to(self.device)

        t0 = time.perf_counter()
        first = []
        for slot, p in enumerate(prompts):
            ids = torch.tensor(p, dtype=torch.int64, device=self.device)
            logits = prefill(self.adapter, self.cache, self.config, slot, ids)[None]  # (1, V)
            if mode == "greedy":
                first.append(logits.argmax(dim=-1))
            elif mode == "sample":
                noise = torch.empty_like(logits).exponential_()
                first.append(sample_tokens(logits, r.temperature[:1], r.top_k[:1], r.top_p[:1], noise))
            else:
                tok = r.forced[slot: slot + 1, 0]
                r.logprobs[slot, 0] = logits.log_softmax(dim=-1)[0, tok[0]]
                first.append(tok)
        first = torch.cat(first)
        r.tokens[:B] = first
        r.generated[:B, 0] = first
        r.positions[:B] = torch.tensor([len(p) for p in prompts], device=self.device)
        r.done[:B] = (first[:, None] == r.eos_ids[None, :]).any(dim=-1)
        r.done[B:bucket] = True  # padding slots of the bucket never count as unfinished
        r.step.fill_(1)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return bucket, first, time.perf_counter() - t0

    def _prepare(self, bucket: int, mode: str) -> None:
        spent = self.runner.prepare(bucket, mode)
        if spent is not None:
            self.capture_seconds[(bucket, mode)] = spent


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


def _buckets(max_batch: int) -> List[int]:
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


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


def _check_sampling(do_sample, temperature, top_k, top_p) -> str:
    """The decode mode for these arguments: "greedy" or "sample"."""
    if not do_sample:
        return "greedy"
    if not temperature > 0:
        raise ValueError(f"temperature: expected > 0, got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k: expected a positive int or None, got {top_k!r}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p: expected a value in (0, 1], got {top_p!r}")
    return "sample"
