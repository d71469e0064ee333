"""The compiled tail prefill (``graphs/tail.py``, ``TailPrefill``): its layer compiled with
``torch.compile(fullgraph=True)`` gives the eager layer's logits and cache, and tails of new
lengths do not recompile (one graph for every layer and every chunk of T >= 2 tokens). CPU,
fp32, a tiny random Llama with recall (its tail recalls per chunk), one engine (one compile);
on CUDA for the GPU run, the 16-bit cache.
"""
from __future__ import annotations

import pytest
import torch

from minikv_compile import MiniKVConfig, minikv_compile
from minikv_compile.graphs.runtime import engine_mode
from minikv_compile.graphs.tail import TailPrefill
from minikv_compile.ops import attention_tail_recall
from minikv_compile.ops.attention_tail_recall import tail_recall_select_ref
from test_engine import prompt_of, tiny

# ring 32; a 90-token doc leaves ring rows behind, so tails cross flushes in chunks of the room
CFG = dict(max_batch_size=2, residual_length=32, max_prompt_len=224, max_new_tokens=8, kept_floor=1)
DOC = prompt_of(90, 1)


@pytest.fixture(scope="module")
def engine():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny shapes: intra-op threads only contend
    # with recall: the layer's recall arguments (the slot's host views) are graph inputs too
    yield minikv_compile(tiny(), MiniKVConfig(**CFG, recall_top_k=16, compile=True))
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


def test_compiled_tail_equals_eager_and_does_not_recompile(engine, monkeypatch):
    rt = engine.runtime
    snapshot = engine.cache_prompt([DOC]).sequences[0]
    eager = TailPrefill(rt.adapter, rt.cache, compile=False)
    compiled = rt.tail
    assert compiled.compiles == 0
    # every ranking's chosen rows
    ranked, layers = [], len(rt.cache.layers)

    def select(*args):
        idx = tail_recall_select_ref(*args)
        ranked.append(idx.clone())
        return idx

    monkeypatch.setattr(attention_tail_recall, "tail_recall_select_ref", select)
    # 45 tokens: chunks of the ring's room then of a whole ring; 20 and 61: other lengths, the
    # last in the other slot (other views of the buffers)
    for i, (n, slot) in enumerate([(45, 0), (20, 0), (61, 1)]):
        ids = torch.tensor(prompt_of(n, 10 + i))
        ranked.clear()
        want, want_bufs, chunks = _run(eager, rt, snapshot, ids, slot)
        eager_ranked = list(ranked)
        ranked.clear()
        got, got_bufs, _ = _run(compiled, rt, snapshot, ids, slot)
        assert chunks >= 2  # (the ring is flushed between them)
        assert len(eager_ranked) == len(ranked) == chunks * layers
        for idx_e, idx_c in zip(eager_ranked, ranked):
            assert torch.equal(idx_e, idx_c)  # the same rows recalled
        # K rows differ by ~1e-6 (inductor's fused fp32 against eager), and a flush can round a
        # group's fp16 zero one ulp (2e-3) apart: the recalled tail's logits move by up to
        # 6.4e-5 here (1.5e-6 for this engine without recall)
        torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)
        for g, w in zip(got_bufs, want_bufs):
            if g.dtype == torch.float16:  # scales and zeros: an ulp
                torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-5)
            elif g.is_floating_point():  # K/V rows
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
            else:  # counters and codes: exact
                assert torch.equal(g, w)
        assert compiled.compiles == 1, (f"tail of {n} tokens in slot {slot}: "
                                        f"{compiled.compiles} compiles")


@pytest.mark.gpu
def test_gpu_compiled_tail_equals_eager_and_does_not_recompile():
    """On CUDA in bf16 (the engine's dtypes there; inductor's kernels, the Triton tail kernel
    in both paths; bits 16 and nothing evicted): the compiled tail against the eager one.
    What may differ: inductor fuses the norms, RoPE, residual adds and the MLP's activation
    and keeps their intermediates in fp32, where eager rounds each op's output to bf16; so
    h, K and V differ by a few bf16 ulps (2^-8 relative), and the logits (the lm_head in
    bf16) by a few ulps of their scale (the same check in bf16 on the CPU: max 0.017 and mean
    0.004 of the scale, K/V rows 0.014). A wrong row, position or layer is O(1) off. Exact:
    the counters, the greedy token (where eager's top two are further apart than the bound),
    and the compile count."""
    engine = minikv_compile(tiny(dtype=torch.bfloat16, device="cuda"),
                            MiniKVConfig(**CFG, bits=16, heavy_budget=1.0, recent_budget=1.0))
    rt = engine.runtime
    assert rt.tail.compiles == 0
    snapshot = engine.cache_prompt([DOC]).sequences[0]
    eager = TailPrefill(rt.adapter, rt.cache, compile=False)
    for i, (n, slot) in enumerate([(45, 0), (20, 0), (61, 1)]):
        ids = torch.tensor(prompt_of(n, 10 + i), device="cuda")
        want, want_bufs, chunks = _run(eager, rt, snapshot, ids, slot)
        got, got_bufs, _ = _run(rt.tail, rt, snapshot, ids, slot)
        assert chunks >= 2 and got.dtype == want.dtype == torch.float32
        scale = want.abs().max().item()
        bound = 0.05 * scale  # ~12 ulps of bf16 at the logits' largest value
        diff = (got - want).abs()
        assert diff.max() <= bound and diff.mean() <= 0.02 * scale, (n, diff.max(), scale)
        top2 = want[0].topk(2).values
        if top2[0] - top2[1] > 2 * bound:
            assert got[0].argmax() == want[0].argmax(), f"tail of {n} tokens: greedy token"
        for g, w in zip(got_bufs, want_bufs):
            if g.is_floating_point():  # K/V rows (bf16): a few ulps at their scale
                torch.testing.assert_close(g.float(), w.float(), rtol=0.03,
                                           atol=0.03 * w.float().abs().max().item())
            else:  # counters: exact
                assert torch.equal(g, w)
        assert rt.tail.compiles == 1, f"tail of {n} tokens in slot {slot}"
