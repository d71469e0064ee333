"""Continuous batching: one loop owns the engine's slots; requests join and leave between steps.

The loop admits waiting requests into free slots (the lowest first, so the replayed bucket stays
small), several short prompts in one prefill pass (they share its weight reads), at most
``prefill_ms`` of prefill (whole layers) between two decode steps so that a long prompt does not
freeze the running streams, replays one decode step for every live slot, reads each slot's new
token while the GPU runs the next step (the host's share of a step, detokenizing and streaming,
is hidden behind it), turns tokens into text incrementally, and ends a request the step it
finishes (eos, a stop string, ``max_tokens``, cancellation), freeing its slot at once. A request
that fails (bad input the checks missed, an error in its prefill) ends with an error of its own;
the engine and every other request go on. A request whose prompt starts with a context kept
from an earlier one (``prefix_pool``: its prompt, or a chat's prompt and answer) is admitted
from that context and prefills only its tail. Beside it: the detokenizer (``detokenizer``), the
counters (``loop_metrics``) and the prefill clock (``prefill_clock``).
"""
from __future__ import annotations

import collections
import dataclasses
import gc
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Deque, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from minikv_compile.graphs.runtime import Request
from minikv_compile.graphs.sampling import Sampling

from .detokenizer import IncrementalDetokenizer
from .engine import MiniKVModel
from .loop_metrics import LATENCY_BUCKETS, Metrics
from .prefill_clock import CHUNK, LAYER, PrefillClock
from .prefix_pool import DiskContexts, PrefixPool
from .ranks import HEARTBEAT_S, ReplicatedRuntime

_log = logging.getLogger("minikv_compile.scheduler")
# How long shutdown waits for a warm-up to reach its next step (one bucket's compile and
# capture; past it the followers of tensor parallel are not told to stop: two threads' calls)
WARM_UP_STOP_S = 120.0

__all__ = ["Delta", "Handle", "IncrementalDetokenizer", "LATENCY_BUCKETS", "Metrics",
           "PrefillClock", "QueueFull", "Scheduler", "ServeRequest"]

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
    request's selection, within the engine's; None for the engine's own. prefix_cache: whether
    the request may be admitted from a resident context and leaves its own (the scheduler's
    pool); cache_salt: contexts are shared only among requests of the same salt; keep: the
    context it leaves, ``"prompt"`` (its prompt, taken at admission) or ``"conversation"``
    (its prompt and answer, taken when it ends: a chat's next turn starts with them).
    """

    prompt_ids: Sequence[int]
    max_tokens: int
    sampling: Sampling = Sampling()
    stop: Tuple[str, ...] = ()
    eos_ids: Tuple[int, ...] = ()
    budgets: Optional[Tuple[float, float]] = None
    prefix_cache: bool = True
    cache_salt: Optional[str] = None
    keep: str = "prompt"

    def __post_init__(self):
        if self.keep not in ("prompt", "conversation"):
            raise ValueError(f"keep: expected 'prompt' or 'conversation', got {self.keep!r}")


@dataclass
class Delta:
    """What a request produced since the last one: new text (never a broken character), its
    token ids, and ``finish_reason`` on the last delta (``"stop"``, ``"length"``,
    ``"cancelled"`` or ``"error"``; ``error`` then says why)."""

    text: str
    token_ids: List[int]
    finish_reason: Optional[str] = None
    error: Optional[str] = None


class Handle:
    """A submitted request: iterate it for ``Delta`` s until one carries a finish reason, or
    (``on_delta`` given to ``submit``) have each delta handed to that callable instead."""

    def __init__(self, request_id: str, request: ServeRequest,
                 on_delta: Optional[Callable[[Delta], None]] = None):
        self.id, self.request = request_id, request
        self.created = time.perf_counter()
        self.first_token_at: Optional[float] = None
        self.admitted_at: Optional[float] = None  # its prefill's start
        self.prompt_tokens = len(request.prompt_ids)
        self.completion_tokens = 0
        self.cached_tokens = 0  # prompt tokens admitted from a resident context
        self.finish_reason: Optional[str] = None
        self.cancelled = threading.Event()
        self.slotted = False  # taken from the queue into a slot (the scheduler's)
        self.prepared: Optional[Request] = None  # its runtime request, when put back unadmitted
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


def check_prefix_cache(gpu_bytes: int, folder: Optional[str], tensor_parallel: int) -> None:
    """``ValueError`` for a prefix cache under tensor parallel (each rank holds a shard of a
    context: the pool keeps none)."""
    if tensor_parallel > 1:
        for name, value, off in (("prefix_cache_gpu_bytes", gpu_bytes, 0),
                                 ("prefix_cache_dir", folder, None)):
            if value:
                raise ValueError(f"{name}: expected {off!r} with tensor_parallel="
                                 f"{tensor_parallel} (each rank holds a shard of a context), "
                                 f"got {value!r}")


class Scheduler:
    """The loop that owns ``engine`` (its runtime of slots) and serves ``submit`` ted requests.

    max_queue: requests waiting for a slot at most, beyond those the free slots take (a burst
        of ``max_batch_size + max_queue`` requests at an idle server is taken whole); one more
        raises ``QueueFull``.
    prefill_ms: milliseconds of prefill between two decode steps while other requests stream,
        in whole layers (at least one: a layer of a 32k-token prompt takes ~75 ms on the 8B
        shape), by the loop's own measurement of the layers run so far (``PrefillClock``);
        None: no time limit. 50 ms: a step with prefill then stays under the 100 ms of
        inter-token latency a streaming client notices (H100, 8B shape: a step 6-8 ms).
    prefill_layers: at most this many layers between two steps (None: no limit).
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
    prefix_cache_gpu_bytes: device bytes of the contexts kept for reuse (``PrefixPool``; 0:
        no reuse), beside the slots' static cache, never in it; held during ``warm_up``'s
        longest prefill with a slot's share more (a new context is copied before the oldest
        goes), so that start-up proves they fit beside it.
    prefix_cache_host_bytes: host memory for contexts evicted from the device (0: none).
    prefix_cache_dir: contexts are also saved there (``PromptCache`` files) and loaded on a
        miss, so that a restarted server reuses them.
    """

    def __init__(self, engine: MiniKVModel, tokenizer, *, max_queue: int = 64,
                 prefill_ms: Optional[float] = 50.0, prefill_layers: Optional[int] = None,
                 prefill_batch_tokens: int = 2048, prefill_batch_requests: int = 8,
                 prefix_cache_gpu_bytes: int = 0, prefix_cache_host_bytes: int = 0,
                 prefix_cache_dir: Optional[str] = None):
        self.engine, self.tok, self.max_queue = engine, tokenizer, max_queue
        # tensor parallel: rank 0 serves, each call that runs the model goes to every rank
        self.rt = ReplicatedRuntime(engine) if engine.adapter.tp.world > 1 else engine.runtime
        if prefill_layers is not None and not (isinstance(prefill_layers, int)
                                               and not isinstance(prefill_layers, bool)
                                               and prefill_layers >= 1):
            raise ValueError(f"prefill_layers: expected a positive int or None, got "
                             f"{prefill_layers!r}")
        if prefill_ms is not None and not (isinstance(prefill_ms, (int, float))
                                           and not isinstance(prefill_ms, bool)
                                           and prefill_ms > 0):
            raise ValueError(f"prefill_ms: expected a positive number or None, got "
                             f"{prefill_ms!r}")
        self.prefill_ms, self.prefill_layers = prefill_ms, prefill_layers
        self.clock = PrefillClock(self.rt.state.tokens.device)
        for name, value in (("prefill_batch_tokens", prefill_batch_tokens),
                            ("prefill_batch_requests", prefill_batch_requests)):
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        self.prefill_batch_tokens = prefill_batch_tokens
        self.prefill_batch_requests = prefill_batch_requests
        self.pool, self.disk = self._prefix_pool(prefix_cache_gpu_bytes, prefix_cache_host_bytes,
                                                 prefix_cache_dir)
        self.prefix_queries = 0  # prompt tokens looked up in the pool
        self.prefix_hits = 0     # prompt tokens admitted from it
        # The prefill under way: its slots, its requests' handles, the runtime's generator.
        self._admitting: Optional[Tuple[List[int], List[Handle], Iterator[None]]] = None
        # Requests of a failed batched pass, to be prefilled again one by one.
        self._alone: set = set()
        # Tokens not read yet, read while the next step runs, in the order they were produced
        # (an admission's first tokens, a step's): (read, the slots' requests).
        self._pending: Deque[Tuple[Callable, List[Tuple[int, "_Running"]]]] = collections.deque()
        self.metrics = Metrics()
        self._waiting: Deque[Handle] = collections.deque()
        self._slotted = 0  # requests given a slot (prefilling or running), under ``_cv``
        self._running: Dict[int, _Running] = {}
        self._cv = threading.Condition()
        self._warm_idle = threading.Event()  # clear while warm_up runs (shutdown waits for it)
        self._warm_idle.set()
        self._ids = itertools.count()
        self._stop = False
        self._thread: Optional[threading.Thread] = None
        self.ready = False
        self.failure: Optional[str] = None  # why the loop stopped serving, if it failed

    def _prefix_pool(self, gpu_bytes: int, host_bytes: int, folder: Optional[str]
                     ) -> Tuple[PrefixPool, Optional[DiskContexts]]:
        engine = self.engine
        check_prefix_cache(gpu_bytes, folder, engine.adapter.tp.world)
        if folder is not None and not gpu_bytes:
            raise ValueError(f"prefix_cache_dir: expected none while prefix_cache_gpu_bytes is 0 "
                             f"(reuse off), got {folder!r}")
        disk = None
        if folder is not None:
            def write(snap, path):
                engine._prompt_cache([snap]).save(path)

            def read(path):
                return engine.load_prompt_cache(path).sequences[0]
            disk = DiskContexts(folder, write, read)
        pool = PrefixPool(gpu_bytes, host_bytes, device=engine.device,
                          loader=None if disk is None else disk.load)
        return pool, disk

    # -- lifecycle -----------------------------------------------------------------------------

    def warm_up(self) -> None:
        """Compile and capture every bucket and mode before serving (no capture while serving);
        prefill one prompt of ``max_prompt_len`` tokens into a free slot and free it again:
        the first prefill at a length launches its kernels for the first time (a 32k-token
        prompt took 6.7 s instead of ~1.8 on the H100, every stream stalled meanwhile), and a
        prompt at capacity that does not fit in memory beside the cache fails here rather than
        while serving. Then take what start-up made out of the garbage collector's reach
        (``gc.freeze``): a full collection over it (~600k objects with the compiler loaded) took
        250 ms on the 2-core CI machine, a pause of every stream at once; serving's own objects
        stay collected. A ``shutdown`` meanwhile ends it at its next step (``RuntimeError``),
        and waits for that: under tensor parallel, two threads must not make collectives."""
        self._warm_idle.clear()
        try:
            self._warm_up()
        finally:
            self._warm_idle.set()

    def _warming(self) -> None:
        """``RuntimeError`` once ``shutdown`` was called (warm-up stops between its steps)."""
        if self._stop:
            raise RuntimeError("warm-up: the scheduler was shut down before it was ready")

    def _warm_up(self) -> None:
        for bucket in self.rt.buckets:
            for mode in ("greedy", "sample"):
                self._warming()
                self.rt.prepare(bucket, mode)
        self._warming()
        slot = self.rt.free_slots()[0]
        longest = Request([0] * self.engine.config.max_prompt_len, 1)
        # the prefix pool's bytes, full, and a context being copied in before the oldest goes
        # (at most a slot's share of the cache and its logits), beside the longest prefill
        held = 0
        if self.pool.gpu_bytes:
            cfg, vocab = self.engine.config, self.engine.adapter.vocab_size
            held = (self.pool.gpu_bytes + 4 * vocab
                    + self.engine.kv_memory().allocated_bytes // cfg.max_batch_size)
        try:
            pool = torch.empty(held, dtype=torch.uint8, device=self.engine.device)
            for _ in self.rt.admit_batch_in_pieces([slot], [longest],
                                                   self.engine.adapter.num_layers):
                pass
        except torch.OutOfMemoryError as e:
            if not self.pool.gpu_bytes:
                raise
            raise RuntimeError(f"prefix_cache_gpu_bytes: expected room for {self.pool.gpu_bytes} "
                               f"bytes of contexts (and one slot's more, {held} in all) beside "
                               f"the slots' cache and a prefill of max_prompt_len tokens, got out "
                               f"of memory ({e}); lower --prefix-cache-gpu-bytes") from None
        self.rt.release(slot)
        del pool
        if self.pool.enabled:
            self._warming()
            self._warm_tail(slot)
        gc.collect()
        gc.freeze()
        self.ready = True

    def _warm_tail(self, slot: int) -> None:
        """Run the tail prefill with every chunk length it can take (1 .. R, the ring's length)
        from a 4-token prefix in ``slot``, as the decode steps are compiled before serving: the
        first hit of each length would otherwise compile while every stream waits (the compiled
        layer's two graphs, T == 1 and T >= 2, then the Triton kernels' launch variants by T;
        on the H200 the first hits of the serving benchmark took 1.5-3.1 s, the later ones
        0.1-0.2 s). With ``room`` rows free in the prefix's ring, a tail of ``room + k`` tokens
        runs the chunks ``room`` and ``k``."""
        rt, layers = self.rt, self.engine.adapter.num_layers
        longest = self.engine.config.max_prompt_len
        if longest < 2:
            return  # no prompt has a tail
        n = min(4, longest - 1)
        for _ in rt.admit_batch_in_pieces([slot], [Request([0] * n, 1)], layers):
            pass
        prefix = rt.snapshot(slot)
        rt.release(slot)
        R = rt.tail.longest_chunk
        room = R - max(n_ring for _, n_ring in prefix.lens)  # the first chunk's most tokens
        tails = list(range(1, room + 1)) + [room + k for k in range(room + 1, R + 1)]
        for tail in tails:
            if n + tail > longest:
                break
            request = Request([0] * (n + tail), 1, prefix=prefix)
            for _ in rt.admit_batch_in_pieces([slot], [request], layers):
                pass
            rt.release(slot)

    def start(self) -> None:
        with self._cv:
            if self._stop:  # shut down while it warmed up: nothing to serve
                return
            self._thread = threading.Thread(target=self._loop, name="minikv-scheduler",
                                            daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        # a warm-up still running ends at its next step (a bucket's compile and capture)
        warming = not self._warm_idle.wait(timeout=WARM_UP_STOP_S)
        stuck = warming or (self._thread is not None and self._thread.is_alive())
        if self.disk is not None:
            self.disk.close()  # the contexts still queued are written
        if isinstance(self.rt, ReplicatedRuntime) and not stuck:
            self.rt.stop_followers()  # (not while the loop may still make calls)

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
            free = max(0, self.engine.config.max_batch_size - self._slotted)
            if len(self._waiting) >= self.max_queue + free:
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
        self._pending.clear()
        self._alone.clear()
        for handle in handles:
            self._end(handle, "error", f"the server failed: {self.failure}")

    def _serve(self) -> None:
        while True:
            with self._cv:
                while (not self._stop and not self._waiting and not self._running
                       and self._admitting is None):
                    if not isinstance(self.rt, ReplicatedRuntime):
                        self._cv.wait(HEARTBEAT_S)
                        continue
                    # by the clock, not by a wait that timed out: wake-ups that end in no call
                    # (requests cancelled or refused before admission) would put it off
                    due = HEARTBEAT_S - (time.monotonic() - self.rt.last_sent)
                    if due <= 0:
                        self.rt.heartbeat()  # idle: the other ranks are waiting for a call
                    else:
                        self._cv.wait(due)
                if self._stop:
                    break
                self._drop_cancelled()
            # Each round of work holds the engine's lock: a generate() of another thread runs
            # between rounds (it refuses to start while requests hold slots).
            with self.engine._lock:
                self._admit_piece()
                if self._running:
                    self._step()
                else:
                    self._read_pending()
        self._read_pending()
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
        """The prefill between two decode steps: layers of the requests being admitted (new ones
        if none are) within ``prefill_ms`` / ``prefill_layers``, or, with nothing running, whole
        prefills: there is no stream to keep going."""
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
                self._prefill_layers(pieces, *self._piece_tokens(handles))
                return  # the admission goes on after a decode step
            except StopIteration:
                self._admitting = None
            except Exception as e:  # the slots are given back empty
                self._admitting = None
                self.clock.forget(pieces)
                self._admission_failed(handles, e)
                continue
            self.clock.forget(pieces)
            self.metrics.prefills += 1
            joined = []
            for slot, handle in zip(slots, handles):
                if handle.cancelled.is_set():  # cancelled while its batch was prefilled
                    self.rt.release(slot)
                    self._end(handle, "cancelled", None)
                    continue
                self.metrics.prompt_tokens += handle.prompt_tokens
                now, m = time.perf_counter(), self.metrics
                m.observe(m.queue, handle.admitted_at - handle.created)
                m.observe(m.prefill, now - handle.admitted_at)
                m.queue_sum += handle.admitted_at - handle.created
                m.prefill_sum += now - handle.admitted_at
                r = handle.request
                if (self._reuses(r) and r.keep == "prompt"
                        and handle.cached_tokens < handle.prompt_tokens):
                    self._keep(slot, handle)  # before its first step: the prompt alone
                kv = self.engine.kv_memory(prompt_len=len(r.prompt_ids),
                                           new_tokens=r.max_tokens, batch=1).total_bytes
                self._running[slot] = _Running(handle, self.tok, kv)
                joined.append(slot)
            if joined:  # the first tokens, chosen at admission: read with the next step's
                self._pending.append((self.rt.poll_later(joined),
                                      [(slot, self._running[slot]) for slot in joined]))
            if self._running:
                return  # one admission's prefill between two decode steps, never two

    def _piece_tokens(self, handles: List[Handle]) -> Tuple[int, str]:
        """An admission's piece for the clock, ``(tokens, kind)``: a prefill's piece is a layer
        of every whole prompt (``"layer"``); a cached prompt's tail runs in chunks of at most R
        tokens through every layer, a chunk a piece (``"chunk"``, its own rate: at a prefill
        layer's, a burst of hits ran several chunks into one gap, ITL p99 141 ms on the 8B
        shape). A hit is admitted alone (``_start_admission``)."""
        if len(handles) == 1 and handles[0].cached_tokens:
            tail = handles[0].prompt_tokens - handles[0].cached_tokens
            return min(max(tail, 1), self.rt.tail.longest_chunk), CHUNK
        return sum(h.prompt_tokens for h in handles), LAYER

    def _prefill_layers(self, pieces: Iterator[None], tokens: int, kind: str = LAYER) -> None:
        """Run pieces of the admission ``pieces`` (a layer, or a tail's chunk, a ``next``;
        ``tokens``, ``kind``: a piece's, as ``_piece_tokens`` gives them): with requests
        streaming, as many as fit ``prefill_ms`` by the clock's estimate (at least one) and
        ``prefill_layers``; otherwise all of them. Raises ``StopIteration`` once the admission
        is complete."""
        limit = self.prefill_layers if self._running else None
        budget = self.prefill_ms if self._running else None
        start, layers = self.clock.start(), 0
        try:
            while True:
                next(pieces)
                layers += 1
                if limit is not None and layers >= limit:
                    return
                if budget is not None:
                    per_layer = self.clock.layer_ms(pieces, tokens, kind)
                    if per_layer is None or (layers + 1) * per_layer > budget:
                        return
        finally:
            self.clock.stop(start, pieces, tokens, layers, kind)

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
            for handle in handles:
                handle.slotted = False
            self._slotted -= len(handles)
            self._waiting.extendleft(reversed(handles))

    def _start_admission(self) -> bool:
        """Start the prefill of the next waiting requests: in arrival order, while free slots
        last, their prompts total at most ``prefill_batch_tokens`` (the first one whatever its
        length) and they are at most ``prefill_batch_requests`` (a request of a failed batch
        alone, and a hit of the prefix pool: its pieces are tail chunks, which the clock times
        apart from prefill layers). A request cancelled while waiting, or
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
                handle.slotted = True
                handle.admitted_at = time.perf_counter()
                self._slotted += 1
            alone = handle in self._alone
            self._alone.discard(handle)
            if handle.cancelled.is_set():
                self._end(handle, "cancelled", None)
                continue
            try:
                request = handle.prepared or self._request(handle)
                handle.prepared = None
            except Exception as e:  # bad input the server's checks missed: this request alone
                self._end(handle, "error", f"{type(e).__name__}: {e}")
                continue
            if request.prefix is not None and handles:  # the hit waits for the next admission
                handle.prepared = request  # (looked up once: the pool's counters count it once)
                with self._cv:
                    handle.slotted = False
                    self._slotted -= 1
                    self._waiting.appendleft(handle)
                break
            handles.append(handle)
            requests.append(request)
            tokens += handle.prompt_tokens
            if alone or request.prefix is not None:
                break
        if not handles:
            return False
        slots = free[: len(handles)]
        self._admitting = (slots, handles, self.rt.admit_batch_in_pieces(slots, requests, 1))
        return True

    def _scope(self, r: ServeRequest) -> Tuple[Optional[str], Tuple[float, float]]:
        """Who may share a request's contexts: its salt, and its compression (budgets)."""
        cfg = self.engine.config
        return r.cache_salt, tuple(r.budgets or (cfg.heavy_budget, cfg.recent_budget))

    def _reuses(self, r: ServeRequest) -> bool:
        return self.pool.enabled and r.prefix_cache

    def _request(self, handle: Handle) -> Request:
        """The runtime's request of ``handle``, checked (``SlotRuntime.check_request``): from
        the longest resident context its prompt starts with, if any fits the slot with its tail
        and ``max_tokens`` (the tail is kept whole), else a whole prefill."""
        r = handle.request
        fresh = Request(list(r.prompt_ids), r.max_tokens, tuple(r.eos_ids), r.sampling,
                        budgets=r.budgets)
        if self._reuses(r):
            self.prefix_queries += len(r.prompt_ids)
            prefix = self.pool.lookup(self._scope(r), r.prompt_ids)
            if prefix is not None:
                request = dataclasses.replace(fresh, budgets=None, prefix=prefix)
                try:
                    self.rt.check_request(request)
                except ValueError:  # it leaves no room for the tail: a whole prefill
                    pass
                else:
                    handle.cached_tokens = len(prefix.tokens)
                    self.prefix_hits += handle.cached_tokens
                    return request
        self.rt.check_request(fresh)
        return fresh

    def _keep(self, slot: int, handle: Handle) -> None:
        """Keep ``slot``'s context (its request's ``keep``) in the pool, and on disk. A context
        that cannot be kept (no memory for its copy) is not: the request goes on, logged and
        counted (``minikv_prefix_cache_keep_failures_total``), and the next one prefills it."""
        scope = self._scope(handle.request)
        try:
            snap = self.rt.snapshot(slot)
            if self.pool.add(scope, snap) and self.disk is not None:
                self.disk.save(scope, snap)
        except Exception as e:  # noqa: BLE001 -- an optimization failed, not the request
            self.metrics.keep_failures += 1
            _log.warning("slot %d: its context was not kept (%s: %s)", slot,
                         type(e).__name__, e)

    def _step(self) -> None:
        """Launch a decode step of the running requests, then read the step before it while
        the GPU runs this one."""
        for slot, run in list(self._running.items()):
            if run.handle.cancelled.is_set():
                self._finish(slot, "cancelled")
        if not self._running:
            return
        self.rt.step()
        self.metrics.steps += 1
        runs = sorted(self._running.items())
        later = self.rt.poll_later([slot for slot, _ in runs])
        self._read_pending()
        self._pending.append((later, runs))

    def _read_pending(self) -> None:
        """Read and stream, in order, what the steps and admissions queued before now produced
        and was not read yet."""
        while self._pending:
            later, runs = self._pending.popleft()
            self._collect(runs, later())

    def _collect(self, runs: List[Tuple[int, "_Running"]],
                 polled: Tuple[List[int], List[int], List[bool]]) -> None:
        """Stream what ``polled`` (``SlotRuntime.poll`` of the slots of ``runs``) says of each
        request; one that ended since the poll was taken is skipped (its slot may hold another
        request by now)."""
        now = time.perf_counter()
        for (slot, run), count, token, finished in zip(runs, *polled):
            if self._running.get(slot) is not run:
                continue
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
                # its tokens run past the text the client gets: no next turn starts with them
                self._finish(slot, "stop", keep=False)
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

    def _finish(self, slot: int, reason: str, keep: bool = True) -> None:
        """End the request of ``slot`` with the text it still holds back, freeing the slot (a
        chat's context kept first, unless ``keep`` is False)."""
        run = self._running.pop(slot)
        r = run.handle.request
        if (keep and reason in ("stop", "length") and self._reuses(r)
                and r.keep == "conversation"):
            self._keep(slot, run.handle)
        self.rt.release(slot)
        self._end(run.handle, reason, None, run.text[run.sent:])

    def _end(self, handle: Handle, reason: str, error: Optional[str], text: str = "") -> None:
        with self._cv:  # (submit's threads end cancelled requests too: exact counts)
            if handle.slotted:
                handle.slotted = False
                self._slotted -= 1
            handle.finish_reason = reason  # counted before the client can see the end
            self.metrics.requests[reason] += 1
        handle._emit(Delta(text, [], reason, error))
