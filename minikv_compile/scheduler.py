"""Continuous batching: one loop owns the engine's slots; requests join and leave between steps.

The loop admits waiting requests into free slots (the lowest first, so the replayed bucket stays
small), several short prompts in one prefill pass (they share its weight reads), one prefill
piece (``prefill_layers`` layers) between two decode steps so that a long prompt does not
freeze the running streams, replays one decode step for every live slot, reads each slot's new
token (one host sync a step: the price of streaming), turns tokens into text incrementally, and
ends a request the step it finishes (eos, a stop string, ``max_tokens``, cancellation), freeing
its slot at once. A request that fails (bad input the checks missed, an error in its prefill)
ends with an error of its own; the engine and every other request go on.
"""
from __future__ import annotations

import collections
import itertools
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, Iterator, List, Optional, Sequence, Tuple

from minikv_compile.graphs.runtime import Request
from minikv_compile.graphs.sampling import Sampling

from .engine import MiniKVModel

# Histogram bucket upper bounds (seconds) of the latency metrics.
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class QueueFull(Exception):
    """The waiting queue is at its bound; try again after ``retry_after`` seconds."""

    def __init__(self, depth: int, retry_after: float):
        super().__init__(f"queue: expected fewer than {depth} waiting requests, got {depth}; "
                         f"retry after {retry_after:.0f} s")
        self.depth, self.retry_after = depth, retry_after


@dataclass(frozen=True)
class ServeRequest:
    """One completion to generate (validated by the caller: the server).

    prompt_ids: the tokenized prompt (chat template already applied). max_tokens: new tokens at
    most. stop: strings that end the completion when they appear in its text (not included).
    eos_ids: token ids that end it (not included in the text). budgets: (heavy, recent) of this
    request's selection, within the engine's; None for the engine's own.
    """

    prompt_ids: Sequence[int]
    max_tokens: int
    sampling: Sampling = Sampling()
    stop: Tuple[str, ...] = ()
    eos_ids: Tuple[int, ...] = ()
    budgets: Optional[Tuple[float, float]] = None


@dataclass
class Delta:
    """What a request produced since the last one: new text (never a broken character), its
    token ids, and ``finish_reason`` on the last delta (``"stop"``, ``"length"``,
    ``"cancelled"`` or ``"error"``; ``error`` then says why)."""

    text: str
    token_ids: List[int]
    finish_reason: Optional[str] = None
    error: Optional[str] = None


class IncrementalDetokenizer:
    """Text of a growing token list, emitted only up to the last complete character.

    Decodes a short window (``prefix`` .. end) each time and emits what it adds beyond the
    window's earlier text; a decode ending in U+FFFD (half of a multi-byte character) waits.
    """

    def __init__(self, tokenizer, prompt_tail: Sequence[int] = ()):
        self.tok = tokenizer
        self.tokens: List[int] = list(prompt_tail)[-4:]  # context for the first tokens' spaces
        self.prefix = 0
        self.read = len(self.tokens)

    def push(self, token_id: int) -> str:
        self.tokens.append(token_id)
        before = self.tok.decode(self.tokens[self.prefix:self.read], skip_special_tokens=True)
        after = self.tok.decode(self.tokens[self.prefix:], skip_special_tokens=True)
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""
        self.prefix, self.read = self.read, len(self.tokens)
        return after[len(before):]


class Handle:
    """A submitted request: iterate it for ``Delta`` s until one carries a finish reason, or
    (``on_delta`` given to ``submit``) have each delta handed to that callable instead."""

    def __init__(self, request_id: str, request: ServeRequest,
                 on_delta: Optional[Callable[[Delta], None]] = None):
        self.id, self.request = request_id, request
        self.created = time.perf_counter()
        self.first_token_at: Optional[float] = None
        self.prompt_tokens = len(request.prompt_ids)
        self.completion_tokens = 0
        self.finish_reason: Optional[str] = None
        self.cancelled = threading.Event()
        self._on_delta = on_delta
        self._deltas: Optional["queue.Queue[Delta]"] = None if on_delta else queue.Queue()

    def _emit(self, delta: Delta) -> None:
        if self._on_delta is not None:
            self._on_delta(delta)
        else:
            self._deltas.put(delta)

    def cancel(self) -> None:
        """Ask the loop to end this request (its slot is freed at the next step)."""
        self.cancelled.set()

    def __iter__(self) -> Iterator[Delta]:
        if self._deltas is None:
            raise RuntimeError(f"handle {self.id}: expected a handle to iterate, got one whose "
                               f"deltas go to its on_delta")
        while True:
            delta = self._deltas.get()
            yield delta
            if delta.finish_reason is not None:
                return

    def result(self) -> Tuple[str, str]:
        """(the whole text, finish reason), waiting for the end."""
        text, reason = [], None
        for delta in self:
            text.append(delta.text)
            reason = delta.finish_reason if delta.error is None else f"error: {delta.error}"
        return "".join(text), reason


@dataclass
class Metrics:
    """Counters of the loop (read them through ``Scheduler.metrics``)."""

    requests: Dict[str, int] = field(default_factory=lambda: collections.Counter())
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft: List[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    ttft_sum: float = 0.0
    itl: List[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    itl_sum: float = 0.0
    steps: int = 0
    prefills: int = 0  # prefill passes completed (several prompts each when batched)

    def observe(self, hist: List[int], seconds: float) -> None:
        hist[next((i for i, b in enumerate(LATENCY_BUCKETS) if seconds <= b),
                  len(LATENCY_BUCKETS))] += 1


class _Running:
    """A request in a slot."""

    def __init__(self, handle: Handle, tokenizer, kv_bytes: int):
        self.handle = handle
        self.kv_bytes = kv_bytes  # its share of the cache, by the engine's report
        self.detok = IncrementalDetokenizer(tokenizer, handle.request.prompt_ids)
        self.text = ""        # decoded so far
        self.sent = 0         # characters of ``text`` already emitted
        self.seen = 0         # tokens already read
        self.last_at = handle.created


class Scheduler:
    """The loop that owns ``engine`` (its runtime of slots) and serves ``submit`` ted requests.

    max_queue: requests waiting for a slot at most; one more raises ``QueueFull``.
    prefill_layers: layers of a prompt prefilled between two decode steps while other requests
        run (None: an eighth of the model's layers, at least one).
    prefill_batch_tokens, prefill_batch_requests: waiting requests are prefilled together in
        one pass, in arrival order, while free slots last, their prompts total at most
        ``prefill_batch_tokens`` tokens (a longer prompt goes alone) and the pass holds at most
        ``prefill_batch_requests`` of them. What a pass shares is its weight reads and its
        launches of the position-wise work; every first token of the pass waits for its end.
        Tokens: an 8B model's weights (16 GB) take ~4 ms to read on an H200, the time of ~175
        tokens of its compute (2 x 8e9 FLOP a token at ~700 TFLOP/s, 23 us); at 2048 tokens the
        read is under 8% of the pass. Requests: the eager pass is host-bound on short prompts
        (H100, 8B shape, 64..512 tokens: ~1,100 launches shared per pass, ~28 ms, against
        ~2,100 per prompt, ~53 ms, for its attention, selection and cache writes;
        ``perf/experiments/prefill_batch.py``); at 8 prompts the shared part is 6% of the pass,
        so more would gain little and delay the pass's first tokens by ~53 ms each.
    """

    def __init__(self, engine: MiniKVModel, tokenizer, *, max_queue: int = 64,
                 prefill_layers: Optional[int] = None, prefill_batch_tokens: int = 2048,
                 prefill_batch_requests: int = 8):
        self.engine, self.tok, self.max_queue = engine, tokenizer, max_queue
        self.rt = engine.runtime
        layers = engine.adapter.num_layers
        self.prefill_layers = max(1, layers // 8) if prefill_layers is None else prefill_layers
        if not (isinstance(self.prefill_layers, int) and self.prefill_layers >= 1):
            raise ValueError(f"prefill_layers: expected a positive int, got {prefill_layers!r}")
        for name, value in (("prefill_batch_tokens", prefill_batch_tokens),
                            ("prefill_batch_requests", prefill_batch_requests)):
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        self.prefill_batch_tokens = prefill_batch_tokens
        self.prefill_batch_requests = prefill_batch_requests
        # The prefill under way: its slots, its requests' handles, the runtime's generator.
        self._admitting: Optional[Tuple[List[int], List[Handle], Iterator[None]]] = None
        # Requests of a failed batched pass, to be prefilled again one by one.
        self._alone: set = set()
        self.metrics = Metrics()
        self._waiting: Deque[Handle] = collections.deque()
        self._running: Dict[int, _Running] = {}
        self._cv = threading.Condition()
        self._ids = itertools.count()
        self._stop = False
        self._thread: Optional[threading.Thread] = None
        self.ready = False
        self.failure: Optional[str] = None  # why the loop stopped serving, if it failed

    # -- lifecycle -----------------------------------------------------------------------------

    def warm_up(self) -> None:
        """Compile and capture every bucket and mode before serving (no capture while serving)."""
        for bucket in self.rt.buckets:
            for mode in ("greedy", "sample"):
                self.rt.prepare(bucket, mode)
        self.ready = True

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="minikv-scheduler", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # -- requests ------------------------------------------------------------------------------

    def submit(self, request: ServeRequest,
               on_delta: Optional[Callable[[Delta], None]] = None) -> Handle:
        """Queue ``request``; ``QueueFull`` (with a retry delay) past ``max_queue`` waiting;
        ``RuntimeError`` once the loop has failed or was shut down.

        on_delta: called with each ``Delta`` of the request, on the loop's thread (it must not
        block: a server hands the delta to its event loop); None: iterate the handle."""
        with self._cv:
            if self.failure is not None:
                raise RuntimeError(f"the server failed: {self.failure}")
            if self._stop:
                raise RuntimeError("the scheduler is shut down: expected a running scheduler")
            self._drop_cancelled()  # a cancelled request holds no place in the queue
            if len(self._waiting) >= self.max_queue:
                self.metrics.requests["rejected"] += 1
                raise QueueFull(self.max_queue, retry_after=max(1.0, 0.5 * len(self._waiting)))
            handle = Handle(f"cmpl-{next(self._ids)}", request, on_delta)
            self._waiting.append(handle)
            self._cv.notify_all()
        return handle

    def _drop_cancelled(self) -> None:
        """End the waiting requests whose clients went away (call with ``_cv`` held)."""
        if any(h.cancelled.is_set() for h in self._waiting):
            kept = [h for h in self._waiting if not h.cancelled.is_set()]
            for h in self._waiting:
                if h.cancelled.is_set():
                    self._end(h, "cancelled", None)
            self._waiting = collections.deque(kept)

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def slots_in_use(self) -> int:
        return len(self._running)

    def kv_bytes_in_use(self) -> int:
        """KV bytes the running requests occupy (prompt + max_tokens each, by the report)."""
        return sum(run.kv_bytes for run in list(self._running.values()))

    # -- the loop ------------------------------------------------------------------------------

    @property
    def serving(self) -> bool:
        """Ready, and the loop has not failed: what a health check reports."""
        return self.ready and self.failure is None

    def _loop(self) -> None:
        try:
            self._serve()
        except Exception as e:  # a failed step: the engine's state is unknown, stop serving
            self.failure = f"{type(e).__name__}: {e}"
            self._fail_everything()

    def _fail_everything(self) -> None:
        """End every request with the loop's failure; new ones are refused by ``submit``."""
        handles = [run.handle for run in self._running.values()]
        if self._admitting is not None:
            handles += self._admitting[1]
        with self._cv:
            handles += list(self._waiting)
            self._waiting.clear()
        self._running.clear()
        self._admitting = None
        self._alone.clear()
        for handle in handles:
            self._end(handle, "error", f"the server failed: {self.failure}")

    def _serve(self) -> None:
        while True:
            with self._cv:
                while (not self._stop and not self._waiting and not self._running
                       and self._admitting is None):
                    self._cv.wait()
                if self._stop:
                    break
                self._drop_cancelled()
            # Each round of work holds the engine's lock: a generate() of another thread runs
            # between rounds (it refuses to start while requests hold slots).
            with self.engine._lock:
                self._admit_piece()
                if self._running:
                    self._step()
        if self._admitting is not None:
            _, handles, pieces = self._admitting
            pieces.close()  # gives the slots back empty
            for handle in handles:
                self._end(handle, "cancelled", None)
        for slot in list(self._running):
            self._finish(slot, "cancelled")
        while self._waiting:
            self._end(self._waiting.popleft(), "cancelled", None)
        self._alone.clear()

    def _admit_piece(self) -> None:
        """One prefill piece of the requests being admitted (new ones if none are), or, with
        nothing running, the whole prefill: there is no stream to keep going."""
        while True:
            if self._admitting is None and not self._start_admission():
                return
            slots, handles, pieces = self._admitting
            if all(h.cancelled.is_set() for h in handles):
                pieces.close()  # gives the slots back empty
                self._admitting = None
                for handle in handles:
                    self._end(handle, "cancelled", None)
                continue
            try:
                next(pieces)
                if self._running:
                    return  # the next piece after a decode step
                continue
            except StopIteration:
                self._admitting = None
            except Exception as e:  # the slots are given back empty
                self._admitting = None
                self._admission_failed(handles, e)
                continue
            self.metrics.prefills += 1
            joined = []
            for slot, handle in zip(slots, handles):
                if handle.cancelled.is_set():  # cancelled while its batch was prefilled
                    self.rt.release(slot)
                    self._end(handle, "cancelled", None)
                    continue
                self.metrics.prompt_tokens += handle.prompt_tokens
                r = handle.request
                kv = self.engine.kv_memory(prompt_len=len(r.prompt_ids),
                                           new_tokens=r.max_tokens, batch=1).total_bytes
                self._running[slot] = _Running(handle, self.tok, kv)
                joined.append(slot)
            if joined:
                self._collect(joined)  # the first tokens, chosen at admission
            if self._running:
                return  # one piece of prefill between two decode steps, never two

    def _admission_failed(self, handles: List[Handle], error: Exception) -> None:
        """A request prefilled alone ends with ``error``. A batched pass does not say which
        request failed (an out-of-memory error may be the batch's size): each of its requests
        goes back to the head of the queue, in order, to be prefilled alone, so that only a
        request that fails by itself ends with its error."""
        if len(handles) == 1:
            self._end(handles[0], "error", f"{type(error).__name__}: {error}")
            return
        self._alone.update(handles)
        with self._cv:
            self._waiting.extendleft(reversed(handles))

    def _start_admission(self) -> bool:
        """Start the prefill of the next waiting requests: in arrival order, while free slots
        last, their prompts total at most ``prefill_batch_tokens`` (the first one whatever its
        length) and they are at most ``prefill_batch_requests`` (a request of a failed batch
        alone). A request cancelled while waiting, or
        one that does not fit the engine (``SlotRuntime.check_request``), ends here without
        holding the others up. Returns whether a prefill started."""
        free = self.rt.free_slots()
        handles: List[Handle] = []
        requests: List[Request] = []
        tokens = 0
        while len(handles) < min(len(free), self.prefill_batch_requests):
            with self._cv:
                if not self._waiting:
                    break
                handle = self._waiting[0]
                if handles and (handle in self._alone
                                or tokens + handle.prompt_tokens > self.prefill_batch_tokens):
                    break
                self._waiting.popleft()
            alone = handle in self._alone
            self._alone.discard(handle)
            if handle.cancelled.is_set():
                self._end(handle, "cancelled", None)
                continue
            r = handle.request
            try:
                request = Request(list(r.prompt_ids), r.max_tokens, tuple(r.eos_ids), r.sampling,
                                  budgets=r.budgets)
                self.rt.check_request(request)
            except Exception as e:  # bad input the server's checks missed: this request alone
                self._end(handle, "error", f"{type(e).__name__}: {e}")
                continue
            handles.append(handle)
            requests.append(request)
            tokens += handle.prompt_tokens
            if alone:
                break
        if not handles:
            return False
        slots = free[: len(handles)]
        self._admitting = (slots, handles,
                           self.rt.admit_batch_in_pieces(slots, requests, self.prefill_layers))
        return True

    def _step(self) -> None:
        for slot, run in list(self._running.items()):
            if run.handle.cancelled.is_set():
                self._finish(slot, "cancelled")
        if not self._running:
            return
        self.rt.step()
        self.metrics.steps += 1
        self._collect(sorted(self._running))

    def _collect(self, slots: List[int]) -> None:
        counts, newest, done = self.rt.poll(slots)
        now = time.perf_counter()
        for slot, count, token, finished in zip(slots, counts, newest, done):
            run = self._running[slot]
            h, r = run.handle, run.handle.request
            before = len(run.text)
            if count > run.seen:
                run.seen = count
                h.completion_tokens = count
                self.metrics.completion_tokens += 1
                if h.first_token_at is None:
                    h.first_token_at = now
                    self.metrics.observe(self.metrics.ttft, now - h.created)
                    self.metrics.ttft_sum += now - h.created
                else:
                    self.metrics.observe(self.metrics.itl, now - run.last_at)
                    self.metrics.itl_sum += now - run.last_at
                run.last_at = now
                if token not in r.eos_ids:
                    run.text += run.detok.push(token)
            # A stop string found now ends in the new text (an earlier one would have ended the
            # request): search only from where it could start, not the whole text every step.
            frm = max(0, before - max((len(s) for s in r.stop), default=0) + 1)
            cut = min((i for i in (run.text.find(s, frm) for s in r.stop) if i >= 0), default=-1)
            if cut >= 0:
                run.text = run.text[:cut]
                self._finish(slot, "stop")
            elif finished:
                eos = count > 0 and token in r.eos_ids
                self._finish(slot, "stop" if eos else "length")
            else:
                # hold back what could be the start of a stop string
                hold = max((len(s) - 1 for s in r.stop), default=0)
                upto = max(run.sent, len(run.text) - hold)
                if upto > run.sent:
                    h._emit(Delta(run.text[run.sent:upto], [token]))
                    run.sent = upto

    def _finish(self, slot: int, reason: str) -> None:
        """End the request of ``slot`` with the text it still holds back, freeing the slot."""
        run = self._running.pop(slot)
        self.rt.release(slot)
        self._end(run.handle, reason, None, run.text[run.sent:])

    def _end(self, handle: Handle, reason: str, error: Optional[str], text: str = "") -> None:
        handle.finish_reason = reason  # counted before the client can see the end
        self.metrics.requests[reason] += 1
        handle._emit(Delta(text, [], reason, error))
