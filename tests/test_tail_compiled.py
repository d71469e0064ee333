"""The compiled tail prefill (``graphs/tail.py``, ``TailPrefill``): its layer compiled with
``torch.compile(fullgraph=True)`` gives the eager layer's logits and cache, and tails of new
lengths do not recompile (one graph for every layer and every chunk of T >= 2 tokens). CPU,
fp32, a tiny random Llama, one engine (one compile); the same on CUDA for the GPU run.
"""
from __future__ import annotations

import pytest
import torch

from minikv_compile import MiniKVConfig, minikv_compile
from minikv_compile.graphs.runtime import engine_mode
from minikv_compile.graphs.tail import TailPrefill
from test_engine import prompt_of, tiny

# ring 32; a 90-token doc leaves ring rows behind, so tails cross flushes in chunks of the room
CFG = dict(max_batch_size=2, residual_length=32, max_prompt_len=224, max_new_tokens=8, kept_floor=1)
DOC = prompt_of(90, 1)


@pytest.fixture(scope="module")
def engine():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny shapes: intra-op threads only contend
    yield minikv_compile(tiny(), MiniKVConfig(**CFG, compile=True))
    torch.set_num_threads(n)


def _run(tail: TailPrefill, rt, snapshot, ids: torch.Tensor, slot: int):
    """Slot ``slot``'s logits and buffers after ``tail`` prefills ``ids`` after ``snapshot``,
    and the chunks it took."""
    rt.cache.restore(slot, snapshot)
    gen, chunks = tail(slot, ids, len(snapshot.tokens)), 1
    with engine_mode():
        while True:
            try:
                next(gen)
            except StopIteration as stop:
                logits = stop.value
                break
            chunks += 1
    buffers = [t[slot].clone() for layer in rt.cache.layers for t in layer if t.numel()]
    return logits, buffers, chunks


def test_compiled_tail_equals_eager_and_does_not_recompile(engine):
    rt = engine.runtime
    snapshot = engine.cache_prompt([DOC]).sequences[0]
    eager = TailPrefill(rt.adapter, rt.cache, compile=False)
    compiled = rt.tail
    assert compiled.compiles == 0
    # 45 tokens: chunks of the ring's room then of a whole ring; 20 and 61: other lengths, the
    # last in the other slot (other views of the buffers)
    for i, (n, slot) in enumerate([(45, 0), (20, 0), (61, 1)]):
        ids = torch.tensor(prompt_of(n, 10 + i))
        want, want_bufs, chunks = _run(eager, rt, snapshot, ids, slot)
        got, got_bufs, _ = _run(compiled, rt, snapshot, ids, slot)
        assert chunks >= 2  # (the ring is flushed between them)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for g, w in zip(got_bufs, want_bufs):
            if g.is_floating_point():
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
            else:  # counters and codes: exact
                assert torch.equal(g, w)
        assert compiled.compiles == 1, (f"tail of {n} tokens in slot {slot}: "
                                        f"{compiled.compiles} compiles")


@pytest.mark.gpu
def test_gpu_compiled_tail_equals_eager_and_does_not_recompile():
    """On CUDA (inductor's kernels, the Triton tail kernel; fp32 and bits 16, so that the two
    differ only in the order of fp32 sums): the same check."""
    engine = minikv_compile(tiny(device="cuda"),
                            MiniKVConfig(**CFG, bits=16, heavy_budget=1.0, recent_budget=1.0))
    rt = engine.runtime
    snapshot = engine.cache_prompt([DOC]).sequences[0]
    eager = TailPrefill(rt.adapter, rt.cache, compile=False)
    for i, (n, slot) in enumerate([(45, 0), (20, 0), (61, 1)]):
        ids = torch.tensor(prompt_of(n, 10 + i), device="cuda")
        want, want_bufs, _ = _run(eager, rt, snapshot, ids, slot)
        got, got_bufs, _ = _run(rt.tail, rt, snapshot, ids, slot)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for g, w in zip(got_bufs, want_bufs):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)  # (lens: int, exact)
        assert rt.tail.compiles == 1, f"tail of {n} tokens in slot {slot}"
