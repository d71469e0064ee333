"""The scheduler: continuous batching over the runtime of slots, in-process (the HTTP server on
top of it is tests/test_serve.py). CPU, fp32, tiny random Llama (tests/test_engine.py)."""
from __future__ import annotations

import threading
import time

import pytest

from minikv_compile import minikv_compile
from minikv_compile.graphs.sampling import Sampling
from minikv_compile.scheduler import (IncrementalDetokenizer, QueueFull, Scheduler,
                                      ServeRequest)
from configs import snapkv
from test_engine import prompt_of, tiny

CFG = dict(residual_length=32, max_prompt_len=128, max_new_tokens=40, max_batch_size=4,
           kept_floor=1)  # short prompts evicted from (the budgets alone)


class CharTokenizer:
    """Token t decodes to one character; ids 90..100 to the two UTF-8 halves of "é" and "€"'s
    three bytes, so that a character can span tokens (as byte-level BPE splits them)."""

    BYTES = {90: b"\xc3", 91: b"\xa9", 92: b"\xe2", 93: b"\x82", 94: b"\xac"}

    def decode(self, ids, skip_special_tokens=True):
        data = b"".join(self.BYTES.get(t, chr(0x61 + t % 26).encode()) for t in ids)
        return data.decode("utf-8", errors="replace")


@pytest.fixture
def served():
    cm = minikv_compile(tiny(), snapkv(**CFG))
    sched = Scheduler(cm, CharTokenizer(), max_queue=8)
    sched.start()
    yield cm, sched
    sched.shutdown()


def test_concurrent_requests_each_get_their_tokens_alone(served):
    cm, sched = served
    prompts = [prompt_of(n, seed=n) for n in (90, 17, 60, 33, 120, 5)]
    sizes = [40, 12, 31, 25, 8, 40]
    want = [cm.generate([p], max_new_tokens=n, eos_token_id=[]).sequences[0]
            for p, n in zip(prompts, sizes)]
    tok = CharTokenizer()
    handles = [sched.submit(ServeRequest(p, n)) for p, n in zip(prompts[:4], sizes[:4])]
    time.sleep(0.05)  # the last two join while the first four are generating
    handles += [sched.submit(ServeRequest(p, n)) for p, n in zip(prompts[4:], sizes[4:])]
    for h, w in zip(handles, want):
        text, reason = h.result()
        assert text == tok.decode(w) and reason == "length" and h.completion_tokens == len(w)
    assert sched.slots_in_use == 0 and sched.metrics.requests["length"] == 6


def test_stop_strings_eos_and_cancellation(served):
    cm, sched = served
    tok = CharTokenizer()
    p = prompt_of(50, seed=3)
    full = cm.generate([p], max_new_tokens=40, eos_token_id=[]).sequences[0]
    text = tok.decode(full)
    stop = text[10:13]
    got, reason = sched.submit(ServeRequest(p, 40, stop=(stop,))).result()
    assert got == text[: text.index(stop)] and reason == "stop"
    eos = full[7]
    got, reason = sched.submit(ServeRequest(p, 40, eos_ids=(eos,))).result()
    assert got == tok.decode(full[: full.index(eos)]) and reason == "stop"
    h = sched.submit(ServeRequest(p, 40))
    next(iter(h))
    h.cancel()
    assert h.result()[1] == "cancelled"
    deadline = time.time() + 10
    while sched.slots_in_use and time.time() < deadline:
        time.sleep(0.01)
    assert sched.slots_in_use == 0
    assert sched.submit(ServeRequest(p, 5)).result()[0] == text[:5]  # the engine goes on


def test_a_failing_request_leaves_the_others_alone(served):
    cm, sched = served
    p = prompt_of(50, seed=4)
    want = CharTokenizer().decode(cm.generate([p], max_new_tokens=30, eos_token_id=[]).sequences[0])
    good = sched.submit(ServeRequest(p, 30))
    bad = sched.submit(ServeRequest(p, 999))   # above the engine's max_new_tokens
    worse = sched.submit(ServeRequest(p, 10, budgets=(0.9, 0.9)))  # above the engine's budgets
    for h, field in ((bad, "max_new_tokens"), (worse, "budgets")):
        deltas = list(h)
        assert deltas[-1].finish_reason == "error" and field in deltas[-1].error
    assert good.result() == (want, "length")


def test_queue_limit_and_sampled_requests_with_a_seed():
    cm = minikv_compile(tiny(), snapkv(**{**CFG, "max_batch_size": 1}))
    sched = Scheduler(cm, CharTokenizer(), max_queue=2)
    p = prompt_of(30, seed=5)
    sampled = Sampling(greedy=False, temperature=1.2, seed=77)
    # A burst at an idle scheduler: the free slot takes one, the queue the next 2 (max_queue
    # counts requests waiting beyond the free slots), the 4th is refused.
    handles = [sched.submit(ServeRequest(p, 20, sampling=sampled)) for _ in range(3)]
    with pytest.raises(QueueFull) as e:
        sched.submit(ServeRequest(p, 20))
    assert e.value.retry_after >= 1
    sched.start()
    try:
        texts = [h.result()[0] for h in handles]
        assert texts[0] == texts[1] == texts[2]  # the same seed, the same tokens, whatever ran before
    finally:
        sched.shutdown()
    assert sched.metrics.requests["rejected"] == 1


def test_cancelled_waiting_requests_leave_the_queue_and_a_stopped_scheduler_refuses():
    cm = minikv_compile(tiny(), snapkv(**{**CFG, "max_batch_size": 1}))
    sched = Scheduler(cm, CharTokenizer(), max_queue=2)
    p = prompt_of(30, seed=5)
    running = sched.submit(ServeRequest(p, 20))
    sched._admit_piece()                                   # holds the only slot
    waiting = [sched.submit(ServeRequest(p, 20)) for _ in range(2)]
    for h in waiting:
        h.cancel()                                         # their clients went away
    late = sched.submit(ServeRequest(p, 5))                # not refused: the queue holds 1
    assert sched.queue_depth == 1
    assert [h.result() for h in waiting] == [("", "cancelled")] * 2
    sched.start()
    try:
        assert running.result()[1] == late.result()[1] == "length"
    finally:
        sched.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        sched.submit(ServeRequest(p, 5))


def test_a_request_failing_in_an_unexpected_way_ends_alone():
    # Bad input the server's checks would catch, through the library: a token id that is not
    # an int. It ends with its error; the loop and the other requests go on.
    cm = minikv_compile(tiny(), snapkv(**CFG))
    sched = Scheduler(cm, CharTokenizer())
    good = ServeRequest(prompt_of(30, seed=1), 10)
    want = _alone(cm, [list(good.prompt_ids)], 10)[0]
    handles = [sched.submit(ServeRequest([1, "2", 3], 5)), sched.submit(good)]
    sched._admit_piece()                                   # in this thread: nothing may escape
    text, reason = handles[0].result()
    assert text == "" and reason.startswith("error: TypeError")
    while sched._running:
        sched._step()
    assert handles[1].result() == (want, "length") and sched.failure is None


def test_incremental_detokenizer_never_emits_half_a_character():
    tok = CharTokenizer()
    detok = IncrementalDetokenizer(tok)
    ids = [0, 90, 91, 1, 92, 93, 94, 2]
    pieces = [detok.push(t) for t in ids]
    assert "".join(pieces) == tok.decode(ids)
    assert all("\ufffd" not in piece for piece in pieces)
    assert pieces[1] == "" and pieces[2] == "é" and pieces[4:6] == ["", ""]


def test_many_threads_submit_at_once(served):
    cm, sched = served
    p = prompt_of(20, seed=6)
    want = CharTokenizer().decode(cm.generate([p], max_new_tokens=10, eos_token_id=[]).sequences[0])
    results = []

    def client():
        results.append(sched.submit(ServeRequest(p, 10)).result())

    threads = [threading.Thread(target=client) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == [(want, "length")] * 8


def test_a_prompt_is_prefilled_in_pieces_between_decode_steps():
    # Driven by hand (no loop thread): prefill_layers=1 on the 2-layer model is two pieces.
    cm = minikv_compile(tiny(), snapkv(**CFG))
    sched = Scheduler(cm, CharTokenizer(), prefill_layers=1)
    a, b = prompt_of(100, seed=1), prompt_of(120, seed=2)
    want = [cm.generate([p], max_new_tokens=20, eos_token_id=[]).sequences[0] for p in (a, b)]
    ha = sched.submit(ServeRequest(a, 20))
    sched._admit_piece()            # nothing runs yet: A's whole prefill at once
    assert list(sched._running) == [0] and sched._admitting is None
    assert ha.completion_tokens == 0  # its first token is read with the next step's
    sched._read_pending()
    assert ha.completion_tokens == 1
    hb = sched.submit(ServeRequest(b, 20))
    sched._admit_piece()            # B's first layer, then back to the running stream
    assert sched._admitting is not None and list(sched._running) == [0]
    assert cm.runtime.free_slots() == [2, 3]  # slot 1 is reserved for B meanwhile
    count = ha.completion_tokens
    sched._step()                   # A decodes while B is half prefilled
    sched._read_pending()           # (the loop reads a step while the next one runs)
    assert ha.completion_tokens == count + 1
    sched._admit_piece()            # B's second layer: admitted, its first token queued
    assert sorted(sched._running) == [0, 1] and hb.completion_tokens == 0
    sched._step()                   # B's first token read while the step runs
    assert hb.completion_tokens == 1 and ha.completion_tokens == count + 1
    while sched._running:
        sched._step()
    tok = CharTokenizer()
    assert [ha.result()[0], hb.result()[0]] == [tok.decode(w) for w in want]


def test_a_failing_step_ends_every_request_and_says_so():
    cm = minikv_compile(tiny(), snapkv(**CFG))
    sched = Scheduler(cm, CharTokenizer())
    sched.ready = True

    def broken_step():
        raise RuntimeError("a step failed")

    cm.runtime.step = broken_step
    sched.start()
    try:
        handles = [sched.submit(ServeRequest(prompt_of(20, seed=i), 10)) for i in range(3)]
        for h in handles:
            deltas = list(h)  # ends instead of waiting forever
            assert deltas[-1].finish_reason == "error" and "a step failed" in deltas[-1].error
        assert not sched.serving and "a step failed" in sched.failure
        with pytest.raises(RuntimeError, match="the server failed"):
            sched.submit(ServeRequest(prompt_of(20), 10))
    finally:
        sched.shutdown()


# -- batched prefill ------------------------------------------------------------------------------

def _spy_batches(cm):
    """Record the prompt lengths of every admission the runtime is asked for."""
    rt, batches = cm.runtime, []
    real = rt.admit_batch_in_pieces

    def spy(slots, requests, layers_per_piece):
        batches.append([len(r.prompt) for r in requests])
        return real(slots, requests, layers_per_piece)

    rt.admit_batch_in_pieces = spy
    return batches


def _alone(cm, prompts, n):
    """The text each prompt gets alone, as a stream ends it: without a last half character."""
    tok = CharTokenizer()
    return [tok.decode(cm.generate([p], max_new_tokens=n, eos_token_id=[]).sequences[0])
            .rstrip("\ufffd") for p in prompts]


def test_short_waiting_requests_are_prefilled_in_one_pass():
    cm = minikv_compile(tiny(), snapkv(**{**CFG, "max_batch_size": 8}))
    sched = Scheduler(cm, CharTokenizer(), prefill_batch_tokens=160, prefill_layers=1)
    lengths = [20, 33, 17, 50, 40, 12]         # 120 tokens fit, + 40 = 160 fits, + 12 does not
    prompts = [prompt_of(n, seed=n) for n in lengths]
    want = _alone(cm, prompts, 25)
    batches = _spy_batches(cm)
    handles = [sched.submit(ServeRequest(p, 25)) for p in prompts]
    sched._admit_piece()      # nothing ran: the first five at once, and no more before a step
    assert batches == [lengths[:5]] and sched.metrics.prefills == 1
    assert sorted(sched._running) == list(range(5)) and sched._admitting is None
    sched._read_pending()     # (the loop reads them while the next step runs)
    assert [h.completion_tokens for h in handles] == [1] * 5 + [0]  # five first tokens out
    sched._step()
    sched._admit_piece()      # the sixth's layer 0
    assert batches == [lengths[:5], lengths[5:]] and sched._admitting[0] == [5]
    sched._step()
    sched._admit_piece()      # the sixth's layer 1
    assert sorted(sched._running) == list(range(6)) and sched.metrics.prefills == 2
    while sched._running:
        sched._step()
    assert [h.result() for h in handles] == [(w, "length") for w in want]
    assert sched.metrics.prompt_tokens == sum(lengths)


def test_a_batch_takes_no_more_requests_than_free_slots_and_a_long_prompt_goes_alone():
    cm = minikv_compile(tiny(), snapkv(**CFG))          # 4 slots
    sched = Scheduler(cm, CharTokenizer(), prefill_batch_tokens=100)
    batches = _spy_batches(cm)
    lengths = [120, 10, 10, 10, 10, 10]
    for i, n in enumerate(lengths):
        sched.submit(ServeRequest(prompt_of(n, seed=i), 30 if i == 0 else 5))
    sched._admit_piece()      # the 120-token prompt alone; it streams: one piece a gap from now
    assert batches == [[120]] and sched.queue_depth == 5
    sched._step()
    sched._admit_piece()      # 3 of the short ones: the slots are full
    assert batches == [[120], [10, 10, 10]] and sched.queue_depth == 2
    while sched._running or sched.queue_depth:
        sched._step()
        sched._admit_piece()  # the three end together: the last two in one pass
    assert batches == [[120], [10, 10, 10], [10, 10]]
    assert sched.metrics.requests["length"] == 6


def test_a_failing_batched_prefill_retries_each_request_alone(monkeypatch):
    from minikv_compile.graphs import prefill as prefill_module

    cm = minikv_compile(tiny(), snapkv(**CFG))
    sched = Scheduler(cm, CharTokenizer(), prefill_ms=None, prefill_layers=2)  # one piece each
    real = prefill_module._attend_and_store

    def poisoned(adapter, cache, lc, config, layer, slot, q, k, v):
        if q.shape[2] == 23:  # this prompt's prefill fails, whatever it is batched with
            raise RuntimeError("poisoned prompt")
        return real(adapter, cache, lc, config, layer, slot, q, k, v)

    prompts = [prompt_of(n, seed=n) for n in (20, 23, 30)]
    want = _alone(cm, [prompts[0], prompts[2]], 15)
    batches = _spy_batches(cm)
    monkeypatch.setattr(prefill_module, "_attend_and_store", poisoned)
    handles = [sched.submit(ServeRequest(p, 15)) for p in prompts]
    sched._admit_piece()      # the batch fails; its first request alone joins and streams
    assert batches == [[20, 23, 30], [20]] and sorted(sched._running) == [0]
    for _ in range(2):        # one prefill between two steps: the second fails, the third joins
        sched._step()
        sched._admit_piece()
    assert batches == [[20, 23, 30], [20], [23], [30]]
    assert sorted(sched._running) == [0, 1] and sched.metrics.prefills == 2
    deltas = list(handles[1])
    assert deltas[-1].finish_reason == "error" and "poisoned prompt" in deltas[-1].error
    while sched._running:
        sched._step()
    assert [handles[0].result(), handles[2].result()] == [(w, "length") for w in want]
    assert cm.runtime.free_slots() == [0, 1, 2, 3]


def test_bad_requests_end_alone_and_the_others_are_batched():
    cm = minikv_compile(tiny(), snapkv(**CFG))
    sched = Scheduler(cm, CharTokenizer(), prefill_ms=None, prefill_layers=2)
    p, q = prompt_of(40, seed=1), prompt_of(25, seed=2)
    want = _alone(cm, [p, q], 20)
    batches = _spy_batches(cm)
    good = sched.submit(ServeRequest(p, 20))
    bad = sched.submit(ServeRequest(p, 999))                   # above max_new_tokens
    worse = sched.submit(ServeRequest(q, 10, budgets=(0.9, 0.9)))  # above the engine's budgets
    also = sched.submit(ServeRequest(q, 20))
    sched._admit_piece()
    assert batches == [[40, 25]] and sorted(sched._running) == [0, 1]
    for h, field in ((bad, "max_new_tokens"), (worse, "budgets")):
        deltas = list(h)
        assert deltas[-1].finish_reason == "error" and field in deltas[-1].error
    while sched._running:
        sched._step()
    assert [good.result(), also.result()] == [(w, "length") for w in want]


def test_cancelling_requests_of_a_batch_under_way():
    # prefill_layers=1 on the 2-layer model: a batch admitted while a stream runs takes two
    # rounds. One request of it cancelled meanwhile ends alone; all of one cancelled close it.
    cm = minikv_compile(tiny(), snapkv(**CFG))
    sched = Scheduler(cm, CharTokenizer(), prefill_layers=1)
    a, b, c = prompt_of(60, seed=1), prompt_of(30, seed=2), prompt_of(45, seed=3)
    want = _alone(cm, [a, c], 20)
    ha = sched.submit(ServeRequest(a, 20))
    sched._admit_piece()                                 # A alone, at once (nothing ran)
    hb, hc = sched.submit(ServeRequest(b, 20)), sched.submit(ServeRequest(c, 20))
    sched._admit_piece()                                 # layer 0 of B and C
    assert sched._admitting[0] == [1, 2] and cm.runtime.free_slots() == [3]
    hb.cancel()
    sched._step()
    sched._admit_piece()                                 # layer 1: C joins, B ends
    assert sorted(sched._running) == [0, 2] and cm.runtime.free_slots() == [1, 3]
    sched._read_pending()
    assert hb.result() == ("", "cancelled") and hc.completion_tokens == 1
    hd, he = sched.submit(ServeRequest(b, 20)), sched.submit(ServeRequest(c, 20))
    sched._admit_piece()                                 # layer 0 of D and E
    hd.cancel()
    he.cancel()
    sched._admit_piece()                                 # both cancelled: closed, slots back
    assert sched._admitting is None and cm.runtime.free_slots() == [1, 3]
    assert hd.result()[1] == he.result()[1] == "cancelled"
    while sched._running:
        sched._step()
    assert [ha.result(), hc.result()] == [(w, "length") for w in want]


def test_a_batch_takes_at_most_prefill_batch_requests():
    cm = minikv_compile(tiny(), snapkv(**{**CFG, "max_batch_size": 8}))
    sched = Scheduler(cm, CharTokenizer(), prefill_ms=None, prefill_layers=2,
                      prefill_batch_requests=3)
    batches = _spy_batches(cm)
    for i in range(7):
        sched.submit(ServeRequest(prompt_of(10, seed=i), 5))
    for _ in range(3):        # a pass between two steps
        sched._admit_piece()
        sched._step()
    assert batches == [[10] * 3, [10] * 3, [10]] and sched.metrics.prefills == 3


def test_at_most_one_prefill_piece_runs_between_two_decode_steps():
    # Two long prompts wait while one request streams: each gap between steps holds one piece
    # (one layer here) of one prompt, also where one admission ends and the next begins.
    cm = minikv_compile(tiny(), snapkv(**CFG))
    sched = Scheduler(cm, CharTokenizer(), prefill_layers=1, prefill_batch_tokens=1)
    sched.submit(ServeRequest(prompt_of(10, seed=0), 40))
    sched._admit_piece()                                   # nothing ran: admitted at once
    for n in (100, 90):
        sched.submit(ServeRequest(prompt_of(n, seed=n), 5))
    per_gap, _ = _prefill_layers_per_gap(cm, sched, 6)
    assert per_gap == [1, 1, 1, 1, 0, 0] and sched.metrics.prefills == 3


def _prefill_layers_per_gap(cm, sched, gaps: int):
    """Drive ``gaps`` rounds (the prefill between two steps, then a step) by hand: the prefill
    layers each gap ran, and every prefill layer's index in order."""
    layers = []
    real = cm.adapter.qkv

    def counting(layer, h, *args, **kw):
        if h.shape[1] > 1:                                 # a prefill layer, not a decode row
            layers.append(layer)
        return real(layer, h, *args, **kw)

    cm.adapter.qkv = counting
    per_gap = []
    for _ in range(gaps):
        before = len(layers)
        sched._admit_piece()
        per_gap.append(len(layers) - before)
        sched._step()
    return per_gap, layers


@pytest.mark.parametrize("prefill_ms, layer_ms, per_gap", [
    (25.0, 10.0, [2, 2, 1, 0]),    # two layers of 10 ms fit 25 ms, a third would not
    (5.0, 10.0, [1, 1, 1, 1, 1, 0]),  # one layer even when it is longer than the budget
    (25.0, None, [1, 1, 1, 1, 1, 0]),  # nothing measured yet: one layer at a time
    (None, None, [5, 0]),          # no time limit: the whole prefill in one gap
])
def test_the_prefill_between_two_steps_fits_prefill_ms(monkeypatch, prefill_ms, layer_ms,
                                                       per_gap):
    # A 5-layer model, one request streaming, one long prompt waiting; the clock's estimate
    # of a layer is fixed so that the count of layers per gap is exact.
    cm = minikv_compile(tiny(num_hidden_layers=5), snapkv(**CFG))
    sched = Scheduler(cm, CharTokenizer(), prefill_ms=prefill_ms)
    sched.submit(ServeRequest(prompt_of(10, seed=0), 40))
    sched._admit_piece()                                   # nothing ran: admitted at once
    monkeypatch.setattr(sched.clock, "layer_ms", lambda admission, tokens, kind: layer_ms)
    long = sched.submit(ServeRequest(prompt_of(100, seed=1), 5))
    got, layers = _prefill_layers_per_gap(cm, sched, len(per_gap))
    assert got == per_gap and layers == list(range(5)) and long.completion_tokens >= 1


def test_the_prefill_clock_learns_a_layer_from_the_layers_run():
    cm = minikv_compile(tiny(), snapkv(**CFG))
    clock = Scheduler(cm, CharTokenizer()).clock
    a, b = object(), object()
    assert clock.layer_ms(a, 100) is None                  # nothing measured yet
    clock._current = a                                     # (stop() makes it the one under way
    clock._learn(a, 30.0, 3.0, tokens=100, layers=3)       # and measures this on the CPU)
    assert clock.layer_ms(a, 100) == 10.0                  # its own layers
    assert clock.layer_ms(b, 300) == pytest.approx(30.0)   # another: 0.1 ms a token and layer
    clock.forget(a)
    assert clock.layer_ms(a, 50) == pytest.approx(5.0)
    # at least the host's launches of a layer (here 1 ms), however few the tokens
    assert clock.layer_ms(b, 2) == pytest.approx(1.0)


def test_the_prefill_clock_times_tail_chunks_apart_from_prefill_layers():
    # a chunk of a cached prompt's tail runs every layer: its cost a token is its own
    cm = minikv_compile(tiny(), snapkv(**CFG))
    clock = Scheduler(cm, CharTokenizer()).clock
    a, b, c = object(), object(), object()
    clock._learn(a, 30.0, 3.0, tokens=100, layers=3)                   # 0.1 ms a token, layer
    assert clock.layer_ms(c, 64, "chunk") is None                      # no chunk measured yet
    clock._learn(b, 40.0, 8.0, tokens=16, layers=2, kind="chunk")      # 1.25 ms a chunk token
    assert clock.layer_ms(c, 64, "chunk") == pytest.approx(80.0)
    assert clock.layer_ms(c, 2, "chunk") == pytest.approx(4.0)         # the launches of a chunk
    assert clock.layer_ms(c, 300) == pytest.approx(30.0)               # layers: as before


@pytest.mark.parametrize("kw, message", [
    (dict(prefill_ms=0), "prefill_ms: expected a positive number or None, got 0"),
    (dict(prefill_ms=True), "prefill_ms: expected a positive number or None, got True"),
    (dict(prefill_layers=0), "prefill_layers: expected a positive int or None, got 0"),
    (dict(prefill_layers=1.5), "prefill_layers: expected a positive int or None, got 1.5"),
])
def test_prefill_pacing_arguments_are_checked(kw, message):
    cm = minikv_compile(tiny(), snapkv(**CFG))
    with pytest.raises(ValueError, match=message):
        Scheduler(cm, CharTokenizer(), **kw)


@pytest.mark.parametrize("kw", [dict(prefill_batch_tokens=0), dict(prefill_batch_requests=0),
                                dict(prefill_batch_requests=True)])
def test_prefill_batch_limits_must_be_positive_ints(kw):
    cm = minikv_compile(tiny(), snapkv(**CFG))
    name, value = next(iter(kw.items()))
    with pytest.raises(ValueError, match=rf"{name}: expected a positive int, got {value}"):
        Scheduler(cm, CharTokenizer(), **kw)


@pytest.mark.gpu
def test_gpu_serving_never_compiles_or_captures_after_warm_up():
    # Every bucket and mode is captured by warm_up; mixed greedy / sampled traffic over every
    # bucket then only replays: the compile and graph counts do not move, replays do.
    import torch

    cm = minikv_compile(tiny(dtype=torch.bfloat16, device="cuda"),
                        snapkv(**{**CFG, "max_batch_size": 8}))
    sched = Scheduler(cm, CharTokenizer(), prefill_layers=1)
    sched.warm_up()
    compiles, graphs = cm.stats["compiles"], list(cm.stats["graphs"])
    replays = cm.stats["replays"]
    assert len(graphs) == 2 * len(cm.runtime.buckets)
    sampled = Sampling(greedy=False, temperature=0.9, top_p=0.9, seed=5)
    sched.start()
    try:
        handles = [sched.submit(ServeRequest(prompt_of(20 + 9 * i, seed=i), 10 + 2 * i,
                                             sampling=sampled if i % 3 == 0 else Sampling()))
                   for i in range(12)]
        assert [h.result()[1] for h in handles] == ["length"] * 12
    finally:
        sched.shutdown()
    assert (cm.stats["compiles"], cm.stats["graphs"]) == (compiles, graphs)
    assert cm.stats["replays"] - replays == sched.metrics.steps > 0  # every step a replay


def test_warm_up_freezes_what_start_up_made_out_of_the_collectors_reach():
    import gc

    cm = minikv_compile(tiny(), snapkv(**CFG))
    sched = Scheduler(cm, CharTokenizer())
    gc.unfreeze()
    try:
        sched.warm_up()
        assert sched.ready and gc.get_freeze_count() > 1000  # the model, the engine, torch
    finally:
        gc.unfreeze()


def test_warm_up_prefills_a_prompt_at_capacity_and_frees_its_slot():
    cm = minikv_compile(tiny(), snapkv(**CFG))
    sched = Scheduler(cm, CharTokenizer())
    batches = _spy_batches(cm)
    sched.warm_up()
    assert batches == [[CFG["max_prompt_len"]]]
    assert cm.runtime.free_slots() == list(range(CFG["max_batch_size"]))
    p = prompt_of(40, seed=5)  # and the slot it used serves as if nothing had happened
    want = _alone(cm, [p], 15)
    sched.start()
    try:
        assert sched.submit(ServeRequest(p, 15)).result() == (want[0], "length")
    finally:
        sched.shutdown()


def test_the_prefill_clock_takes_the_longer_of_launching_and_running_a_gap():
    # On the GPU a gap is timed twice: CUDA events (the GPU's time) and the host's launches;
    # short prompts are launch-bound, long ones GPU-bound.
    class Event:
        def __init__(self, ms=0.0):
            self.ms = ms

        def query(self):
            return True

        def elapsed_time(self, end):
            return self.ms

    cm = minikv_compile(tiny(), snapkv(**CFG))
    clock = Scheduler(cm, CharTokenizer()).clock
    a, b = object(), object()
    clock._current = a
    clock._open.append((Event(20.0), Event(), 50.0, a, 100, 2, "layer"))    # launch-bound
    assert clock.layer_ms(a, 100) == 25.0
    clock._current = b
    clock._open.append((Event(80.0), Event(), 10.0, b, 100, 2, "layer"))    # GPU-bound
    assert clock.layer_ms(b, 100) == 40.0


def test_on_delta_receives_what_iteration_would():
    cm = minikv_compile(tiny(), snapkv(**CFG))
    sched = Scheduler(cm, CharTokenizer())
    p = prompt_of(30, seed=2)
    got = []
    pushed = sched.submit(ServeRequest(p, 12), on_delta=got.append)
    pulled = sched.submit(ServeRequest(p, 12))
    with pytest.raises(RuntimeError, match="on_delta"):
        next(iter(pushed))
    sched.start()
    try:
        text, reason = pulled.result()
    finally:
        sched.shutdown()
    assert ("".join(d.text for d in got), got[-1].finish_reason) == (text, reason) == (
        text, "length")
    assert [d.finish_reason for d in got[:-1]] == [None] * (len(got) - 1)


@pytest.mark.parametrize("recall", [dict(recall_top_k=16), dict(recall_top_k=64, recall_block=16,
                                                                heavy_budget=1.0, recent_budget=1.0)])
def test_serving_with_recall_gives_each_request_its_tokens_alone(recall):
    """SpeCache under continuous batching: requests joining and leaving a running batch (each
    admission pre-decodes its slot) get the tokens ``generate`` gives each alone."""
    cm = minikv_compile(tiny(), snapkv(**CFG, **recall))
    prompts = [prompt_of(n, seed=n) for n in (90, 17, 60, 33, 120)]
    sizes = [40, 12, 31, 25, 8]
    want = [_alone(cm, [p], n)[0] for p, n in zip(prompts, sizes)]
    sched = Scheduler(cm, CharTokenizer(), max_queue=8)
    sched.start()
    try:
        handles = [sched.submit(ServeRequest(p, n)) for p, n in zip(prompts[:3], sizes[:3])]
        time.sleep(0.05)  # the last two join while the first three are generating
        handles += [sched.submit(ServeRequest(p, n)) for p, n in zip(prompts[3:], sizes[3:])]
        for h, w, n in zip(handles, want, sizes):
            assert h.result() == (w, "length") and h.completion_tokens == n
    finally:
        sched.shutdown()


def test_a_shutdown_while_warming_up_ends_the_warm_up_and_waits_for_it(monkeypatch):
    """Under tensor parallel the warm-up's calls are collectives: shutdown must not tell the
    other ranks to stop while another thread still makes them. It ends the warm-up at its next
    step and returns after it; the loop is not started afterwards."""
    cm = minikv_compile(tiny(), snapkv(**CFG))
    sched = Scheduler(cm, CharTokenizer())
    calls, entered = [], threading.Event()

    def prepare(bucket, mode):  # one bucket's compile and capture, slowed
        calls.append((bucket, mode))
        entered.set()
        time.sleep(0.3)

    monkeypatch.setattr(cm.runtime, "prepare", prepare)
    errors = []

    def warm():
        try:
            sched.warm_up()
        except RuntimeError as e:
            errors.append(str(e))
        sched.start()

    thread = threading.Thread(target=warm)
    thread.start()
    assert entered.wait(30)
    sched.shutdown()
    assert sched._warm_idle.is_set()  # the warm-up had ended when shutdown returned
    thread.join(10)
    assert len(calls) == 1 and errors == [
        "warm-up: the scheduler was shut down before it was ready"]
    assert sched._thread is None and not sched.ready


def test_an_idle_tensor_parallel_loop_sends_heartbeats_by_the_clock(monkeypatch):
    """The other ranks wait in a collective with a timeout: rank 0's idle loop sends a call
    every HEARTBEAT_S since the last one, also while wake-ups that lead to no call (requests
    cancelled or refused before admission) keep coming faster than that."""
    from minikv_compile import scheduler as S

    class Replicated:  # stands in for rank 0's ReplicatedRuntime
        def __init__(self, rt):
            self.rt, self.last_sent, self.beats = rt, time.monotonic(), []

        def __getattr__(self, name):
            return getattr(self.rt, name)

        def heartbeat(self):
            self.beats.append(time.monotonic())
            self.last_sent = time.monotonic()

        def stop_followers(self):
            pass

    monkeypatch.setattr(S, "ReplicatedRuntime", Replicated)
    monkeypatch.setattr(S, "HEARTBEAT_S", 0.2)
    cm = minikv_compile(tiny(), snapkv(**CFG))
    sched = Scheduler(cm, CharTokenizer())
    sched.rt = Replicated(cm.runtime)
    sched.start()
    try:
        start = time.monotonic()
        while time.monotonic() - start < 1.2:  # a wake-up every 50 ms, none a call
            with sched._cv:
                sched._cv.notify_all()
            time.sleep(0.05)
        beats = sched.rt.beats
        assert len(beats) >= 4, beats
        assert all(b - a < 0.45 for a, b in zip([start] + beats, beats)), beats
    finally:
        sched.shutdown()
