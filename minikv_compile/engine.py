"""``minikv_compile(model)``: the compiled model object users hold."""
from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Union

import torch
from torch import nn

from transformers.generation.utils import GenerateDecoderOnlyOutput

from minikv_compile.graphs import budget
from minikv_compile.graphs.cache import KVMemoryReport, kv_memory_report
from minikv_compile.graphs.runtime import Request, SlotRuntime, engine_mode
from minikv_compile.graphs.sampling import Sampling
from minikv_compile.models import TensorParallel, get_adapter

from . import generation
from . import prompt_cache as pc
from .config import MiniKVConfig
from .inputs import check_int, token_rows
from .prompt_cache import PromptCache

_DTYPES_CUDA = (torch.float16, torch.bfloat16)
_DTYPES_CPU = (torch.float16, torch.bfloat16, torch.float32)

Prompts = Union[torch.Tensor, Sequence[Sequence[int]]]
_CACHE_FIELD = ("cache" if "cache" in {f.name for f in dataclasses.fields(GenerateDecoderOnlyOutput)}
                else "past_key_values")


@dataclass
class GenerationOutput:
    """What ``generate`` returns.

    sequences: generated token ids per sequence (the prompt excluded; cut after the eos token,
    which is included). stop_reasons: ``"eos"``, ``"stop"`` (a stopping criterion) or
    ``"length"`` per sequence.
    """

    sequences: List[List[int]]
    stop_reasons: List[str]
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int
    batch_bucket: int
    timings: Dict[str, float] = field(default_factory=dict)
    snapshots: Optional[list] = None  # each slot's SlotSnapshot at the end (internal)

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens the decode steps generated per second of decode, all sequences of the batch
        (each sequence's first token comes from the prefill; SpeCache's pre-decoding steps
        generate none)."""
        n = sum(len(s) for s in self.sequences) - len(self.sequences)
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

    With ``config.tensor_parallel = N > 1`` this object is one rank's engine: the model is
    sharded in place to the rank's share (``models/parallel.py``), every rank builds it and
    calls ``generate`` / ``teacher_force`` with the same arguments and gets the same tokens
    (``ValueError`` on every rank if the arguments differ), and ``kv_memory`` reports the
    rank's own shard of the cache.

    ``generate`` and ``teacher_force`` hold one lock, so threads sharing a model are served one
    after another. ``runtime`` (admit / release / step) is for one owner, such as a scheduler
    loop; ``generate`` refuses to run while slots it did not admit are in use.
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
                                   fuse_projections=on_cuda,
                                   tp=TensorParallel.from_default_group(config.tensor_parallel))
        a = self.adapter
        if a.num_q_heads % a.num_kv_heads:
            raise NotImplementedError(f"expected num_attention_heads % num_key_value_heads == 0, "
                                      f"got {a.num_q_heads} % {a.num_kv_heads}")
        # both of the head's requirements in one error (a head of 80 or 96 channels fails the
        # default's rotation and its group of 64 alike)
        wrong = []
        if config.rotation == "hadamard" and a.head_dim & (a.head_dim - 1):
            wrong.append(f"rotation='hadamard' (the default at 1-4 bits): expected a head_dim that "
                         f"is a power of two, got {a.head_dim}; pass rotation='none'")
        gv = budget.value_group(config.group_size, a.head_dim)  # channels of a value group
        if a.head_dim % gv or (config.bits < 16 and gv % (32 // config.bits)):
            wrong.append(f"group_size: expected a divisor of head_dim={a.head_dim} or a size "
                         f"above it (a value group is then the whole head, whose channels one "
                         f"int32's codes at bits={config.bits} must divide), got "
                         f"{config.group_size}")
        if wrong:
            raise ValueError("; and ".join(wrong))
        a.rotate_heads(config.rotation)  # folds into the adapter's copies, never the model's
        self._lock = threading.RLock()
        self._fingerprint: Optional[Dict[str, object]] = None
        with engine_mode():
            self.runtime = SlotRuntime(a, config, device=self.device, dtype=self.dtype,
                                       compile=use_compile, cuda_graphs=use_graphs)
            if use_graphs:
                # The full bucket is captured now; smaller buckets and other modes on first use
                # (each costs one compile, so a batch-1 user of a batch-64 engine pays only for 1).
                self.runtime.prepare(self.runtime.buckets[-1], "greedy")

    # -- public ------------------------------------------------------------------------------

    def generate(self, inputs=None, generation_config=None, streamer=None,
                 stopping_criteria=None, *, input_ids=None, attention_mask=None,
                 past_key_values: Optional[PromptCache] = None,
                 seed: Optional[int] = None, eos_check_every: int = 8, **kwargs):
        """Generate for each prompt, with HF's arguments (decoder-only greedy and sampling).

        inputs / input_ids: ``(B, L)`` or ``(L,)`` integer ids (tensor or numpy), a list of
            token-id lists of any lengths, or a ``BatchEncoding`` / dict from a tokenizer (also as
            ``**tokenizer(...)``); attention_mask: 0/1 of the ids' shape (left or right padding).
        generation_config, kwargs: HF's settings (``max_new_tokens``, ``max_length``,
            ``min_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
            ``repetition_penalty``, ``eos_token_id``, ``pad_token_id``,
            ``return_dict_in_generate``); defaults from ``model.generation_config``, then HF's,
            and the engine's ``max_new_tokens`` for the length. ``eos_token_id=[]`` turns eos off.
        streamer: an HF streamer (``put`` the prompt, then each step's tokens, then ``end``), or
            a callable given one list per step that made a token (each sequence's new token,
            None where it made none: stopped).
        stopping_criteria: HF's (``criteria(ids (B, L + n), None) -> (B,) bool``), asked after
            every token; each ask syncs with the host.
        past_key_values: a ``PromptCache`` (``cache_prompt``, an earlier call's output, or
            ``load_prompt_cache``) of one sequence per prompt; prompt ``i`` must start with its
            ``token_ids[i]``. Each sequence's compressed state is restored into a slot and only
            the tokens after it are prefilled (``graphs/tail.py``): they join the cache as
            generated tokens do (kept whole; with recall they attend to the quantized cache
            without recalled rows); the cache is not changed.
        seed: sampling seed of the first sequence (sequence ``i`` draws with ``seed + i``); None
            draws from torch's global generator.
        eos_check_every: steps between host checks of "all sequences finished".

        Returns a ``GenerationOutput`` (new tokens per sequence, cut after the eos), or, with
        ``return_dict_in_generate=False`` / ``True``, what HF returns: a ``(B, L + n)`` tensor of
        the input and the new tokens (padded with the pad id), or HF's
        ``GenerateDecoderOnlyOutput`` with that tensor as ``sequences`` and, as
        ``past_key_values`` (unless ``use_cache=False``, or with tensor parallel: None), the
        ``PromptCache`` of each prompt and its new tokens but the last (which is chosen, not
        fed: HF's cache holds the same), for the next turn.
        """
        if inputs is not None and input_ids is not None:
            raise ValueError("input_ids: expected the prompt once (inputs or input_ids), got both")
        ids = input_ids if inputs is None else inputs
        if ids is None:
            raise ValueError("input_ids: expected token ids, got None")
        vocab = self.adapter.vocab_size
        plan = generation.resolve(self.model, generation_config, kwargs, vocab_size=vocab,
                                  capacity=self.config.max_new_tokens,
                                  input_width=_input_width(ids), seed=seed)
        prompts = self._check_prompts(ids, attention_mask, plan.declared_pad)
        every = check_int("eos_check_every", eos_check_every, lo=1)
        generation.check_streamer(streamer)
        if stopping_criteria is not None and not callable(stopping_criteria):
            raise ValueError(f"stopping_criteria: expected a callable (HF's StoppingCriteriaList), "
                             f"got {type(stopping_criteria).__name__}")
        hf_streamer = streamer is not None and not callable(streamer)
        tensors = plan.output != "engine" or hf_streamer or stopping_criteria is not None
        if (plan.pad is None and tensors and not isinstance(ids, torch.Tensor)
                and len({len(p) for p in prompts}) > 1):  # HF's tensors: refused before work
            raise ValueError("pad_token_id: expected an id to pad prompts of different lengths "
                             "into one tensor, got None (and no eos id)")
        prefixes = self._check_prefixes(past_key_values, prompts)
        # (a rank's shard of a cache is not a PromptCache: _check_no_tensor_parallel)
        keep_cache = plan.keep_cache and self.adapter.tp.world == 1
        requests = [Request(p, plan.max_new_tokens, plan.eos, _seeded(plan.sampling, seed, i),
                            min_new_tokens=plan.min_new_tokens, prefix=prefixes[i])
                    for i, p in enumerate(prompts)]
        if past_key_values is not None:  # every request, before any is admitted
            for i, request in enumerate(requests):
                self.runtime.check_request(request, f"input_ids[{i}]")
        if hf_streamer:
            streamer.put(generation.hf_sequences(ids, prompts, [[]] * len(prompts), plan.pad))
        stop = None
        if stopping_criteria is not None:
            stop = lambda outs: generation.stop_flags(stopping_criteria(  # noqa: E731
                generation.hf_sequences(ids, prompts, outs, plan.pad), None), len(prompts))
        try:
            with self._lock:
                out = self._run(requests,
                                _stream_to(streamer, plan.pad) if hf_streamer else streamer,
                                every, stop, snapshot=keep_cache)
        finally:  # also when the call fails: a consumer iterating the streamer is not left waiting
            if hf_streamer:
                streamer.end()
        if plan.output == "engine":
            return out
        sequences = generation.hf_sequences(ids, prompts, out.sequences, plan.pad)
        if plan.output == "tensor":
            return sequences
        # transformers 5 names the field ``cache`` (``past_key_values`` reads it, with a warning)
        cache = self._prompt_cache(out.snapshots) if keep_cache else None
        return GenerateDecoderOnlyOutput(sequences=sequences, **{_CACHE_FIELD: cache})

    def cache_prompt(self, input_ids: Prompts, attention_mask=None) -> PromptCache:
        """Prefill and compress each prompt as ``generate`` would, and return their state as a
        ``PromptCache`` (on this engine's device, tied to no slot) instead of generating:
        ``generate(prompt + more, past_key_values=cache)`` then prefills only ``more``.

        input_ids / attention_mask: as ``generate``'s (one sequence per prompt, at most
        ``max_batch_size``). The cache keeps the logits of each prompt's last token, so a
        prompt equal to the cached one (nothing after it) generates too.
        """
        self._check_no_tensor_parallel("cache_prompt")
        prompts = self._check_prompts(input_ids, attention_mask, None)
        requests = [Request(p, 1) for p in prompts]
        with self._lock:
            rt = self.runtime
            self._check_runtime_free()
            try:
                for slot, request in enumerate(requests):
                    rt.admit(slot, request)
                return self._prompt_cache([rt.snapshot(s) for s in range(len(requests))])
            finally:
                rt.release_all()

    def load_prompt_cache(self, path) -> PromptCache:
        """The ``PromptCache`` saved at ``path`` (``PromptCache.save``), onto this engine's
        device (nothing is compiled). ``ValueError`` naming the field where the file's model
        fingerprint, compression config or format version differs from this engine's, or a
        tensor whose shape or dtype is not what this engine's slots hold."""
        self._check_no_tensor_parallel("load_prompt_cache")
        cache = pc.load(path, fingerprint=self.fingerprint, config=pc.cache_config(self.config),
                        device=self.device, num_layers=self.adapter.num_layers)
        for i, snap in enumerate(cache.sequences):
            self.runtime.cache.check_snapshot(snap, 0, f"path: sequence {i}")
        return cache

    @property
    def fingerprint(self) -> Dict[str, object]:
        """The model's identity a ``PromptCache`` must match (``prompt_cache.model_fingerprint``;
        computed once)."""
        if self._fingerprint is None:
            self._fingerprint = pc.model_fingerprint(self.model, self.adapter, self.dtype)
        return self._fingerprint

    def _prompt_cache(self, snapshots) -> PromptCache:
        return PromptCache(snapshots, fingerprint=self.fingerprint,
                           config=pc.cache_config(self.config), device=self.device)

    def _check_prefixes(self, cache: Optional[PromptCache], prompts: List[List[int]]) -> list:
        """Each prompt's ``SlotSnapshot`` from ``cache`` (None for all without one); a
        ``ValueError`` naming what differs: the model, config, device, batch or tokens."""
        if cache is None:
            return [None] * len(prompts)
        self._check_no_tensor_parallel("past_key_values")
        pc.check_compatible(cache, fingerprint=self.fingerprint,
                            config=pc.cache_config(self.config), device=self.device)
        if len(cache) != len(prompts):
            raise ValueError(f"past_key_values: expected one cached sequence per prompt "
                             f"({len(prompts)}), got a cache of {len(cache)}")
        for i, (prompt, seq) in enumerate(zip(prompts, cache.sequences)):
            n = len(seq.tokens)
            if prompt[:n] != list(seq.tokens):
                at = next((j for j, (a, b) in enumerate(zip(prompt, seq.tokens)) if a != b),
                          len(prompt))
                raise ValueError(f"input_ids[{i}]: expected to start with the cache's {n} "
                                 f"tokens (past_key_values.token_ids[{i}]), got {len(prompt)} "
                                 f"tokens that differ from them at position {at}")
        return list(cache.sequences)

    def _check_no_tensor_parallel(self, what: str) -> None:
        if self.adapter.tp.world > 1:
            raise NotImplementedError(f"{what}: prompt caches with tensor_parallel="
                                      f"{self.adapter.tp.world} (each rank holds a shard of the "
                                      f"cache); expected tensor_parallel=1")

    def _check_runtime_free(self) -> None:
        if self.runtime.admitted:
            raise ValueError(f"generate: expected a runtime without requests, got slots "
                             f"{self.runtime.admitted} admitted through model.runtime; release "
                             f"them first")

    def teacher_force(self, input_ids: Prompts, targets: Sequence[Sequence[int]],
                      attention_mask: Optional[torch.Tensor] = None,
                      past_key_values: Optional[PromptCache] = None) -> List[torch.Tensor]:
        """Log-probabilities of ``targets[i]`` after ``input_ids[i]``, through the decode path.

        The prompt is prefilled (and compressed) as in ``generate``; then each target token is
        fed through the same compiled / captured decode step instead of a chosen one, so flushes
        and the ring are exercised exactly as in generation. Returns one (len(targets[i]),) fp32
        CPU tensor per sequence: ``log p(targets[i][j] | prompt, targets[i][:j])``.
        ``past_key_values``: as ``generate``'s (the prompt's cached prefix restored, its tail
        prefilled).
        """
        prompts = self._check_prompts(input_ids, attention_mask, None)
        vocab = self.adapter.vocab_size
        if isinstance(targets, (str, bytes)) or not hasattr(targets, "__len__"):
            raise ValueError(f"targets: expected one token-id list per prompt, got {targets!r}")
        if len(targets) != len(prompts):
            raise ValueError(f"targets: expected one list per prompt ({len(prompts)}), got {len(targets)}")
        rows = [token_rows([list(t)], None, vocab)[0] if len(t) else [] for t in targets]
        if any(len(t) == 0 for t in rows):
            raise ValueError("targets: expected at least one token per sequence, got an empty list")
        cap = self.config.max_new_tokens
        if max(len(t) for t in rows) > cap:
            raise ValueError(f"targets: expected at most {cap} tokens per sequence (max_new_tokens), "
                             f"got {max(len(t) for t in rows)}")
        prefixes = self._check_prefixes(past_key_values, prompts)
        requests = [Request(p, len(t), (), Sampling(), forced=t, prefix=c)
                    for p, t, c in zip(prompts, rows, prefixes)]
        if past_key_values is not None:  # every request, before any is admitted
            for i, request in enumerate(requests):
                self.runtime.check_request(request, f"input_ids[{i}]")
        with self._lock:
            return self._run(requests, None, 1 << 30, None, logprobs=True)

    def kv_memory(self, prompt_len: Optional[int] = None, new_tokens: Optional[int] = None,
                  batch: Optional[int] = None) -> KVMemoryReport:
        """KV bytes of ``batch`` sequences of ``prompt_len + new_tokens`` tokens (the configured
        maxima by default) in this cache, against an uncompressed cache of the same batch and
        lengths in the model's dtype; the whole allocation is reported beside. With tensor
        parallel: this rank's KV heads (its shard of the cache), against theirs uncompressed."""
        cfg = self.config
        L = cfg.max_prompt_len if prompt_len is None else check_int(
            "prompt_len", prompt_len, lo=1, hi=cfg.max_prompt_len)
        n = cfg.max_new_tokens if new_tokens is None else check_int(
            "new_tokens", new_tokens, lo=0, hi=cfg.max_new_tokens)
        B = cfg.max_batch_size if batch is None else check_int(
            "batch", batch, lo=1, hi=cfg.max_batch_size)
        a = self.adapter
        kept = budget.kept_per_layer(cfg, L, a.num_layers)
        report = kv_memory_report(self.runtime.cache, kept=kept, prompt_len=L, new_tokens=n,
                                  batch=B)
        if a.tp.world == 1:
            return report
        shard = (f"tensor parallel: rank {a.tp.rank} of {a.tp.world}, its {a.num_kv_heads} of "
                 f"{a.num_kv_heads * a.tp.world} KV heads (every figure is this rank's)")
        return dataclasses.replace(report, notes=report.notes + [shard])

    def unfuse_projections(self) -> None:
        """Give the model's q/k/v and gate/up modules their own weights back (undoing the
        in-place concatenation done on CUDA); this engine must not be used afterwards."""
        with self._lock:
            self.adapter.unfuse()
            self.runtime = None

    @property
    def stats(self) -> Dict[str, object]:
        """Compiles and replays so far: proof that the decode step is compiled once per bucket
        and really replayed from CUDA graphs (``compiles``: the compiled graphs run, ``loaded``:
        those of them an earlier process compiled and saved); and per ``(bucket, mode)`` (every
        bucket's greedy step, and the other modes prepared so far) every kernel its step runs,
        with its launch (``graphs.step_plan.StepPlan.kernels``)."""
        r, rt = self.runtime.runner, self.runtime
        keys = sorted({(b, "greedy") for b in rt.buckets} | set(rt.plans))
        return {"compiles": r.compiles, "loaded": r.loads, "replays": r.replays,
                "graphs": r.graphs,
                "compile_seconds": dict(r.compile_seconds),
                "capture_seconds": dict(r.capture_seconds),
                "kernels": {key: rt.plan(*key).kernels() for key in keys}}

    # -- internals -----------------------------------------------------------------------------

    def _run(self, requests: List[Request], streamer, eos_check_every: int, stop,
             logprobs: bool = False, snapshot: bool = False):
        """Admit every request (slots 0..B-1), step until all finished, collect, release.

        streamer: a callable given one list per step; stop: given the outputs so far, returns a
        B flags of sequences to end (HF's stopping criteria). Returns a ``GenerationOutput``
        (with ``snapshot``: each slot's ``SlotSnapshot`` at the end, in ``snapshots``), or with
        ``logprobs`` the teacher-forced log-probabilities of each sequence."""
        rt, B = self.runtime, len(requests)
        slots = list(range(B))
        self._check_runtime_free()
        snapshots = None
        stopped = [False] * B
        try:
            t0 = time.perf_counter()
            for slot, request in zip(slots, requests):
                rt.admit(slot, request)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            t1 = time.perf_counter()
            watch = streamer is not None or stop is not None  # a host sync every step
            finished = rt.finished(slots) if watch else None
            if streamer is not None:
                streamer([out[0] for out in rt.outputs(slots)])
                counts = [1] * B
            # steps after the first token (SpeCache: and each slot's pre-decoding step); unless
            # recall_resync is "off" each missed guess takes one more, so past ``last`` the loop
            # looks at the finished flags every step, for at most one step more a token
            last = max(r.max_new_tokens for r in requests) - 1 + self.runtime.extra_steps
            resync = self.config.recall_resync != "off"
            steps = 0
            asked = None  # the output lengths the stopping criteria last saw

            def ask() -> List[bool]:
                """The criteria's flags, each new token seen once (not again after a step that
                added none: SpeCache's pre-decoding step): all False when nothing is new."""
                nonlocal asked
                outputs = rt.outputs(slots)
                if [len(o) for o in outputs] == asked:
                    return [False] * B
                asked = [len(o) for o in outputs]
                return stop(outputs)

            eos = any(r.eos_ids for r in requests)
            while steps < (2 * last if resync else last):
                if watch:  # one sync a step anyway: look before every step
                    if stop is not None:
                        for slot, end in zip(slots, ask()):
                            if end and not finished[slot]:
                                rt.finish(slot)
                                stopped[slot] = True
                        finished = rt.finished(slots)
                    if all(finished):
                        break
                elif (((eos and steps % eos_check_every == 0) or steps >= last)
                      and all(rt.finished(slots))):
                    break  # (at step 0 too: every sequence may have ended with its first token)
                rt.step()
                steps += 1
                if streamer is not None:  # each new token and the finished flags: one read
                    now_counts, new, now_finished = rt.poll(slots)
                    # a slot that generated nothing this step (SpeCache's pre-decoding step, a
                    # finished one) streams nothing; a step where none did is not streamed
                    if any(n > c for c, n in zip(counts, now_counts)):
                        streamer([t if n > c else None for c, n, t in zip(counts, now_counts, new)])
                    counts, finished = now_counts, now_finished
                elif watch:
                    finished = rt.finished(slots)
            if stop is not None:  # the criteria see the last token too
                for slot, end in zip(slots, ask()):
                    stopped[slot] = stopped[slot] or (end and not finished[slot])
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            t2 = time.perf_counter()
            if logprobs:
                return rt.logprobs(slots)
            sequences = rt.outputs(slots)
            if snapshot:
                snapshots = [rt.snapshot(s) for s in slots]
        finally:
            rt.release_all()
        reasons = ["eos" if seq and seq[-1] in r.eos_ids else "stop" if s else "length"
                   for seq, r, s in zip(sequences, requests, stopped)]
        bucket = next(b for b in rt.buckets if b >= B)
        return GenerationOutput(sequences=sequences, stop_reasons=reasons, prefill_seconds=t1 - t0,
                                decode_seconds=t2 - t1, decode_steps=steps, batch_bucket=bucket,
                                snapshots=snapshots)

    def _check_prompts(self, input_ids, attention_mask, pad_token_id) -> List[List[int]]:
        cfg = self.config
        prompts = token_rows(input_ids, attention_mask, self.adapter.vocab_size,
                             pad_token_id=pad_token_id)
        if len(prompts) > cfg.max_batch_size:
            raise ValueError(f"batch: expected at most max_batch_size={cfg.max_batch_size} prompts, "
                             f"got {len(prompts)}")
        for i, p in enumerate(prompts):
            if not 1 <= len(p) <= cfg.max_prompt_len:
                raise ValueError(f"prompt {i}: expected 1..{cfg.max_prompt_len} tokens "
                                 f"(max_prompt_len), got {len(p)}")
        return prompts


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


def _input_width(ids) -> int:
    """The input length HF measures ``max_length`` against: a tensor's (padded) width, the
    longest list."""
    if hasattr(ids, "keys") and "input_ids" in ids:
        ids = ids["input_ids"]
    shape = getattr(ids, "shape", None)
    if shape is not None and len(shape) >= 1:
        return int(shape[-1])
    if isinstance(ids, (list, tuple)) and ids and getattr(ids[0], "ndim", 1) >= 1 \
            and hasattr(ids[0], "__len__"):  # rows: lists, 1-D tensors or arrays
        return max(len(r) for r in ids)
    return len(ids) if isinstance(ids, (list, tuple)) else 0


def _stream_to(streamer, pad: Optional[int]):
    """A step callback feeding an HF streamer each step's tokens as a (B,) tensor (the pad id,
    or 0 without one, for sequences that have stopped, as HF does)."""
    fill = 0 if pad is None else pad
    return lambda tokens: streamer.put(torch.tensor([fill if t is None else t for t in tokens]))


def _seeded(sampling: Sampling, seed: Optional[int], index: int) -> Sampling:
    """``sampling`` with the seed of sequence ``index`` of a call (``seed + index``)."""
    if seed is None or sampling.greedy:
        return sampling
    return dataclasses.replace(sampling, seed=seed + index)
