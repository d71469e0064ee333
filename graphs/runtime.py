"""The runtime of slots: requests join (``admit``) and leave (``release``) a running batch.

The runtime owns the static cache, the per-slot device state and the graph runner. ``admit``
prefills one prompt into a free slot's region of the cache (eager) and sets only that slot's
state (``admit_batch``: several prompts into several slots, in one pass); a request with a
``prefix`` (a ``SlotSnapshot``) is admitted by restoring it and prefilling only the prompt's
tail; ``snapshot`` copies a slot's state out, the slot unchanged; ``release`` frees it; ``step``
advances every live slot by one token with one replay of the smallest captured bucket that
covers the admitted slots. All of them run between replays while other slots are
mid-generation, and none of them touches another slot.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from .cache import SlotSnapshot, StaticKVCache
from .decode import MAX_EOS_IDS, DecodeStep, RecallDecodeStep, SlotState
from .graph_runner import GraphRunner
from .prefill import prefill_pieces
from .sampling import Sampling
from .step_plan import StepPlan
from .tail import TailPrefill

@contextlib.contextmanager
def engine_mode():
    """No autograd, and never inference mode: the engine's buffers are ordinary tensors that a
    later call may update in place, and every step is traced under one grad mode (another
    would recompile), whatever mode the caller is in."""
    with torch.inference_mode(False), torch.no_grad():
        yield


def _put(buf: torch.Tensor, i: int, value) -> None:
    """``buf[i] = value`` for a Python scalar, queued on the stream: the indexing assignment
    copies the scalar from pageable host memory and waits for the GPU to drain (at admission and
    release that stalled every stream by up to two prefill layers of a 32k prompt, ~130 ms)."""
    buf[i: i + 1].fill_(value)


def _to_device(values: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values, device=device)`` without waiting for the GPU: through pinned
    memory, which the copy keeps from reuse until it is done."""
    host = torch.tensor(list(values), dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


# top_p at or above 1 turns top-p off; stored above 1 so that a cumulative sum that rounds to
# 1.0 before the last tokens never drops them.
_TOP_P_OFF = 2.0


@dataclass(frozen=True)
class Request:
    """One sequence to generate (validated by the public API before it gets here).

    prompt: token ids, ``1 <= len <= max_prompt_len``. max_new_tokens: ``1 ..`` the engine's
    ``max_new_tokens``. eos_ids: up to 8 ids that end the sequence (the eos is kept).
    forced: teacher forcing: the tokens fed instead of chosen ones (``max_new_tokens`` of them);
    their log-probabilities are recorded. min_new_tokens: eos ids cannot be chosen before this
    many tokens (HF's ``min_new_tokens``). budgets: ``(heavy_budget, recent_budget)`` of this
    request's selection, each at most the engine's (so its kept tokens fit the capacity); None:
    the engine's. prefix: a slot's snapshot holding the K/V of the prompt's first tokens
    (``prompt`` starts with ``prefix.tokens``): admission restores it and prefills only the
    tail after them (``graphs/tail.py``); None prefills the whole prompt.
    """

    prompt: Sequence[int]
    max_new_tokens: int
    eos_ids: Tuple[int, ...] = ()
    sampling: Sampling = Sampling()
    forced: Optional[Sequence[int]] = None
    min_new_tokens: int = 0
    budgets: Optional[Tuple[float, float]] = None
    prefix: Optional[SlotSnapshot] = None

    @property
    def mode(self) -> str:
        """The decode step this request needs: ``"teacher"``, ``"sample"`` or ``"greedy"``."""
        if self.forced is not None:
            return "teacher"
        banning = self.min_new_tokens > 0 and bool(self.eos_ids)
        return "sample" if self.sampling.needs_sampling_step or banning else "greedy"


class SlotRuntime:
    """``config.max_batch_size`` slots over one static cache, stepped by captured graphs.

    Buckets are the powers of two below ``max_batch_size``, and ``max_batch_size``; a step
    replays the smallest bucket above the highest admitted slot, so ``admit`` into the lowest
    free slot keeps buckets small. Modes: ``"greedy"`` (the fast path), ``"sample"`` (the
    general rule: a batch may mix greedy and sampled slots), ``"teacher"`` (alone).
    """

    def __init__(self, adapter, config, *, device: torch.device, dtype: torch.dtype,
                 compile: bool, cuda_graphs: bool):
        self.adapter, self.config, self.device = adapter, config, device
        self.cache = StaticKVCache(config, num_layers=adapter.num_layers,
                                   num_kv_heads=adapter.num_kv_heads, head_dim=adapter.head_dim,
                                   dtype=dtype, device=device, num_q_heads=adapter.num_q_heads)
        self.state = SlotState(config.max_batch_size, config.max_new_tokens, adapter.vocab_size,
                               device)
        step = DecodeStep if self.cache.recall is None else RecallDecodeStep
        # Everything the compiled step's code depends on besides the source and the versions.
        identity = repr((step.__name__, adapter.config.to_json_string(), str(dtype), config,
                         adapter.tp.rank, adapter.tp.world, adapter.tp.one_shot))
        # (bucket, mode) -> its StepPlan, built by ``prepare``; the step reads it
        self.plans: dict = {}
        self.runner = GraphRunner(functools.partial(step, adapter, self.cache, self.state,
                                                    plans=self.plans),
                                  device=device, compile=compile, cuda_graphs=cuda_graphs,
                                  state_buffers=self.state.buffers(), active=self.state.active,
                                  identity=identity)
        # a cached prompt's tail (``restore``): its layer compiled as the step's is
        self.tail = TailPrefill(adapter, self.cache, compile)
        self.buckets = _buckets(config.max_batch_size)
        self._requests: List[Optional[Request]] = [None] * config.max_batch_size
        self._reserved: set = set()  # slots whose admission is under way (admit_in_pieces)
        # per slot: the logits (V,) fp32 its admission chose the first token from, which a
        # snapshot taken before any step keeps (its last token's)
        self._logits: List[Optional[torch.Tensor]] = [None] * config.max_batch_size

    # -- slots ---------------------------------------------------------------------------------

    @property
    def admitted(self) -> List[int]:
        """Slots holding a request (finished or not), in order."""
        return [i for i, r in enumerate(self._requests) if r is not None]

    def free_slots(self) -> List[int]:
        return [i for i, r in enumerate(self._requests) if r is None and i not in self._reserved]

    def admit(self, slot: int, request: Request) -> None:
        """Prefill ``request`` into free slot ``slot`` and choose its first token
        (``admit_batch`` of one request)."""
        self.admit_batch([slot], [request])

    def admit_in_pieces(self, slot: int, request: Request, layers_per_piece: int):
        """``admit`` in pieces of layers (``admit_batch_in_pieces`` of one request)."""
        return self.admit_batch_in_pieces([slot], [request], layers_per_piece)

    def admit_batch(self, slots: Sequence[int], requests: Sequence[Request]) -> None:
        """Prefill ``requests[i]`` into free slot ``slots[i]``, all in one pass, and choose each
        one's first token.

        Sets only those slots' state: each first token is chosen by the step's own rule
        (``SlotState.choose``, the request's seed at count 0) and recorded as a step records
        its token, so the slot's next replay feeds it at position ``len(prompt)``. The prompts
        share the pass's weight reads and nothing else (``graphs/prefill.py``): each slot ends
        as its request's admission alone would leave it.
        """
        for _ in self.admit_batch_in_pieces(slots, requests, self.adapter.num_layers):
            pass

    def admit_batch_in_pieces(self, slots: Sequence[int], requests: Sequence[Request],
                              layers_per_piece: int):
        """``admit_batch`` as a generator that yields after every ``layers_per_piece`` layers of
        the prefill, so that steps of the other slots can run in between (a 32k-token prompt's
        prefill takes ~1.8 s on the 8B shape).

        Every slot and request is checked at the first ``next``, before anything is touched
        (``ValueError`` naming ``slots[i]`` / ``requests[i]``, or ``slot`` / ``request`` for a
        batch of one). The slots are reserved from then on (``free_slots`` leaves them out);
        closing the generator early, or an error in the prefill, gives every one of them back
        empty. The requests join together, once the last layer is in.
        """
        # tensor parallel: every rank admits the same requests (first: a rank whose requests
        # failed the checks alone would leave the others waiting in the next collective)
        self.adapter.tp.check_same("requests", (slots, requests))
        self._check_batch(slots, requests)
        if not (isinstance(layers_per_piece, int) and layers_per_piece >= 1):
            raise ValueError(f"layers_per_piece: expected a positive int, got {layers_per_piece!r}")
        slots, requests = list(slots), list(requests)
        self._reserved.update(slots)
        done = False
        try:
            with engine_mode():
                pieces = self._admit(slots, requests, layers_per_piece)
            while True:
                with engine_mode():
                    try:
                        next(pieces)
                    except StopIteration:
                        break
                yield
            done = True
        finally:
            self._reserved.difference_update(slots)
            if not done:
                for slot in slots:
                    _put(self.state.active, slot, False)
                    self.cache.empty_slots(slot, slot + 1)

    def _check_batch(self, slots, requests) -> None:
        """Every check of ``admit_batch_in_pieces``, before it touches anything."""
        for name, seq in (("slots", slots), ("requests", requests)):
            if not isinstance(seq, (list, tuple)):
                raise ValueError(f"{name}: expected a list, got {type(seq).__name__}")
        if not 1 <= len(slots) == len(requests):
            raise ValueError(f"requests: expected one request per slot, at least one, got "
                             f"{len(requests)} requests for {len(slots)} slots")
        one = len(requests) == 1
        for i, (slot, request) in enumerate(zip(slots, requests)):
            where = "slot" if one else f"slots[{i}]"
            self._check_slot(slot, where)
            if self._requests[slot] is not None:
                raise ValueError(f"{where}: expected a free slot, got slot {slot}, which holds "
                                 f"a request")
            if slot in self._reserved:
                raise ValueError(f"{where}: expected a free slot, got slot {slot}, which is "
                                 f"being admitted")
            self.check_request(request, "request" if one else f"requests[{i}]")
        if len(set(slots)) != len(slots):
            raise ValueError(f"slots: expected distinct slots, got {list(slots)}")
        modes = {r.mode for r in self._requests if r is not None} | {r.mode for r in requests}
        if "teacher" in modes and len(modes) > 1:
            raise ValueError(f"request: teacher forcing runs alone, got it beside other modes "
                             f"{sorted(modes)}")

    def check_request(self, r: Request, name: str = "request") -> None:
        """``ValueError`` if ``r`` does not fit this engine (its limits, vocabulary and
        budgets); a scheduler checks each request this way before batching it with others."""
        if not isinstance(r, Request):
            raise ValueError(f"{name}: expected a Request, got {type(r).__name__}")
        cfg, V = self.config, self.adapter.vocab_size
        if not 1 <= len(r.prompt) <= cfg.max_prompt_len:
            raise ValueError(f"{name}.prompt: expected 1..{cfg.max_prompt_len} tokens "
                             f"(max_prompt_len), got {len(r.prompt)}")
        if not 0 <= min(r.prompt) <= max(r.prompt) < V:  # builtins: the server checked it too
            bad = next(t for t in r.prompt if not 0 <= t < V)
            raise ValueError(f"{name}.prompt: expected token ids in [0, {V}), got {bad}")
        if not 1 <= r.max_new_tokens <= cfg.max_new_tokens:
            raise ValueError(f"{name}.max_new_tokens: expected 1..{cfg.max_new_tokens} (the "
                             f"engine's max_new_tokens), got {r.max_new_tokens}")
        if not 0 <= r.min_new_tokens <= r.max_new_tokens:
            raise ValueError(f"{name}.min_new_tokens: expected 0..{r.max_new_tokens}, "
                             f"got {r.min_new_tokens}")
        if len(r.eos_ids) > MAX_EOS_IDS or any(not 0 <= t < V for t in r.eos_ids):
            raise ValueError(f"{name}.eos_ids: expected up to {MAX_EOS_IDS} ids in [0, {V}), "
                             f"got {r.eos_ids}")
        if r.budgets is not None:
            limits = (cfg.heavy_budget, cfg.recent_budget)
            if len(r.budgets) != 2 or any(not 0.0 <= b <= m for b, m in zip(r.budgets, limits)):
                raise ValueError(f"{name}.budgets: expected (heavy, recent) each within the "
                                 f"engine's {limits}, got {r.budgets}")
        if r.forced is not None and len(r.forced) < r.max_new_tokens:
            raise ValueError(f"{name}.forced: expected max_new_tokens={r.max_new_tokens} "
                             f"tokens, got {len(r.forced)}")
        if r.prefix is not None:
            self._check_prefix(r, name)

    def _check_prefix(self, r: Request, name: str) -> None:
        """A request's prefix: its tokens start the prompt, and with the tail and the tokens
        to generate it fits a slot (``StaticKVCache.check_snapshot``)."""
        cached = r.prefix.tokens if isinstance(r.prefix, SlotSnapshot) else ()
        n = len(cached)
        if list(r.prompt[:n]) != list(cached):
            at = next((i for i, (a, b) in enumerate(zip(r.prompt, cached)) if a != b),
                      len(r.prompt))
            raise ValueError(f"{name}.prompt: expected to start with the prefix's {n} tokens, "
                             f"got a prompt of {len(r.prompt)} tokens that differs at position "
                             f"{at}")
        if n == len(r.prompt) and r.prefix.logits is None:
            raise ValueError(f"{name}.prompt: expected at least one token after the prefix's "
                             f"{n} (a snapshot taken after decoding keeps no logits of its last "
                             f"token), got none")
        if r.budgets is not None:
            raise ValueError(f"{name}.budgets: expected None with a prefix (its tokens were "
                             f"selected when it was cached; the tail is kept whole), got "
                             f"{r.budgets}")
        self.cache.check_snapshot(r.prefix, len(r.prompt) - n + r.max_new_tokens,
                                  f"{name}.prefix")

    def _admit(self, slots: List[int], requests: List[Request], layers_per_piece: int):
        """Set each slot's state, prefill the prompts in one pass, choose the first tokens;
        the slots join (``active``, ``_requests``) only once all of that is done."""
        st, dev = self.state, self.device
        prompts, configs = [], []
        for s, request in zip(slots, requests):
            prompts.append(self._set_slot(s, request))
            configs.append(self.config if request.budgets is None else dataclasses.replace(
                self.config, heavy_budget=request.budgets[0], recent_budget=request.budgets[1]))
        fresh = [i for i, r in enumerate(requests) if r.prefix is None]
        rows_of = [None] * len(requests)  # each request's logits (1, V) fp32
        if fresh:
            logits = yield from prefill_pieces(
                self.adapter, self.cache, [configs[i] for i in fresh], [slots[i] for i in fresh],
                [prompts[i] for i in fresh], layers_per_piece)  # (n, V) fp32
            for j, i in enumerate(fresh):
                rows_of[i] = logits[j: j + 1]
        for i, (s, request) in enumerate(zip(slots, requests)):
            if request.prefix is not None:
                rows_of[i] = yield from self._restore(s, request.prefix, prompts[i])
        live = torch.ones(1, dtype=torch.bool, device=dev)
        for i, (s, request) in enumerate(zip(slots, requests)):
            rows = slice(s, s + 1)
            self._logits[s] = rows_of[i][0]
            first = st.choose(rows_of[i], rows, request.mode, live)
            _put(st.positions, s, len(request.prompt) - 1)  # the last prompt token, prefill fed
            st.record(first, rows, live)
            if self.cache.recall is not None:  # SpeCache: the slot's next step pre-decodes
                st.spec[rows].copy_(st.tokens[rows])  # (its recall state was reset when emptied)
                _put(st.pre, s, True)
        for s, request in zip(slots, requests):
            _put(st.active, s, True)
            self._requests[s] = request

    def _restore(self, s: int, prefix: SlotSnapshot, prompt: torch.Tensor):
        """Slot ``s`` takes ``prefix`` and the prompt's tail after it (a generator of
        ``TailPrefill``'s chunks); returns the logits of the prompt's last token (1, V) fp32."""
        self.cache.restore(s, prefix)
        n = len(prefix.tokens)
        if n == prompt.shape[0]:
            return prefix.logits[None].to(self.device)
        return (yield from self.tail(s, prompt[n:], n))

    def snapshot(self, slot: int) -> SlotSnapshot:
        """Slot ``slot``'s state as a ``SlotSnapshot``, the slot unchanged: the K/V of every
        token it has fed (its prompt and the generated tokens before the newest, which is
        chosen, not fed yet: what HF's cache holds after ``generate``), and the logits of the
        last prompt token while nothing has been fed after it. One host sync."""
        self._check_slot(slot)
        request = self._requests[slot]
        if request is None:
            raise ValueError(f"slot: expected a slot holding a request, got free slot {slot}")
        fed = int(self.state.positions[slot])
        prompt = list(request.prompt)
        tokens = prompt + self.outputs([slot])[0][: fed - len(prompt)]
        return self.cache.snapshot(slot, tokens,
                                   self._logits[slot] if fed == len(prompt) else None)

    def _set_slot(self, s: int, request: Request) -> torch.Tensor:
        """Slot ``s``'s state for ``request`` (not active: not stepped until admission is
        complete); returns its prompt ``(L,)`` int64 on the device. Queued behind the GPU's work,
        never waiting for it (``_put`` / ``_to_device``)."""
        st, dev = self.state, self.device
        ids = _to_device(request.prompt, torch.int64, dev)
        p = request.sampling
        for buf, value in (
                (st.limit, request.max_new_tokens), (st.minimum, request.min_new_tokens),
                (st.greedy, p.greedy),
                (st.temperature, 1.0 if p.greedy else float(p.temperature)),
                (st.top_k, self.adapter.vocab_size if p.greedy or p.top_k is None
                 else int(p.top_k)),
                (st.top_p, _TOP_P_OFF if p.greedy or p.top_p >= 1.0 else float(p.top_p)),
                (st.penalty, float(p.repetition_penalty)),
                (st.count, 0), (st.done, False), (st.active, False)):
            _put(buf, s, value)
        st.eos_ids[s].fill_(-1)
        if request.eos_ids:
            st.eos_ids[s, : len(request.eos_ids)].copy_(
                _to_device(request.eos_ids, torch.int64, dev))
        if p.seed is not None:
            _put(st.seed, s, p.seed)
        elif not p.greedy:  # greedy requests leave the caller's generator alone
            # (rank 0's draw on every rank: each process has a generator of its own)
            _put(st.seed, s, self.adapter.tp.from_rank0(int(torch.randint(0, 2**62, ()).item()),
                                                        dev))
        st.seen[s].fill_(False)
        st.seen[s].index_fill_(0, ids, True)
        if request.forced is not None:
            st.forced[s].fill_(0)
            st.forced[s, : len(request.forced)].copy_(
                _to_device(request.forced, torch.int64, dev))
        return ids

    def release(self, slot: int) -> None:
        """Free ``slot`` (its request finished or was cancelled); other slots are untouched."""
        self._check_slot(slot)
        if self._requests[slot] is None:
            raise ValueError(f"slot: expected a slot holding a request, got free slot {slot}")
        _put(self.state.active, slot, False)
        self.cache.empty_slots(slot, slot + 1)
        self._requests[slot] = None
        self._logits[slot] = None

    def finish(self, slot: int) -> None:
        """Mark ``slot`` finished (a stopping criterion of the caller's said so); it keeps its
        outputs until released."""
        self._check_slot(slot)
        if self._requests[slot] is None:
            raise ValueError(f"slot: expected a slot holding a request, got free slot {slot}")
        _put(self.state.done, slot, True)

    def release_all(self) -> None:
        for slot in self.admitted:
            self.release(slot)

    # -- stepping ------------------------------------------------------------------------------

    @property
    def extra_steps(self) -> int:
        """Steps a request takes besides one per token after its first: SpeCache's
        pre-decoding step (``RecallDecodeStep``), or none; unless ``recall_resync`` is "off",
        at least that (one more for each missed guess)."""
        return 0 if self.cache.recall is None else 1

    def step_key(self) -> Tuple[int, str]:
        """(bucket, mode) the next step replays."""
        admitted = self.admitted
        if not admitted:
            raise RuntimeError("step: expected at least one admitted slot, got none")
        bucket = next(b for b in self.buckets if b > admitted[-1])
        modes = {self._requests[i].mode for i in admitted}
        mode = "teacher" if "teacher" in modes else "sample" if "sample" in modes else "greedy"
        return bucket, mode

    def step(self) -> None:
        """Advance every live slot by one token (no host synchronization)."""
        key = self.step_key()
        if key not in self.plans:
            self.prepare(*key)
        with engine_mode():
            self.runner.run(key)

    def prepare(self, bucket: int, mode: str) -> Optional[float]:
        """Build the ``StepPlan`` of ``(bucket, mode)`` (once), then compile and capture the
        step ahead of use; seconds spent compiling and capturing, None if it was ready."""
        if bucket not in self.buckets:
            raise ValueError(f"bucket: expected one of {self.buckets}, got {bucket!r}")
        self.plan(bucket, mode)
        with engine_mode():
            return self.runner.prepare((bucket, mode))

    def plan(self, bucket: int, mode: str) -> StepPlan:
        """The plan of ``(bucket, mode)``, built on the first ask (``prepare``)."""
        key = (bucket, mode)
        if key not in self.plans:
            self.plans[key] = StepPlan.build(self.adapter, self.cache, bucket, mode)
        return self.plans[key]

    def finished(self, slots: Sequence[int]) -> List[bool]:
        """Whether each of ``slots`` has finished (a host sync)."""
        done = self.state.done.tolist()
        return [done[s] for s in slots]

    def outputs(self, slots: Sequence[int]) -> List[List[int]]:
        """The tokens each of ``slots`` generated so far (a host sync)."""
        count = self.state.count.tolist()
        rows = self.state.generated[: max(slots) + 1].tolist()
        return [rows[s][: count[s]] for s in slots]

    def poll(self, slots: Sequence[int]) -> Tuple[List[int], List[int], List[bool]]:
        """(tokens generated, newest token, finished) of each of ``slots``: one host sync."""
        return self.poll_later(slots)()

    def poll_later(self, slots: Sequence[int]
                   ) -> Callable[[], Tuple[List[int], List[int], List[bool]]]:
        """``poll`` as of now, read later: the snapshot is copied to pinned host memory behind
        the work queued so far, and the returned function waits for that copy alone, so the
        host can read step ``n`` while the GPU runs step ``n + 1``."""
        st = self.state
        packed = torch.stack([st.count, st.generated.gather(
            1, (st.count - 1).clamp(min=0)[:, None])[:, 0], st.done.long()])  # (3, Bmax)
        if packed.device.type == "cuda":
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        else:
            host, copied = packed, None

        def read() -> Tuple[List[int], List[int], List[bool]]:
            if copied is not None:
                copied.synchronize()
            rows = host.tolist()
            return ([rows[0][s] for s in slots], [rows[1][s] for s in slots],
                    [bool(rows[2][s]) for s in slots])
        return read

    def logprobs(self, slots: Sequence[int]) -> List[torch.Tensor]:
        """Teacher mode: the log-probability of each forced token of ``slots`` so far, fp32 CPU."""
        count = self.state.count.tolist()
        rows = self.state.logprobs[: max(slots) + 1].cpu()
        return [rows[s, : count[s]].clone() for s in slots]

    def _check_slot(self, slot, name: str = "slot") -> None:
        n = self.config.max_batch_size
        if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < n:
            raise ValueError(f"{name}: expected an int in [0, {n}), got {slot!r}")


def _buckets(max_batch: int) -> List[int]:
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


__all__ = ["Request", "SlotRuntime", "MAX_EOS_IDS"]
