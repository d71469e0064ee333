"""The scheduler: continuous batching over the runtime of slots, in-process (the HTTP server on
top of it is tests/test_serve.py). CPU, fp32, tiny random Llama (tests/test_engine.py)."""
from __future__ import annotations

import threading
import time

import pytest

from minikv_compile import MiniKVConfig, minikv_compile
from minikv_compile.graphs.sampling import Sampling
from minikv_compile.scheduler import (IncrementalDetokenizer, QueueFull, Scheduler,
                                      ServeRequest)
from test_engine import prompt_of, tiny

CFG = dict(residual_length=32, max_prompt_len=128, max_new_tokens=40, max_batch_size=4)


class CharTokenizer:
    """Token t decodes to one character; ids 90..100 to the two UTF-8 halves of "é" and "€"'s
    three bytes, so that a character can span tokens (as byte-level BPE splits them)."""

    BYTES = {90: b"\xc3", 91: b"\xa9", 92: b"\xe2", 93: b"\x82", 94: b"\xac"}

    def decode(self, ids, skip_special_tokens=True):
        data = b"".join(self.BYTES.get(t, chr(0x61 + t % 26).encode()) for t in ids)
        return data.decode("utf-8", errors="replace")


@pytest.fixture
def served():
    cm = minikv_compile(tiny(), MiniKVConfig(**CFG))
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
    cm = minikv_compile(tiny(), MiniKVConfig(**{**CFG, "max_batch_size": 1}))
    sched = Scheduler(cm, CharTokenizer(), max_queue=2)
    p = prompt_of(30, seed=5)
    sampled = Sampling(greedy=False, temperature=1.2, seed=77)
    handles = [sched.submit(ServeRequest(p, 20, sampling=sampled)) for _ in range(2)]
    with pytest.raises(QueueFull) as e:
        sched.submit(ServeRequest(p, 20))
    assert e.value.retry_after >= 1
    sched.start()
    try:
        texts = [h.result()[0] for h in handles]
        assert texts[0] == texts[1]  # the same seed, the same tokens, whatever ran before
    finally:
        sched.shutdown()
    assert sched.metrics.requests["rejected"] == 1


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
    cm = minikv_compile(tiny(), MiniKVConfig(**CFG))
    sched = Scheduler(cm, CharTokenizer(), prefill_layers=1)
    a, b = prompt_of(100, seed=1), prompt_of(120, seed=2)
    want = [cm.generate([p], max_new_tokens=20, eos_token_id=[]).sequences[0] for p in (a, b)]
    ha = sched.submit(ServeRequest(a, 20))
    sched._admit_piece()            # nothing runs yet: A's whole prefill at once
    assert list(sched._running) == [0] and sched._admitting is None
    hb = sched.submit(ServeRequest(b, 20))
    sched._admit_piece()            # B's first layer, then back to the running stream
    assert sched._admitting is not None and list(sched._running) == [0]
    assert cm.runtime.free_slots() == [2, 3]  # slot 1 is reserved for B meanwhile
    count = ha.completion_tokens
    sched._step()                   # A decodes while B is half prefilled
    assert ha.completion_tokens == count + 1
    sched._admit_piece()            # B's second layer: admitted, its first token out
    assert sorted(sched._running) == [0, 1] and hb.completion_tokens == 1
    while sched._running:
        sched._step()
    tok = CharTokenizer()
    assert [ha.result()[0], hb.result()[0]] == [tok.decode(w) for w in want]


def test_a_failing_step_ends_every_request_and_says_so():
    cm = minikv_compile(tiny(), MiniKVConfig(**CFG))
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
