"""The batched (varlen) prefill: several prompts in one pass leave every slot as admitting them
one by one does (graphs/prefill.py, SlotRuntime.admit_batch / admit_batch_in_pieces).

CPU, fp32, tiny random Llama (tests/test_engine.py's `tiny`: 2 layers, 4 q / 2 KV heads, head
dim 64). The pass computes each prompt's rows of every projection in one GEMM of sum(L_i) rows
instead of L_i rows; everything else of a prompt runs on its own slice in the same order as
alone. Where the BLAS gives a row the same bits whatever the GEMM's row count (`_row_exact`,
probed on the model's own weights: this machine's sgemm does for M >= 12, and takes another
kernel below 12 rows, multiples of 4 aside), every buffer of the slot is compared bit-exactly;
below, the prompts' rows differ in the last bits (~1e-6) and the slot's full-precision ring is
compared at 1e-5.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minikv_compile import MiniKVConfig, minikv_compile
from minikv_compile.graphs import prefill as prefill_module
from minikv_compile.graphs.runtime import Request, engine_mode
from minikv_compile.graphs.sampling import Sampling
from test_engine import prompt_of, tiny

# heavy + recent = 1: a request with the engine's budgets keeps every token (the SDPA path, no
# scores); smaller per-request budgets evict (selective attention, scores, selection).
CFG = dict(residual_length=32, max_prompt_len=128, max_new_tokens=40, max_batch_size=8,
           heavy_budget=0.5, recent_budget=0.5, kept_floor=1)
# (prompt length, budgets): nothing evicted at 5, 37, 3 tokens; evicted at the others, under
# four different budgets. 3 and 5 tokens keep fewer than a group: all in the ring.
MIX = [(5, None), (100, (0.25, 0.25)), (37, None), (128, (0.1, 0.3)), (17, (0.5, 0.2)),
       (3, None), (64, (0.3, 0.1))]
SLOTS = [6, 0, 3, 1, 5, 2, 4]  # any free slots, in any order
NAMES = ("k_cache", "k_scale", "k_zero", "v_cache", "v_scale", "v_zero", "k_ring", "v_ring",
         "lens")


def _requests(mix=MIX, n=30, sampled=()):
    return [Request(prompt_of(L, seed=L), n, budgets=b,
                    sampling=Sampling(greedy=False, temperature=1.1, seed=5 + i)
                    if i in sampled else Sampling())
            for i, (L, b) in enumerate(mix)]


def _row_exact(cm, lengths) -> list:
    """Per prompt: whether every projection the prefill runs gives its rows the same bits in a
    GEMM of its own ``L_i`` rows as in one of ``sum(L_i)`` rows (the batched pass)."""
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    a = cm.adapter
    if a.fused is None:  # the modules one by one (the CPU)
        weights = [m.weight for block in a.layers for m in block.modules()
                   if isinstance(m, nn.Linear)]
    else:                # fused [q; k; v] and [gate; up] (CUDA), o_proj and down_proj
        weights = [f[name][0] for f in a.fused for name in ("qkv", "gate_up")]
        weights += [m.weight for b in a.layers for m in (b.self_attn.o_proj, b.mlp.down_proj)]
    g = torch.Generator(device=weights[0].device).manual_seed(0)
    exact = [True] * len(lengths)
    for w in weights:
        x = torch.randn(sum(lengths), w.shape[1], generator=g, device=w.device).to(w.dtype)
        full = F.linear(x[None], w)[0]
        for i, (s, L) in enumerate(zip(starts, lengths)):
            exact[i] &= torch.equal(F.linear(x[None, s: s + L], w)[0], full[s: s + L])
    return exact


def _compare_slots(one, batched, slots, exact, atol):
    """Every buffer of every layer at each slot: bit-exact where ``exact``, else the ring at
    ``atol`` and everything else (codes, scales, zeros, counters) bit-exact."""
    for layer, (la, lb) in enumerate(zip(one.runtime.cache.layers, batched.runtime.cache.layers)):
        for name, x, y in zip(NAMES, la, lb):
            if x.numel() == 0:  # the scales and zeros of a 16-bit cache
                continue
            for slot, ok in zip(slots, exact):
                where = f"layer {layer} {name} slot {slot}"
                if ok or "ring" not in name:
                    assert torch.equal(x[slot], y[slot]), where
                else:
                    torch.testing.assert_close(x[slot], y[slot], rtol=0, atol=atol, msg=where)


def _run(rt, slots):
    while not all(rt.finished(slots)):
        rt.step()
    return rt.outputs(slots)


@pytest.mark.parametrize("mode", [
    dict(),                                                   # snapkv, blocks, sinks, 2 bit
    dict(selection="h2o", selection_block=1, sink_tokens=0, bits=4),
    dict(selection="snapkv_h2o", budget_policy="pyramid"),
    dict(selection="h2o_mean", bits=16),
])
def test_batched_prefill_leaves_every_slot_as_one_by_one(mode):
    config = MiniKVConfig(**CFG, **mode)
    one, batched = minikv_compile(tiny(), config), minikv_compile(tiny(), config)
    requests = _requests(sampled={1, 4})                       # two sampled beside greedy ones
    for slot, r in zip(SLOTS, requests):
        one.runtime.admit(slot, r)
    batched.runtime.admit_batch(SLOTS, requests)
    exact = _row_exact(batched, [len(r.prompt) for r in requests])
    assert all(ok for ok, r in zip(exact, requests) if len(r.prompt) >= 12), (
        "this BLAS gives the rows of a GEMM of 12 rows or more other bits by the row count")
    _compare_slots(one, batched, SLOTS, exact, atol=1e-5)
    # the first tokens and every other state buffer (sampling parameters, seen tokens, counters)
    for x, y in zip(one.runtime.state.buffers(), batched.runtime.state.buffers()):
        assert torch.equal(x, y)
    assert batched.runtime.admitted == sorted(SLOTS)
    assert _run(batched.runtime, SLOTS) == _run(one.runtime, SLOTS)


def test_prefill_of_one_prompt_is_the_batched_pass_of_one():
    # The single-prompt admission goes through the same pass; the module's whole-prefill entry
    # returns (n, V) logits, one row per prompt, each its last position's.
    cm = minikv_compile(tiny(), MiniKVConfig(**CFG))
    rt, cfg = cm.runtime, cm.config
    ids = [torch.tensor(prompt_of(L, seed=L)) for L in (40, 90)]
    with engine_mode():
        both = prefill_module.prefill(cm.adapter, rt.cache, [cfg, cfg], [0, 1], ids)
        alone = [prefill_module.prefill(cm.adapter, rt.cache, [cfg], [2], [p])[0] for p in ids]
        hf = [cm.model(p[None]).logits[0, -1] for p in ids]
    assert both.shape == (2, cm.adapter.vocab_size) and both.dtype == torch.float32
    for row, a, h in zip(both, alone, hf):
        torch.testing.assert_close(row, a, rtol=1e-5, atol=1e-5)  # a GEMM of 2 rows vs 1
        torch.testing.assert_close(row, h, rtol=1e-4, atol=1e-4)  # the model's own logits
    with pytest.raises(ValueError, match="expected one config and one slot per prompt"):
        prefill_module.prefill(cm.adapter, rt.cache, [cfg], [0, 1], ids)


def test_batch_in_pieces_between_steps_of_a_running_slot():
    cm = minikv_compile(tiny(), MiniKVConfig(**CFG))
    rt = cm.runtime
    running = Request(prompt_of(70, seed=1), 40)
    batch = _requests([(20, None), (100, (0.2, 0.2)), (45, None)], n=25)

    def alone(r):
        rt.admit(0, r)
        out = _run(rt, [0])[0]
        rt.release(0)
        return out

    want = [alone(r) for r in [running] + batch]
    rt.admit(0, running)
    rt.step()
    pieces = rt.admit_batch_in_pieces([1, 2, 3], batch, 1)  # 2 layers: 2 pieces
    next(pieces)
    assert rt.free_slots() == [4, 5, 6, 7] and rt.admitted == [0]  # reserved while under way
    rt.step()                                                       # the running slot goes on
    with pytest.raises(StopIteration):
        next(pieces)
    assert rt.admitted == [0, 1, 2, 3] and rt.outputs([1, 2, 3]) == [[w[0]] for w in want[1:]]
    assert _run(rt, [0, 1, 2, 3]) == want


def test_closing_a_batch_early_gives_every_slot_back_empty():
    cm = minikv_compile(tiny(), MiniKVConfig(**CFG))
    rt = cm.runtime
    rt.admit(0, Request(prompt_of(30, seed=2), 20))
    before = [[t.clone() for t in lc] for lc in rt.cache.layers]
    pieces = rt.admit_batch_in_pieces([3, 1], _requests([(50, None), (80, (0.2, 0.2))]), 1)
    next(pieces)                                        # layer 0 of both written
    assert any(lc.lens[3, 0] > 0 for lc in rt.cache.layers)
    pieces.close()
    assert rt.free_slots() == [1, 2, 3, 4, 5, 6, 7] and rt.admitted == [0]
    for lc, was in zip(rt.cache.layers, before):
        assert lc.lens[[1, 3]].tolist() == [[0, 1], [0, 1]]           # empty again
        for t, w in zip(lc, was):
            assert torch.equal(t[0], w[0])                            # slot 0 untouched
    assert not rt.state.active[[1, 3]].any()
    rt.admit_batch([1, 3], _requests([(50, None), (80, (0.2, 0.2))]))  # reusable at once


def test_an_error_in_a_batched_prefill_gives_every_slot_back(monkeypatch):
    cm = minikv_compile(tiny(), MiniKVConfig(**CFG))
    rt = cm.runtime
    real = prefill_module._attend_and_store

    def poisoned(adapter, cache, lc, config, layer, slot, q, k, v):
        if layer == 1 and q.shape[2] == 33:
            raise RuntimeError("poisoned prompt")
        return real(adapter, cache, lc, config, layer, slot, q, k, v)

    monkeypatch.setattr(prefill_module, "_attend_and_store", poisoned)
    with pytest.raises(RuntimeError, match="poisoned prompt"):
        rt.admit_batch([0, 1, 2], _requests([(20, None), (33, None), (40, None)]))
    assert rt.admitted == [] and rt.free_slots() == list(range(8))
    assert all(lc.lens[:3].tolist() == [[0, 1]] * 3 for lc in rt.cache.layers)
    rt.admit_batch([0, 2], _requests([(20, None), (40, None)]))  # the others, without it
    assert rt.admitted == [0, 2]


@pytest.mark.parametrize("slots, requests, match", [
    ([0, 1], [Request([1], 4)], r"requests: expected one request per slot, at least one, got "
                                r"1 requests for 2 slots"),
    ([], [], r"requests: expected one request per slot"),
    ((0, 0), (Request([1], 4), Request([2], 4)), r"slots: expected distinct slots, got \[0, 0\]"),
    ([0, 8], [Request([1], 4), Request([2], 4)], r"slots\[1\]: expected an int in \[0, 8\), got 8"),
    ([0, 1], [Request([1], 4), Request([1], 41)],
     r"requests\[1\].max_new_tokens: expected 1..40"),
    ([0, 1], [Request([1], 4), Request([1, 101], 4)],
     r"requests\[1\].prompt: expected token ids in \[0, 101\), got 101"),
    ([0, 1], [Request([1], 4), (1, 2)], r"requests\[1\]: expected a Request, got tuple"),
    ([0, 1], [Request([1], 4), Request([1], 4, forced=[1] * 4)],
     r"teacher forcing runs alone"),
    ([0], [Request([1] * 129, 4)], r"^request.prompt: expected 1..128"),  # a batch of one
    (torch.tensor([0]), [Request([1], 4)], r"slots: expected a list, got Tensor"),
])
def test_admit_batch_checks_everything_before_touching_anything(slots, requests, match):
    cm = minikv_compile(tiny(), MiniKVConfig(**CFG))
    rt = cm.runtime
    state = [t.clone() for t in rt.state.buffers()]
    cache = [[t.clone() for t in lc] for lc in rt.cache.layers]
    with pytest.raises(ValueError, match=match):
        rt.admit_batch(slots, requests)
    assert rt.admitted == [] and rt.free_slots() == list(range(8))
    assert all(torch.equal(a, b) for a, b in zip(state, rt.state.buffers()))
    assert all(torch.equal(a, b) for lc, was in zip(rt.cache.layers, cache) for a, b in zip(lc, was))


def test_admit_batch_refuses_held_and_reserved_slots():
    cm = minikv_compile(tiny(), MiniKVConfig(**CFG))
    rt = cm.runtime
    rt.admit(2, Request(prompt_of(10), 5))
    with pytest.raises(ValueError, match=r"slots\[1\]: expected a free slot, got slot 2, which "
                                         r"holds a request"):
        rt.admit_batch([0, 2], _requests([(10, None), (12, None)]))
    pieces = rt.admit_batch_in_pieces([0, 1], _requests([(10, None), (12, None)]), 1)
    next(pieces)
    with pytest.raises(ValueError, match=r"slot: expected a free slot, got slot 1, which is "
                                         r"being admitted"):
        rt.admit(1, Request(prompt_of(10), 5))
    with pytest.raises(ValueError, match=r"layers_per_piece: expected a positive int, got 0"):
        next(rt.admit_batch_in_pieces([3], _requests([(10, None)]), 0))
    pieces.close()
    assert rt.free_slots() == [0, 1, 3, 4, 5, 6, 7]


# -- GPU ------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_batched_prefill_matches_one_by_one():
    # bf16 on CUDA: the Triton selective attention and cache write read each prompt's slice of
    # the pass in place (views with an offset). cuBLAS may choose another kernel for a GEMM of
    # sum(L_i) rows than of L_i rows (rows then differ in the last bits, and a 2-bit code or a
    # near tie of the selection may flip): `_row_exact` says which prompts are bit-exact here.
    config = MiniKVConfig(**CFG)
    one = minikv_compile(tiny(dtype=torch.bfloat16, device="cuda"), config)
    batched = minikv_compile(tiny(dtype=torch.bfloat16, device="cuda"), config)
    requests = _requests()
    for slot, r in zip(SLOTS, requests):
        one.runtime.admit(slot, r)
    batched.runtime.admit_batch(SLOTS, requests)
    exact = _row_exact(batched, [len(r.prompt) for r in requests])
    for layer, (la, lb) in enumerate(zip(one.runtime.cache.layers, batched.runtime.cache.layers)):
        assert torch.equal(la.lens, lb.lens)  # the budgets alone decide the counts
        for name, x, y in zip(NAMES, la, lb):
            for slot, ok, r in zip(SLOTS, exact, requests):
                if ok:
                    assert torch.equal(x[slot], y[slot]), f"layer {layer} {name} slot {slot}"
                elif "ring" in name and r.budgets is None:  # every token kept: no selection
                    torch.testing.assert_close(x[slot], y[slot], rtol=2e-2, atol=2e-2)
    if all(exact):
        assert _run(batched.runtime, SLOTS) == _run(one.runtime, SLOTS)
