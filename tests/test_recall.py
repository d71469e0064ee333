"""minikv::recall_gather and the SpeCache references (ops/recall.py, issue 25).

CPU: the Triton gather under TRITON_INTERPRET=1 against the reference (exact: it is a copy), the
registered op (dispatch, opcheck, torch.compile), input validation, the attention-with-recall
oracle against the existing decode-attention reference at both ends (nothing recalled, every
position recalled), and the top-k rule on a hand-made example. GPU: the gather reading a pinned
host store, captured in a CUDA graph and replayed after idx and the host rows change, and the
capture under the sync-debug guard.
"""
from __future__ import annotations

import dataclasses
from typing import List

import pytest
import torch

from minikv_compile.ops import (HostStore, decode_attention, decode_attention_recall,
                                recall_gather, recall_store, recall_topk)
from minikv_compile.ops import recall as recall_module
from minikv_compile.ops._checks import sm_count
from minikv_compile.ops.attention_decode import (FRAGMENTS, _decode_attention_triton, _plan,
                                                 decode_attention_ref)
from minikv_compile.ops.attention_decode_recall import (_decode_attention_recall_triton,
                                                        decode_attention_recall_ref)
from minikv_compile.ops.quant import quantize_keys_ref, quantize_values_ref
from minikv_compile.ops.recall import (_recall_gather_triton, _recall_store_rows_triton,
                                       _recall_store_triton, mass_codes, mass_values,
                                       recall_gather_ref, recall_store_rows,
                                       recall_store_rows_ref, recall_topk_ref)
from aot import compile_for_sm90
from test_decode_attention import Case, make_case, poisoned

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _indices(batch: int, h_kv: int, k: int, t_cap: int, device="cpu") -> torch.Tensor:
    """(batch, h_kv, k) int32 in [-1, t_cap + 2): unused rows and rows past the store too."""
    return torch.randint(-1, t_cap + 2, (batch, h_kv, k), dtype=torch.int32, device=device)


def _gather_case(b_max, h_kv, t_cap, k, d, dtype, device="cpu"):
    """A store, NaN-filled recall buffers (what must stay untouched stays NaN)."""
    store = HostStore(torch.randn(b_max, h_kv, t_cap, d).to(dtype),
                      torch.randn(b_max, h_kv, t_cap, d).to(dtype), "cpu")
    rk = torch.full((b_max, h_kv, k, d), float("nan"), dtype=dtype, device=device)
    return store, rk, rk.clone()


def _assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


# ----------------------------------------------------------------------------------------------
# The gather: Triton (interpreter) and the registered op against the reference
# ----------------------------------------------------------------------------------------------


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b_max,batch,h_kv,t_cap,k,d", [
    (3, 2, 2, 40, 5, 16),    # a bucket below Bmax, K not a power of two
    (1, 1, 1, 16, 1, 24),    # D not a power of two
    (2, 2, 3, 33, 70, 8),    # K > T_cap: repeated rows
])
@pytest.mark.parametrize("programs", [1 << 30, 2])  # a program per tile; 2 looping over them
@pytest.mark.parametrize("tile", [8192, 32])  # 32: tiles of 1-4 rows, straddling planes
def test_triton_gather_matches_reference(dtype, b_max, batch, h_kv, t_cap, k, d, programs, tile,
                                         monkeypatch):
    monkeypatch.setattr(recall_module, "_GATHER_PROGRAMS", programs)
    monkeypatch.setattr(recall_module, "_TILE_ELEMENTS", tile)
    store, rk, rv = _gather_case(b_max, h_kv, t_cap, k, d, dtype)
    idx = _indices(batch, h_kv, k, t_cap)
    idx[0, 0, 0] = -1
    rk_ref, rv_ref = rk.clone(), rv.clone()
    recall_gather_ref(store.k, store.v, idx, rk_ref, rv_ref)
    _recall_gather_triton(store.k, store.v, idx, rk, rv)
    _assert_same(rk, rk_ref)
    _assert_same(rv, rv_ref)
    # the reference's own contract, checked row by row
    for b in range(b_max):
        for h in range(h_kv):
            for j in range(k):
                t = int(idx[b, h, j]) if b < batch else None
                if t is None:
                    assert rk_ref[b, h, j].isnan().all()
                elif 0 <= t < t_cap:
                    assert torch.equal(rk_ref[b, h, j], store.k[b, h, t])
                    assert torch.equal(rv_ref[b, h, j], store.v[b, h, t])
                else:
                    assert not rk_ref[b, h, j].any() and not rv_ref[b, h, j].any()


def _store_case(b_max, h_kv, t_cap, rows, d, dtype, batch):
    """A NaN store, rings, counters and ring rows: slots with a row, one with -1, one whose
    row would land past T_cap (a full region: nothing written)."""
    store = HostStore(torch.full((b_max, h_kv, t_cap, d), float("nan")).to(dtype),
                      torch.full((b_max, h_kv, t_cap, d), float("nan")).to(dtype), "cpu")
    k_ring = torch.randn(b_max, h_kv, rows, d).to(dtype)
    v_ring = torch.randn(b_max, h_kv, rows, d).to(dtype)
    lens = torch.randint(0, t_cap - rows, (b_max, 2), dtype=torch.int32)
    ring_index = torch.randint(0, rows, (batch,), dtype=torch.int32)
    ring_index[0] = -1
    lens[batch - 1, 0] = t_cap - int(ring_index[batch - 1])  # past T_cap
    return store, k_ring, v_ring, lens, ring_index


def _expected_store(store, k_ring, v_ring, lens, ring_index):
    """The store after recall_store, by hand."""
    k, v = store.k.clone(), store.v.clone()
    for b, i in enumerate(ring_index.tolist()):
        t = int(lens[b, 0]) + i
        if i >= 0 and t < k.shape[2]:
            k[b, :, t], v[b, :, t] = k_ring[b, :, i], v_ring[b, :, i]
    return k, v


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b_max,batch,h_kv,t_cap,rows,d", [
    (4, 3, 2, 64, 17, 16),   # a ring with a spare row, a bucket below Bmax
    (3, 3, 3, 48, 16, 24),   # H, D not powers of two
])
def test_store_matches_by_hand(dtype, b_max, batch, h_kv, t_cap, rows, d):
    """The newest ring token of each slot lands at host row lens[b, 0] + ring_index[b]
    (Triton through the interpreter, the op's reference on the CPU); nothing else moves."""
    case = _store_case(b_max, h_kv, t_cap, rows, d, dtype, batch)
    expected = _expected_store(*case)
    assert (expected[0] != case[0].k).sum() > 0  # something is written
    for run in (lambda st, *a: _recall_store_triton(*a, st.k, st.v), recall_store):
        store = HostStore(case[0].k.clone(), case[0].v.clone(), "cpu")
        run(store, *case[1:])
        _assert_same(store.k, expected[0])
        _assert_same(store.v, expected[1])


def test_store_opcheck_and_bad_inputs():
    store, k_ring, v_ring, lens, ring_index = _store_case(3, 2, 48, 17, 16, torch.float32, 2)
    store.k.zero_(), store.v.zero_()
    torch.library.opcheck(torch.ops.minikv.recall_store.default,
                          (k_ring, v_ring, lens, ring_index, store.k, store.v))
    for args, message in [
        ((store, k_ring.half(), v_ring, lens, ring_index), "k_ring: expected dtype"),
        ((store, k_ring[:, :1].contiguous(), v_ring, lens, ring_index), "k_ring: expected shape"),
        ((store, k_ring, v_ring, lens.long(), ring_index), "lens: expected dtype"),
        ((store, k_ring, v_ring, lens, ring_index[:0]), "ring_index: expected 1 <= B"),
        ((store.k, k_ring, v_ring, lens, ring_index), "store: expected a HostStore"),
    ]:
        with pytest.raises(ValueError, match=message):
            recall_store(*args)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h,t_cap,rows,d,start", [
    (2, 64, 5, 16, 7),      # a short chunk inside the plane
    (3, 48, 17, 24, 31),    # H, D not powers of two; the chunk ends at T_cap
])
def test_store_rows_match_by_hand(dtype, h, t_cap, rows, d, start):
    """A chunk's T rows land at host rows start .. start + T - 1 of every head, from strided
    sources with different strides (k a transposed (T, H, D) chunk, as RoPE's output is; v a
    view of a wider (T, 3H, D) buffer, as the qkv projection's); nothing else moves."""
    torch.manual_seed(0)
    host_k, host_v = (torch.randn(h, t_cap, d).to(dtype) for _ in range(2))
    k = torch.randn(rows, h, d).to(dtype).transpose(0, 1)                   # (H, T, D)
    v = torch.randn(rows, 3 * h, d).to(dtype)[:, h: 2 * h].transpose(0, 1)  # (H, T, D)
    assert k.stride() != v.stride()
    want_k, want_v = host_k.clone(), host_v.clone()
    for head in range(h):
        for i in range(rows):
            want_k[head, start + i], want_v[head, start + i] = k[head, i], v[head, i]
    for run in (_recall_store_rows_triton, recall_store_rows_ref):
        got_k, got_v = host_k.clone(), host_v.clone()
        run(k, v, got_k, got_v, start)
        _assert_same(got_k, want_k)
        _assert_same(got_v, want_v)
    recall_store_rows(host_k, host_v, k, v, start)  # the public op (the reference on the CPU)
    _assert_same(host_k, want_k)
    _assert_same(host_v, want_v)


def test_store_rows_opcheck_and_bad_inputs():
    host_k, host_v = torch.zeros(2, 32, 16), torch.zeros(2, 32, 16)
    k, v = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    torch.library.opcheck(torch.ops.minikv.recall_store_rows.default, (k, v, host_k, host_v, 3))
    for args, message in [
        ((host_k, host_v, k, v, 28), r"start: expected 0 <= start <= T_cap - T = 27, got 28"),
        ((host_k, host_v, k, v, -1), "start: expected 0 <= start"),
        ((host_k, host_v, k.half(), v, 0), "k: expected dtype"),
        ((host_k, host_v, k, v[:, :4], 0), "v: expected shape"),
        ((host_k, host_v, k[:1], v[:1], 0), "k: expected shape"),
        ((host_k[:, :, :8], host_v, k, v, 0), "host_k: expected a contiguous tensor"),
        ((host_k, host_v[:1], k, v, 0), "host_v: expected shape"),
    ]:
        with pytest.raises(ValueError, match=message):
            recall_store_rows(*args)


@pytest.mark.parametrize("dtype", DTYPES)
def test_public_op_runs_reference_on_cpu(dtype):
    store, rk, rv = _gather_case(3, 2, 32, 6, 16, dtype)
    idx = _indices(2, 2, 6, 32)
    rk_ref, rv_ref = rk.clone(), rv.clone()
    recall_gather_ref(store.k, store.v, idx, rk_ref, rv_ref)
    recall_gather(store, idx, rk, rv)
    _assert_same(rk, rk_ref)
    _assert_same(rv, rv_ref)


def test_opcheck():
    store, rk, rv = _gather_case(3, 2, 32, 6, 16, torch.float32)
    rk.zero_(), rv.zero_()
    torch.library.opcheck(torch.ops.minikv.recall_gather.default,
                          (store.k, store.v, _indices(2, 2, 6, 32), rk, rv))


def test_compile_fullgraph_no_recompile_on_new_idx():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    store, rk, rv = _gather_case(2, 2, 32, 4, 16, torch.float32)
    idx = _indices(2, 2, 4, 32)

    @torch.compile(backend=counter, fullgraph=True)
    def step(idx):
        recall_gather(store, idx, rk, rv)
        return rk.sum() + rv.sum()

    for _ in range(2):  # new indices and host rows, same shapes: no recompile
        idx.copy_(_indices(2, 2, 4, 32))
        store.k.normal_()
        expected_k, expected_v = rk.clone(), rv.clone()
        recall_gather_ref(store.k, store.v, idx, expected_k, expected_v)
        step(idx)
        _assert_same(rk, expected_k)
        _assert_same(rv, expected_v)
    assert counter.frame_count == 1


# ----------------------------------------------------------------------------------------------
# Input validation
# ----------------------------------------------------------------------------------------------


def _valid_args():
    store, rk, rv = _gather_case(3, 2, 32, 6, 16, torch.float16)
    return [store, _indices(2, 2, 6, 32), rk, rv]


STORE, IDX, RK, RV = range(4)
BAD_INPUTS = [
    ("store type", STORE, lambda s: s.k, "store: expected a HostStore"),
    ("idx dtype", IDX, lambda t: t.long(), "idx: expected dtype"),
    ("idx heads", IDX, lambda t: t[:, :1].contiguous(), "idx: expected shape"),
    ("idx K", IDX, lambda t: t[..., :5].contiguous(), "idx: expected shape"),
    ("idx B > Bmax", IDX, lambda t: torch.zeros(4, 2, 6, dtype=torch.int32), "max_batch_size"),
    ("idx strided", IDX, lambda t: t.transpose(0, 1).contiguous().transpose(0, 1),
     "idx: expected a contiguous"),
    ("recall_k dtype", RK, lambda t: t.float(), "recall_k: expected dtype"),
    ("recall_k shape", RK, lambda t: t[:, :, :, :8].contiguous(), "recall_k: expected shape"),
    ("recall_k view", RK, lambda t: torch.zeros(4, 2, 6, 16).half()[:3],
     "recall_k: expected a whole"),
    ("recall_v K", RV, lambda t: t[:, :, :5].contiguous(), "recall_v: expected shape"),
    ("recall_v dtype", RV, lambda t: t.bfloat16(), "recall_v: expected dtype"),
]


@pytest.mark.parametrize("name,index,make_bad,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_raise(name, index, make_bad, message):
    args = _valid_args()
    args[index] = make_bad(args[index])
    with pytest.raises(ValueError, match=message):
        recall_gather(*args)


def test_idx_on_another_device_raises():
    store, rk, rv = _gather_case(1, 1, 16, 2, 16, torch.float16)
    idx = torch.zeros(1, 1, 2, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="idx: expected device cpu"):
        recall_gather(store, idx, rk, rv)


BAD_STORES = [
    ("rank", lambda k, v: (k[0], v[0], "cpu"), "k: expected 4 dims"),
    ("dtype", lambda k, v: (k.int(), v.int(), "cpu"), "k: expected dtype"),
    ("v shape", lambda k, v: (k, v[:, :, :8].contiguous(), "cpu"), "v: expected shape"),
    ("v dtype", lambda k, v: (k, v.half(), "cpu"), "v: expected dtype"),
    ("strided", lambda k, v: (k.transpose(2, 3), v.transpose(2, 3), "cpu"), "k: expected a contig"),
    ("not on the host", lambda k, v: (k.to("meta"), v.to("meta"), "cpu"), "k: expected device cpu"),
    ("pageable for a GPU", lambda k, v: (k, v, "cuda"), "k: expected pinned host memory"),
    ("device", lambda k, v: (k, v, "meta"), "device: expected a cpu or cuda device"),
]


@pytest.mark.parametrize("name,make_bad,message", BAD_STORES, ids=[b[0] for b in BAD_STORES])
def test_bad_host_store_raises(name, make_bad, message):
    k, v = torch.randn(2, 2, 16, 16), torch.randn(2, 2, 16, 16)
    with pytest.raises(ValueError, match=message):
        HostStore(*make_bad(k, v))


def test_allocate_on_cpu():
    store = HostStore.allocate(max_batch_size=2, num_kv_heads=3, capacity=32, head_dim=16,
                               dtype=torch.bfloat16, device="cpu")
    assert store.k.shape == store.v.shape == (2, 3, 32, 16) and store.k.dtype == torch.bfloat16
    assert store.nbytes == 2 * 2 * 3 * 32 * 16 * 2 and not store.k.any()


# ----------------------------------------------------------------------------------------------
# The attention-with-recall oracle
# ----------------------------------------------------------------------------------------------


def _layer(b_max, h_kv, t_cap, d, ring, bits, g, dtype, n_quant, n_ring):
    """One layer's nine buffers (quantized with ops.quant's references) and the full-precision
    tokens of its region, (Bmax, H_kv, T_cap, D) in ``dtype`` each."""
    k_full = torch.randn(b_max, h_kv, t_cap, d).to(dtype)
    v_full = torch.randn(b_max, h_kv, t_cap, d).to(dtype)
    k_full[..., 1] = 8 * k_full[..., 1] + 5  # an outlier channel: 2-bit keys visibly wrong
    if bits == 16:
        empty = torch.empty(0, dtype=torch.float16)
        quant = [k_full.clone(), empty, empty, v_full.clone(), empty, empty]
    else:
        quant = [*quantize_keys_ref(k_full, bits, g), *quantize_values_ref(v_full, bits, g)]
    lens = torch.zeros(b_max, 2, dtype=torch.int32)
    lens[:len(n_quant), 0] = torch.tensor(n_quant, dtype=torch.int32)
    lens[:len(n_ring), 1] = torch.tensor(n_ring, dtype=torch.int32)
    rings = [torch.randn(b_max, h_kv, ring, d).to(dtype) for _ in range(2)]
    return [*quant, *rings, lens], k_full, v_full


def _recall_ref_one_row(q, bufs, rk, rv, idx, scale, bits):
    """The reference with one query row (q (B, H_q, D)); its lse and mass are left out."""
    b_max, h_kv = bufs[6].shape[:2]
    lse_ref = torch.zeros(b_max, q.shape[1])
    mass = torch.zeros(b_max, 1, h_kv, bufs[3].shape[2] + bufs[6].shape[2], dtype=torch.uint8)
    layer = torch.zeros(1, dtype=torch.int32)
    update = torch.zeros(q.shape[0], dtype=torch.int32)
    out = decode_attention_recall_ref(q[:, None], *bufs, rk, rv, idx, lse_ref, mass, layer,
                                      update, scale, bits, 16)
    return out[:, 0]


ORACLE_CASES = [  # bits, dtype, gqa
    (2, torch.float32, 2),
    (2, torch.bfloat16, 3),
    (4, torch.float16, 1),
    (16, torch.float32, 2),
]


@pytest.mark.parametrize("bits,dtype,gqa", ORACLE_CASES)
def test_recall_of_nothing_is_the_decode_attention_reference(bits, dtype, gqa):
    """Rows that are unused (-1) or name positions outside the slot's region change nothing."""
    b_max, h_kv, t_cap, d, k = 3, 2, 64, 32, 6
    bufs, k_full, v_full = _layer(b_max, h_kv, t_cap, d, 16, bits, 16, dtype, [32, 0], [3, 16])
    lens = bufs[-1]
    q = torch.randn(2, h_kv * gqa, d).to(dtype)
    idx = torch.full((b_max, h_kv, k), -1, dtype=torch.int32)
    idx[0, :, :3] = torch.tensor([32, 40, 63], dtype=torch.int32)  # past lens[0, 0] = 32
    idx[1, :, :2] = torch.tensor([0, 16], dtype=torch.int32)       # slot 1 holds no region
    store = HostStore(k_full, v_full, "cpu")
    rk = torch.zeros(b_max, h_kv, k, d, dtype=dtype)
    rv = torch.zeros_like(rk)
    recall_gather(store, idx[:2], rk, rv)
    out = _recall_ref_one_row(q, bufs, rk, rv, idx, d ** -0.5, bits)
    _assert_same(out, decode_attention_ref(q, *bufs, d ** -0.5, bits, 16))
    assert lens[0, 0] == 32  # the case really has recall rows past the region


@pytest.mark.parametrize("bits,dtype,gqa", ORACLE_CASES)
def test_recall_of_everything_is_full_precision_attention(bits, dtype, gqa):
    """Every quantized position recalled (in shuffled order, with unused rows among them): the
    attention of the uncompressed tokens, i.e. the bits-16 reference over k_full / v_full."""
    b_max, h_kv, t_cap, d = 3, 2, 64, 32
    bufs, k_full, v_full = _layer(b_max, h_kv, t_cap, d, 16, bits, 16, dtype, [64, 16], [3, 1])
    q = torch.randn(2, h_kv * gqa, d).to(dtype)
    k = t_cap + 5
    idx = torch.full((b_max, h_kv, k), -1, dtype=torch.int32)
    for b in range(b_max):
        for h in range(h_kv):
            idx[b, h] = torch.cat([torch.arange(t_cap), torch.full((5,), -1)])[torch.randperm(k)]
    store = HostStore(k_full, v_full, "cpu")
    rk = torch.zeros(b_max, h_kv, k, d, dtype=dtype)
    rv = torch.zeros_like(rk)
    recall_gather(store, idx[:2], rk, rv)
    out = _recall_ref_one_row(q, bufs, rk, rv, idx, d ** -0.5, bits)

    empty = torch.empty(0, dtype=torch.float16)
    full = decode_attention_ref(q, k_full, empty, empty, v_full, empty, empty, *bufs[6:],
                                d ** -0.5, 16, 16)
    _assert_same(out, full)
    # and an fp64 computation of its own, to fp32 rounding (then the output dtype's)
    tol = {torch.float32: 1e-5, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}[dtype]
    for b, (nq, nr) in enumerate(bufs[-1][:2].tolist()):
        kb = torch.cat([k_full[b, :, :nq], bufs[6][b, :, :nr]], 1).double()  # (H_kv, T_b, D)
        vb = torch.cat([v_full[b, :, :nq], bufs[7][b, :, :nr]], 1).double()
        qb = q[b].double().view(h_kv, gqa, d)
        p = torch.softmax(qb @ kb.transpose(1, 2) * d ** -0.5, -1)
        torch.testing.assert_close(out[b].double(), (p @ vb).view(h_kv * gqa, d),
                                   rtol=tol, atol=tol)
    if bits != 16:  # and recall matters: without it, the output is visibly different
        assert (decode_attention_ref(q, *bufs, d ** -0.5, bits, 16).float()
                - out.float()).abs().max() > 1e-2


def test_partial_recall_substitutes_exactly_the_listed_positions():
    b_max, h_kv, t_cap, d, bits = 2, 2, 48, 16, 2
    bufs, k_full, v_full = _layer(b_max, h_kv, t_cap, d, 16, bits, 16, torch.float32, [48, 32],
                                  [2, 5])
    q = torch.randn(2, 4, d)
    idx = torch.tensor([[[5, -1, 47, 0], [17, 18, -1, -1]],
                        [[31, 32, 3, -1], [-1, -1, -1, 9]]], dtype=torch.int32)
    store = HostStore(k_full, v_full, "cpu")
    rk = torch.zeros(b_max, h_kv, 4, d)
    rv = torch.zeros_like(rk)
    recall_gather(store, idx, rk, rv)
    out = _recall_ref_one_row(q, bufs, rk, rv, idx, 0.25, bits)

    # the substitution done by hand on the dequantized region (32 is past slot 1's region)
    from minikv_compile.ops.quant import dequantize_keys_ref, dequantize_values_ref
    k_mix = dequantize_keys_ref(*bufs[0:3], bits, 16, torch.float32)
    v_mix = dequantize_values_ref(*bufs[3:6], bits, 16, torch.float32)
    for b, h, t in [(0, 0, 5), (0, 0, 47), (0, 0, 0), (0, 1, 17), (0, 1, 18), (1, 0, 31),
                    (1, 0, 3), (1, 1, 9)]:
        k_mix[b, h, t] = k_full[b, h, t]
        v_mix[b, h, t] = v_full[b, h, t]
    empty = torch.empty(0, dtype=torch.float16)
    expected = decode_attention_ref(q, k_mix, empty, empty, v_mix, empty, empty, *bufs[6:],
                                    0.25, 16, 16)
    _assert_same(out, expected)


# ----------------------------------------------------------------------------------------------
# The top-k rule
# ----------------------------------------------------------------------------------------------


def test_topk_by_group_mass():
    # 4 query heads, 2 KV heads (groups {0, 1} and {2, 3}), 5 positions
    probs = torch.tensor([[[0.10, 0.50, 0.10, 0.20, 0.10],
                           [0.30, 0.10, 0.10, 0.10, 0.40],     # group 0: .4 .6 .2 .3 .5
                           [0.00, 0.00, 1.00, 0.00, 0.00],
                           [0.25, 0.15, 0.20, 0.10, 0.30]]])   # group 1: .25 .15 1.2 .1 .3
    top3 = recall_topk_ref(probs, 3, num_kv_heads=2)
    assert top3.dtype == torch.int32
    assert top3.tolist() == [[[1, 4, 0], [2, 4, 0]]]
    assert recall_topk_ref(probs, 7, 2).tolist() == [[[1, 4, 0, 3, 2, -1, -1],
                                                       [2, 4, 0, 1, 3, -1, -1]]]
    assert recall_topk_ref(probs, 0, 2).shape == (1, 2, 0)
    # one KV head: the mass of all four query heads
    assert recall_topk_ref(probs, 2, 1).tolist() == [[[2, 4]]]


# ----------------------------------------------------------------------------------------------
# minikv::decode_attention_recall: the reference, the Triton kernels (interpreter), the op
# ----------------------------------------------------------------------------------------------
# Caches come from test_decode_attention's independent builder (its fp64 truth of the dequantized
# region and the ring); the oracle below substitutes the recall rows into that truth.


@dataclasses.dataclass
class RecallCase:
    """A cache (test_decode_attention.Case), the recall arguments in the op's order and q."""

    cache: Case
    q: torch.Tensor               # (B, R, H_q, D)
    recall: List[torch.Tensor]    # recall_k, recall_v, recall_idx, lse_ref, mass, layer, update
    untouched: torch.Tensor       # the mass as made: random codes, which what is not written keeps

    def args(self) -> List[torch.Tensor]:
        """The recall arguments for one call: ``lse_ref`` (which the op overwrites) a copy, so
        that ``recall[3]`` stays the reference the oracle computes the mass with."""
        return self.recall[:3] + [self.recall[3].clone()] + self.recall[4:]

    @property
    def plane(self) -> torch.Tensor:
        """The mass plane of the case's layer, (Bmax, H_kv, T): mass has two layers, the
        case is layer 1 (layer 0 must stay untouched)."""
        return self.recall[4][:, LAYER]


LAYER = 1  # the layer of every recall case (of 2)


def _recall_indices(b_max, h_kv, k, t_cap, lens, batch):
    """(Bmax, H_kv, K) int32: per (slot, head) distinct held positions in shuffled rows, -1
    rows, positions past the slot's region and past T_cap (a third of each, about)."""
    idx = torch.full((b_max, h_kv, k), -1, dtype=torch.int32)
    for b in range(b_max):
        n_quant = int(lens[b, 0]) if b < batch else 0
        for h in range(h_kv):
            n_held = min(n_quant, k - k // 3)
            row = torch.full((k,), -1, dtype=torch.int32)
            row[:n_held] = torch.randperm(n_quant)[:n_held].to(torch.int32)
            if n_held < k:  # past the region (still < T_cap), and past T_cap
                row[n_held] = min(n_quant + 2, t_cap - 1) if n_quant < t_cap else -1
            if n_held + 1 < k:
                row[n_held + 1] = t_cap + 3
            idx[b, h] = row[torch.randperm(k)]
    return idx


def recall_case(batch, b_max, h_kv, gqa, rows, d, capacity, ring, bits, dtype, n_quant, n_ring,
                k, group_size=16, device="cpu", idx=None) -> RecallCase:
    # n_ring: the ring tokens the last row sees; lens counts those of row 0 (the op's contract)
    cache = make_case(batch, b_max, h_kv, d, capacity, ring, bits, group_size, dtype, n_quant,
                      n_ring, outliers=True)
    lens = cache.bufs[-1]
    lens[:batch, 1] -= rows - 1
    if idx is None:
        idx = _recall_indices(b_max, h_kv, k, capacity, lens, batch)
    # the full-precision rows: the dequantized truth plus noise of the quantization's size
    rk = (torch.randn(b_max, h_kv, k, d) * 2).to(dtype)
    rv = torch.randn(b_max, h_kv, k, d).to(dtype)
    q = torch.randn(batch, rows, h_kv * gqa, d).to(dtype)
    mass = torch.randint(0, 256, (b_max, 2, h_kv, capacity + ring), dtype=torch.uint8)
    layer = torch.tensor([LAYER], dtype=torch.int32)
    update = torch.zeros(batch, dtype=torch.int32)
    lse_ref = torch.full((b_max, h_kv * gqa), float("nan"))  # slots >= B: never read
    rc = RecallCase(cache, q, [rk, rv, idx, lse_ref, mass, layer, update], mass.clone())
    # lse_ref: the last row's own log-sum-exp, off by up to a nat per head (a stale one)
    lse_ref[:batch] = (recall_truth(rc, d ** -0.5, torch.float64)[1][:, -1].float()
                       + 2 * torch.rand(batch, h_kv * gqa) - 1)
    cache.bufs = [t.to(device) for t in cache.bufs]
    cache.keys = [t.to(device) for t in cache.keys]
    cache.values = [t.to(device) for t in cache.values]
    return RecallCase(cache, q.to(device), [t.to(device) for t in rc.recall],
                      rc.untouched.to(device))


def recall_truth(rc: RecallCase, scale: float, dtype: torch.dtype):
    """Attention with recall computed from the cache's fp64 truth, every tensor and product in
    ``dtype`` (float64: the oracle; q's dtype: the same-precision baseline of the 2x rule).
    Returns out (B, R, H_q, D), lse (B, R, H_q) and, per slot, mass (H_kv, n_quant + n_ring:
    the quantized positions, then the ring's tokens, which the last row all sees; -inf for the
    ring's tokens unless row 0 sees a full ring, R = its rows less a spare row, and then for
    the speculative rows past R) and the last row's probabilities of the quantized positions
    (H_kv, gqa, n_quant)."""
    q, cache = rc.q, rc.cache
    rk, rv, idx, lse_ref = rc.recall[:4]
    ring_rows, g = cache.bufs[6].shape[2], cache.group_size
    ring = ring_rows if cache.bits == 16 else ring_rows - ring_rows % g
    batch, rows, h_q, d = q.shape
    h_kv = rk.shape[1]
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=dtype, device=q.device)
    masses, probs = [], []
    for b, (n_quant, n_ring) in enumerate(cache.bufs[-1][:batch].tolist()):
        n_ring += rows - 1  # lens counts row 0's ring tokens
        k_reg, v_reg = cache.keys[b][:, :n_quant].clone(), cache.values[b][:, :n_quant].clone()
        for h in range(h_kv):
            for j, t in enumerate(idx[b, h].tolist()):
                if 0 <= t < n_quant:
                    k_reg[h, t], v_reg[h, t] = rk[b, h, j].double(), rv[b, h, j].double()
        for r in range(rows):
            seen = n_ring - (rows - 1 - r)
            kb = torch.cat([k_reg, cache.keys[b][:, n_quant:n_quant + seen]], 1).to(dtype)
            vb = torch.cat([v_reg, cache.values[b][:, n_quant:n_quant + seen]], 1).to(dtype)
            qb = q[b, r].to(dtype).view(h_kv, -1, d)
            s = (qb @ kb.transpose(1, 2)) * scale                          # (H_kv, gqa, T)
            out[b, r] = (torch.softmax(s, -1) @ vb).reshape(h_q, d)
            lse[b, r] = torch.logsumexp(s, -1).reshape(h_q)
        ref = lse_ref[b].to(dtype).view(h_kv, -1, 1)
        mass = torch.exp(s - ref).sum(1)
        held = n_quant + (ring if n_ring - (rows - 1) >= ring else 0)
        mass[:, held:] = float("-inf")
        masses.append(mass)
        probs.append(torch.softmax(s, -1)[..., :n_quant])
    return out, lse, masses, probs


def assert_recall_within_2x(out, lse, rc: RecallCase, scale: float) -> None:
    """The 2x rule (test_decode_attention's) for out and the written lse_ref ``lse`` (the last
    row's); the written mass codes within one code (9%: a rounding across a code's edge) of the
    oracle's, or twice as far as the same-precision mass's codes are, and 0 exactly where the
    oracle is -inf; lse_ref of the slots >= B (NaN), the mass past each slot's tokens, of the
    slots >= B and of the other layer are untouched."""
    oracle = recall_truth(rc, scale, torch.float64)
    base = recall_truth(rc, scale, rc.q.dtype)
    batch = rc.q.shape[0]
    assert lse[batch:].isnan().all()
    lse = lse[:batch]
    oracle, base = ((o[0], o[1][:, -1], *o[2:]) for o in (oracle, base))
    for name, x, o, y, atol in [
        ("out", [out], [oracle[0]], [base[0]], 1e-6),
        ("lse", [lse], [oracle[1]], [base[1]], 1e-5),
    ]:
        err = max((a.double() - b).abs().max().item() for a, b in zip(x, o) if b.numel())
        base_err = max((a.double() - b).abs().max().item() for a, b in zip(y, o) if b.numel())
        assert err <= 2 * base_err + atol, f"{name}: {err:.3g} vs same-precision {base_err:.3g}"
    mass, untouched = rc.plane, rc.untouched[:, LAYER]
    for b, (o, y) in enumerate(zip(oracle[2], base[2])):
        got, want = mass[b, :, :o.shape[1]].int(), mass_codes(o).int()
        assert torch.equal(got == 0, o == float("-inf"))
        if o.numel():
            err = (got - want).abs().max().item()
            base_err = (mass_codes(y).int() - want).abs().max().item()
            assert err <= max(1, 2 * base_err), f"mass codes: {err} vs same-precision {base_err}"
        assert torch.equal(mass[b, :, o.shape[1]:], untouched[b, :, o.shape[1]:])
    assert torch.equal(mass[len(oracle[2]):], untouched[len(oracle[2]):])
    assert torch.equal(rc.recall[4][:, 1 - LAYER], rc.untouched[:, 1 - LAYER])


def run_recall_kernel(rc: RecallCase, scale: float, bufs=None, recall=None, **fields):
    """The recall launch (Triton; the interpreter on the CPU) on ``_plan``'s tiles, ``fields``
    replaced. Returns out and the lse_ref it wrote (into a copy of the case's)."""
    cache, q = rc.cache, rc.q
    capacity = cache.bufs[0].shape[2] if cache.bits == 16 else cache.bufs[3].shape[2]
    h_kv = cache.bufs[6].shape[1]
    plan = _plan(q.device, q.dtype, cache.bits, cache.group_size, q.shape[3], q.shape[0],
                 q.shape[2], h_kv, capacity, sm_count(q.device), rows=q.shape[1], recall=True)
    args = recall or rc.args()
    out = _decode_attention_recall_triton(q, *(bufs or cache.bufs), *args, scale, cache.bits,
                                          cache.group_size, plan._replace(**fields))
    return out, args[3]


def run_recall_op(rc: RecallCase, scale: float, fn=decode_attention_recall):
    """``fn`` (the public op, or the reference) on the case; out and the lse_ref it wrote."""
    args = rc.args()
    out = fn(rc.q, *rc.cache.bufs, *args, scale, rc.cache.bits, rc.cache.group_size)
    return out, args[3]


# (bits, dtype, gqa, rows): every kernel path (half2 fp16/bf16, fp32 dequantization, bits 16),
# rows x heads from 1 to the full N axis of 8
RECALL_KERNEL_CASES = [
    (bits, dtype, gqa, rows)
    for bits in (2, 4) for dtype in DTYPES for gqa, rows in ((1, 1), (3, 2), (4, 2))
] + [(16, torch.float16, 3, 2), (2, torch.bfloat16, 8, 1)]


@pytest.mark.interpret
@pytest.mark.parametrize("bits,dtype,gqa,rows", RECALL_KERNEL_CASES)
def test_triton_recall_matches_oracle(bits, dtype, gqa, rows):
    # 3 splits over 64 tokens in blocks of 16 (some get none); 20 recall rows: 2 recall blocks;
    # a ring of 16 tokens and a spare row, slot 1's full (bits < 16: its tokens are held next)
    rc = recall_case(2, 3, 2, gqa, rows, 16, 64, 17, bits, dtype, [48, 64], [3, 17], k=20)
    lens = rc.cache.bufs[8].clone()
    out, lse = run_recall_kernel(rc, 0.25, num_splits=3, block_n=16)
    assert out.shape == rc.q.shape and out.dtype == dtype
    assert_recall_within_2x(out, lse, rc, 0.25)
    assert torch.equal(rc.cache.bufs[8], lens)  # nothing given back


@pytest.mark.parametrize("impl", [pytest.param("triton", marks=pytest.mark.interpret),
                                  "reference"])
def test_recall_update_gives_back_and_skips_slots(impl):
    """update [1, -1]: slot 0 gives its token back after the attention (lens[0, 1] - 1), slot 1
    (not live) keeps its lse_ref and lens; out, mass and slot 0's lse_ref as with update 0."""
    rc = recall_case(2, 3, 2, 3, 2, 16, 64, 17, 2, torch.float16, [48, 64], [3, 17], k=20)
    lens = rc.cache.bufs[8].clone()
    runs = []
    for update in ([0, 0], [1, -1]):
        rc.cache.bufs[8].copy_(lens)
        rc.recall[4].copy_(rc.untouched)
        rc.recall[6].copy_(torch.tensor(update, dtype=torch.int32))
        if impl == "triton":
            out, lse = run_recall_kernel(rc, 0.25, num_splits=3, block_n=16)
        else:
            out, lse = run_recall_op(rc, 0.25, decode_attention_recall_ref)
        runs.append((out, lse, rc.recall[4].clone(), rc.cache.bufs[8].clone()))
    (out0, lse0, mass0, lens0), (out1, lse1, mass1, lens1) = runs
    assert torch.equal(out0, out1)
    _assert_same(mass0, mass1)
    assert torch.equal(lse1[0], lse0[0]) and not torch.equal(lse0[0], rc.recall[3][0])
    assert torch.equal(lse1[1], rc.recall[3][1])
    assert torch.equal(lens0, lens)
    assert lens1[:, 1].tolist() == [int(lens[0, 1]) - 1, int(lens[1, 1]), int(lens[2, 1])]
    assert torch.equal(lens1[:, 0], lens[:, 0])


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_triton_recall_one_bit_matches_oracle(dtype):
    # groups of 32: lengths and blocks in multiples of 32
    rc = recall_case(2, 3, 2, 3, 2, 32, 64, 32, 1, dtype, [32, 64], [3, 32], k=20,
                     group_size=32)
    out, lse = run_recall_kernel(rc, 0.25, num_splits=2, block_n=32)
    assert_recall_within_2x(out, lse, rc, 0.25)


@pytest.mark.parametrize("bits,dtype,gqa,rows", [(2, torch.float32, 3, 2), (4, torch.float16, 1, 1),
                                                 (16, torch.bfloat16, 2, 2)])
def test_reference_matches_oracle(bits, dtype, gqa, rows):
    rc = recall_case(2, 3, 2, gqa, rows, 16, 64, 16, bits, dtype, [48, 64], [3, 16], k=20)
    out, lse = run_recall_op(rc, 0.25, decode_attention_recall_ref)
    oracle = recall_truth(rc, 0.25, torch.float64)
    tol = {torch.float32: 1e-5, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}[dtype]
    torch.testing.assert_close(out.double(), oracle[0], rtol=tol, atol=tol)
    torch.testing.assert_close(lse[:2].double(), oracle[1][:, -1], rtol=1e-5, atol=1e-5)
    assert lse[2:].isnan().all()
    for b, m in enumerate(oracle[2]):  # codes: the oracle's, but for a rounding at an edge
        got = rc.plane[b, :, :m.shape[1]]
        assert torch.equal(got == 0, m == float("-inf"))
        assert (got.int() - mass_codes(m).int()).abs().max() <= 1


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", [2, 4])
def test_triton_recall_of_everything_is_full_precision_attention(bits, dtype):
    """The issue's exact property, for the kernel: every quantized position recalled with its
    original K/V (every quantized block then has no valid token) gives the attention of the
    uncompressed tokens: within the 2x rule of the fp64 attention over them, and within the
    same bound of the production kernel over a bits-16 cache of them."""
    b_max, h_kv, t_cap, d, k = 3, 2, 64, 16, 69
    idx = torch.full((b_max, h_kv, k), -1, dtype=torch.int32)
    for b in range(b_max):
        for h in range(h_kv):
            idx[b, h] = torch.cat([torch.arange(t_cap), torch.full((5,), -1)])[torch.randperm(k)]
    rc = recall_case(2, b_max, h_kv, 2, 2, d, t_cap, 16, bits, dtype, [64, 32], [3, 16], k=k,
                     idx=idx)
    # the originals: what the recall rows hold (the oracle substitutes them likewise)
    k_full = torch.randn(b_max, h_kv, t_cap, d).to(dtype)
    v_full = torch.randn(b_max, h_kv, t_cap, d).to(dtype)
    store = HostStore(k_full, v_full, "cpu")
    recall_gather(store, idx, rc.recall[0], rc.recall[1])
    out, lse = run_recall_kernel(rc, 0.25, num_splits=3, block_n=16)
    assert_recall_within_2x(out, lse, rc, 0.25)

    full = make_case(2, b_max, h_kv, d, t_cap, 16, 16, 16, dtype, [64, 32], [3, 16])
    full.bufs[0], full.bufs[3] = k_full, v_full
    full.bufs[6:8] = rc.cache.bufs[6:8]
    for r in range(2):  # row r is a one-row query over a ring of lens + r tokens
        full.bufs[8] = rc.cache.bufs[8].clone()
        full.bufs[8][:2, 1] += r
        plain = _decode_attention_triton(rc.q[:, r], *full.bufs, 0.25, 16, 16)
        oracle = recall_truth(rc, 0.25, torch.float64)[0][:, r]
        base = recall_truth(rc, 0.25, dtype)[0][:, r]
        bound = 2 * (base.double() - oracle).abs().max().item() + 1e-6
        assert (out[:, r].double() - plain.double()).abs().max().item() <= 2 * bound


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", [2, 4, 16])
def test_triton_one_row_without_recall_is_decode_attention_bit_for_bit(bits, dtype):
    """R = 1, every recall row unused (-1, past the region, past T_cap): the production
    kernel's result exactly, on the same tiles."""
    rc = recall_case(2, 3, 2, 3, 1, 16, 64, 16, bits, dtype, [48, 64], [3, 16], k=6)
    idx = rc.recall[2]
    idx.fill_(-1)
    idx[0, :, 0], idx[1, :, 1] = 48, 64 + 5  # past slot 0's region, past T_cap
    out, lse = run_recall_kernel(rc, 0.25, num_splits=3, block_n=16)
    plan = _plan(rc.q.device, dtype, bits, 16, 16, 2, 6, 2, 64, 1)._replace(num_splits=3,
                                                                            block_n=16)
    plain = _decode_attention_triton(rc.q[:, 0], *rc.cache.bufs, 0.25, bits, 16, plan)
    assert torch.equal(out[:, 0], plain)


@pytest.mark.interpret
@pytest.mark.parametrize("bits", [2, 4])
def test_triton_recall_never_reads_unused_rows_and_capacity(bits):
    """NaN in every recall row that is not valid and everything past the lengths (the cache
    poisoned as in test_decode_attention): bit-identical results."""
    batch = 2
    rc = recall_case(batch, 4, 2, 2, 2, 16, 64, 32, bits, torch.float16, [16, 48], [5, 32], k=9)
    clean_mass = rc.recall[4].clone()
    clean = run_recall_kernel(rc, 0.25, recall=rc.args()[:4] + [clean_mass, *rc.recall[5:]],
                              num_splits=3, block_n=16)
    rk, rv, idx = (t.clone() for t in rc.recall[:3])
    lens = rc.cache.bufs[-1]
    for b in range(rk.shape[0]):
        for h in range(rk.shape[1]):
            for j, t in enumerate(idx[b, h].tolist()):
                if b >= batch or not 0 <= t < int(lens[b, 0]):
                    rk[b, h, j] = rv[b, h, j] = float("nan")
    dirty_mass = rc.recall[4].clone()
    bufs = poisoned(rc.cache, batch)
    for b in range(batch):  # the second row's ring token, past lens[b, 1], is read
        n_ring = int(lens[b, 1])
        for dirty_ring, ring in zip(bufs[6:8], rc.cache.bufs[6:8]):
            dirty_ring[b, :, n_ring] = ring[b, :, n_ring]
    dirty = run_recall_kernel(rc, 0.25, bufs=bufs,
                              recall=[rk, rv, idx, rc.recall[3].clone(), dirty_mass,
                                      *rc.recall[5:]],
                              num_splits=3, block_n=16)
    assert torch.equal(clean[0], dirty[0])
    _assert_same(clean[1], dirty[1])
    _assert_same(clean_mass, dirty_mass)


@pytest.mark.interpret
def test_triton_recall_default_plan_and_group_sizes():
    # the launcher's own plan (1 split on the CPU), group 32, BLOCK_N from the plan
    rc = recall_case(2, 2, 2, 4, 2, 64, 128, 32, 2, torch.float16, [64, 128], [2, 32], k=11,
                     group_size=32)
    args = rc.args()
    out = _decode_attention_recall_triton(rc.q, *rc.cache.bufs, *args, 0.125, 2, 32)
    assert_recall_within_2x(out, args[3], rc, 0.125)


def test_public_recall_op_runs_reference_on_cpu():
    rc = recall_case(2, 3, 2, 3, 2, 16, 64, 16, 2, torch.bfloat16, [48, 0], [3, 16], k=7)
    expected_mass, expected_lse = rc.recall[4].clone(), rc.recall[3].clone()
    expected = decode_attention_recall_ref(rc.q, *rc.cache.bufs, *rc.recall[:3], expected_lse,
                                           expected_mass, *rc.recall[5:], 0.25, 2, 16)
    out, lse = run_recall_op(rc, 0.25)
    _assert_same(out, expected)
    _assert_same(lse, expected_lse)
    _assert_same(rc.recall[4], expected_mass)


@pytest.mark.parametrize("bits", [2, 16])
def test_public_recall_op_one_row_without_recall_is_decode_attention(bits):
    rc = recall_case(2, 3, 2, 2, 1, 16, 64, 16, bits, torch.float32, [48, 16], [3, 16], k=4)
    rc.recall[2].fill_(-1)
    out, _ = run_recall_op(rc, 0.25)
    _assert_same(out[:, 0], decode_attention(rc.q[:, 0], *rc.cache.bufs, 0.25, bits, 16))


def test_public_recall_op_of_everything_is_full_precision_attention():
    """Through the registered op on the CPU (the reference): exactly the bits-16 attention
    over the original tokens, row by row."""
    b_max, h_kv, t_cap, d = 2, 2, 32, 16
    idx = torch.stack([torch.stack([torch.randperm(t_cap) for _ in range(h_kv)])
                       for _ in range(b_max)]).to(torch.int32)
    rc = recall_case(2, b_max, h_kv, 2, 2, d, t_cap, 16, 2, torch.float32, [32, 16], [4, 9],
                     k=t_cap, idx=idx)
    k_full, v_full = torch.randn(b_max, h_kv, t_cap, d), torch.randn(b_max, h_kv, t_cap, d)
    recall_gather(HostStore(k_full, v_full, "cpu"), idx, rc.recall[0], rc.recall[1])
    out, _ = run_recall_op(rc, 0.25)
    empty = torch.empty(0, dtype=torch.float16)
    for r in range(2):
        lens = rc.cache.bufs[8].clone()
        lens[:2, 1] += r
        full = decode_attention(rc.q[:, r], k_full, empty, empty, v_full, empty, empty,
                                *rc.cache.bufs[6:8], lens, 0.25, 16, 16)
        _assert_same(out[:, r], full)


def test_mass_with_own_lse_is_the_group_probability_and_topk_follows():
    """With lse_ref = the last row's own log-sum-exp, mass is the code of the last row's
    attention probability summed over each KV group (within one code), and recall_topk takes
    the positions of the highest codes, whose probabilities are within two codes (19%) of the
    true top-k's (the rings are not full: their tokens are code 0)."""
    rc = recall_case(2, 2, 2, 3, 2, 16, 64, 16, 2, torch.float32, [64, 48], [3, 16], k=5)
    rc.recall[4].zero_()  # as the cache allocates it
    # the first call leaves its own lse in lse_ref: the second call's reference
    for _ in range(2):
        decode_attention_recall(rc.q, *rc.cache.bufs, *rc.recall, 0.25, 2, 16)
    probs = recall_truth(rc, 0.25, torch.float64)[3]
    for b, p in enumerate(probs):                                    # p: (H_kv, gqa, n_quant)
        n_quant = p.shape[2]
        codes, group = rc.plane[b, :, :n_quant], p.sum(1)             # (H_kv, n_quant)
        assert (codes.int() - mass_codes(group).int()).abs().max() <= 1
        assert (rc.plane[b, :, n_quant:] == 0).all()
        got = recall_topk(rc.plane[b:b + 1], 9)[0].long()             # (H_kv, 9)
        for h in range(2):
            rest = torch.ones(n_quant, dtype=torch.bool)
            rest[got[h]] = False
            assert codes[h, got[h]].min() >= codes[h, rest].max()
            ninth = group[h].topk(9).values[-1]
            assert group[h, got[h]].min() >= ninth * 2 ** (-2 / 8)


def test_recall_topk_ranks_held_positions_of_every_row():
    """Per row (slot, layer, KV head): recall_topk_ref's rule on the codes of the positions
    held (distinct codes: no ties; one query head per KV head); code 0 (not held) never
    chosen, even where nothing else is; -1 padding."""
    batch, layers, h_kv, t_cap = 3, 2, 3, 40
    held = torch.tensor([[32, 17], [0, 3], [40, 9]])                   # (B, L)
    mass = torch.stack([torch.randperm(255)[:t_cap] + 1 for _ in range(batch * layers * h_kv)])
    mass = mass.to(torch.uint8).view(batch, layers, h_kv, t_cap)
    for b in range(batch):
        for l in range(layers):
            mass[b, l, :, held[b, l]:] = 0
    for k in (0, 5, 17, 45):
        got = recall_topk(mass, k)
        assert got.shape == (batch, layers, h_kv, k) and got.dtype == torch.int32
        for b in range(batch):
            for l in range(layers):
                expected = recall_topk_ref(mass[b:b + 1, l, :, :held[b, l]].float(), k, h_kv)[0]
                assert got[b, l].tolist() == expected.tolist(), (k, b, l)


def test_recall_kernels_compile_for_sm90():
    # The store and the gather, for an H100/H200, without a GPU (tests/aot.py).
    compile_for_sm90("""
from minikv_compile.ops import recall as r
build(r._recall_gather_kernel, {"host_k": "*bf16", "host_v": "*bf16", "idx": "*i32",
      "recall_k": "*bf16", "recall_v": "*bf16", "T_cap": "i32", "K": "i32", "D": "i32",
      "ROWS": "i32"},
      dict(BLOCK_R=256, BLOCK_D=128))
build(r._recall_store_kernel, {"k_ring": "*bf16", "v_ring": "*bf16", "lens": "*i32",
      "ring_index": "*i32", "host_k": "*bf16", "host_v": "*bf16", "H": "i32", "T_cap": "i32",
      "D": "i32"}, dict(ROWS=129, BLOCK_H=8, BLOCK_D=128))
build(r._recall_store_rows_kernel, {"k": "*bf16", "v": "*bf16", "host_k": "*bf16",
      "host_v": "*bf16", "start": "i32", "T": "i32", "T_cap": "i32", "D": "i32",
      "stride_kh": "i32", "stride_kt": "i32", "stride_kd": "i32", "stride_vh": "i32",
      "stride_vt": "i32", "stride_vd": "i32"}, dict(BLOCK_T=32, BLOCK_D=128))
""")


def test_recall_attention_kernels_compile_for_sm90():
    # The split launch with recall (two query rows, the 8B shape's GQA 4) and the combine that
    # writes lse_ref and gives tokens back, for an H100/H200, without a GPU (tests/aot.py).
    compile_for_sm90("""
from minikv_compile.ops import attention_decode as a
ptrs = ["q_ptr", "k_ptr", "ks_ptr", "kz_ptr", "v_ptr", "vs_ptr", "vz_ptr", "kr_ptr", "vr_ptr",
        "lens_ptr", "m_ptr", "l_ptr", "acc_ptr", "bm_ptr", "rk_ptr", "rv_ptr", "ridx_ptr",
        "lse_ref_ptr", "mass_ptr", "layer_ptr"]
types = dict(q_ptr="*bf16", k_ptr="*i32", ks_ptr="*fp16", kz_ptr="*fp16", v_ptr="*i32",
             vs_ptr="*fp16", vz_ptr="*fp16", kr_ptr="*bf16", vr_ptr="*bf16", lens_ptr="*i32",
             bm_ptr="*i32", rk_ptr="*bf16", rv_ptr="*bf16", ridx_ptr="*i32", layer_ptr="*i32",
             mass_ptr="*u8")
sig = {p: types.get(p, "*fp32") for p in ptrs}
sig.update({"qk_scale": "fp32", **{n: "i32" for n in (
    "stride_qb", "stride_qr", "stride_qh", "stride_qd", "stride_lb", "stride_lh", "H_KV",
    "T_CAP", "R", "NUM_SPLITS", "K_REC", "T_MASS", "N_LAYERS", "R_FLUSH")}})
build(a._decode_attention_split_kernel, sig,
      dict(GQA=4, BLOCK_H=8, D=128, ROWS=2, RECALL=True, BITS=2, G=16, GV=16, BLOCK_N=64,
           HALF2=True, DOT_DTYPE=tl.bfloat16, INPUT_PRECISION="tf32", BF16_BY_HAND=False,
           INTERPRET=False, PREFETCH=True, PDL=True))
build(a._decode_attention_combine_kernel,
      {"m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "out_ptr": "*bf16",
       "lse_ref_ptr": "*fp32", "lens_ptr": "*i32", "update_ptr": "*i32", "H_Q": "i32",
       "stride_ob": "i32", "stride_oh": "i32", "stride_od": "i32", "stride_lb": "i32",
       "stride_lh": "i32", "S": "i32"},
      dict(D=128, BLOCK_D=32, BLOCK_S=64, BF16_BY_HAND=False, ROWS=2, RECALL=True, PDL=True))
""")


def test_recall_topk_by_blocks():
    """recall_block: the k / block aligned blocks with the most summed mass (the codes' masses)
    over the held positions (a block partly held counts its held part), each as its positions
    in order; positions not held are -1."""
    batch, h_kv, t_cap, block = 2, 2, 38, 4
    held = [33, 6]
    mass = torch.randint(1, 256, (batch, h_kv, t_cap), dtype=torch.uint8)
    for b, n in enumerate(held):
        mass[b, :, n:] = 0
    got = recall_topk(mass, 12, block=block)
    values = mass_values(mass)
    torch.testing.assert_close(values, torch.where(
        mass > 0, 2.0 ** ((mass.double() - 191) / 8), 0.0).float())  # a code's mass
    assert got.shape == (batch, h_kv, 12)
    for b, n in enumerate(held):
        for h in range(h_kv):
            sums = [values[b, h, i:min(i + block, n)].sum().item() for i in range(0, n, block)]
            order = sorted(range(len(sums)), key=lambda i: -sums[i])[:3]
            expected = [i * block + j if i * block + j < n else -1 for i in order
                        for j in range(block)]
            expected += [-1] * (12 - len(expected))
            assert got[b, h].tolist() == expected, (b, h)


BAD_TOPK = [
    ("mass dtype", lambda m: (m.half(), 4), "mass: expected dtype"),
    ("mass 0-d", lambda m: (m[0, 0, 0], 4), "mass: expected at least 1 dim"),
    ("mass strided", lambda m: (m.transpose(1, 2), 4), "mass: expected a contiguous"),
    ("k", lambda m: (m, -1), "k: expected an int >= 0"),
    ("k float", lambda m: (m, 4.0), "k: expected an int >= 0"),
    ("block", lambda m: (m, 4, 0), "block: expected an int >= 1"),
    ("k by block", lambda m: (m, 6, 4), "k: expected a multiple of block=4"),
]


@pytest.mark.parametrize("name,make_bad,message", BAD_TOPK, ids=[b[0] for b in BAD_TOPK])
def test_recall_topk_bad_inputs_raise(name, make_bad, message):
    with pytest.raises(ValueError, match=message):
        recall_topk(*make_bad(torch.randint(0, 256, (2, 2, 16), dtype=torch.uint8)))


def test_recall_opcheck():
    rc = recall_case(2, 3, 2, 2, 2, 16, 32, 16, 2, torch.float32, [16, 32], [2, 16], k=5)
    rc.recall[4].zero_()
    torch.library.opcheck(torch.ops.minikv.decode_attention_recall.default,
                          (rc.q, *rc.cache.bufs, *rc.recall, 0.25, 2, 16))


def test_compiled_recall_step_fullgraph_no_recompile():
    """The step's recall part as the engine will compile it (inductor, fullgraph): attention
    with recall, then the next step's indices from the mass; new lengths, indices and q in
    place: no recompile, the reference's results."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    rc = recall_case(2, 2, 2, 2, 2, 16, 64, 16, 2, torch.float32, [64, 32], [3, 16], k=6)
    rk, rv, idx, lse_ref, mass, layer, update = rc.recall
    mass.zero_()  # as the cache allocates it
    bufs = rc.cache.bufs

    @torch.compile(backend=counter, fullgraph=True)
    def step(q):
        out = decode_attention_recall(q, *bufs, rk, rv, idx, lse_ref, mass, layer, update, 0.25,
                                      2, 16)
        return out * 2.0, recall_topk(mass[:2], 6)

    for given_back in ([0, 0], [1, 0]):  # the second step: slot 0 gives its token back
        update.copy_(torch.tensor(given_back, dtype=torch.int32))
        expected_mass, expected_lse, expected_lens = mass.clone(), lse_ref.clone(), bufs[8].clone()
        out_ref = decode_attention_recall_ref(rc.q, *bufs[:8], expected_lens, rk, rv, idx,
                                              expected_lse, expected_mass, layer, update, 0.25,
                                              2, 16)
        out, nxt = step(rc.q)
        torch.testing.assert_close(out, out_ref * 2)
        torch.testing.assert_close(lse_ref, expected_lse)
        _assert_same(bufs[8], expected_lens)
        _assert_same(mass, expected_mass)
        assert nxt.tolist() == recall_topk(expected_mass[:2], 6).tolist()
        assert (nxt[:, 1 - LAYER] == -1).all()  # the other layer holds nothing
        # the next step: its indices, one more ring token, a new q (lse_ref: this step's)
        idx[:2].copy_(nxt[:, LAYER])
        bufs[8][:2, 1] = torch.tensor([4, 14], dtype=torch.int32)
        rc.q.normal_()
    assert expected_lens[:2, 1].tolist() == [3, 14]  # (the second step's, given back)
    assert counter.frame_count == 1


def _recall_valid_args():
    rc = recall_case(2, 3, 2, 2, 2, 16, 64, 16, 2, torch.float16, [32, 16], [2, 2], k=6)
    return [rc.q, *rc.cache.bufs, *rc.recall, 0.25, 2, 16]


RQ, LENS, RK, RV, RIDX, LSE_REF, MASS, LAYER_ARG, UPDATE = 0, 9, 10, 11, 12, 13, 14, 15, 16
BAD_RECALL = [
    ("q rank", RQ, lambda t: t[:, 0], "q: expected 4 dims"),
    ("rows", RQ, lambda t: t.repeat(1, 2, 1, 1), r"rows \(q.shape\[1\]\)"),
    ("rows x gqa", RQ, lambda t: torch.randn(2, 2, 10, 16).half(),
     "at most 8 query rows per KV head"),
    ("head dim", RQ, lambda t: torch.randn(2, 2, 4, 24).half(), r"head_dim \(q.shape\[3\]\)"),
    ("recall_k dtype", RK, lambda t: t.float(), "recall_k: expected dtype"),
    ("recall_k heads", RK, lambda t: t[:, :1].contiguous(), "recall_k: expected shape"),
    ("recall_k empty", RK, lambda t: t[:, :, :0].contiguous(), "recall_k: expected K >= 1"),
    ("recall_v K", RV, lambda t: t[:, :, :5].contiguous(), "recall_v: expected shape"),
    ("recall_idx dtype", RIDX, lambda t: t.long(), "recall_idx: expected dtype"),
    ("recall_idx K", RIDX, lambda t: t[..., :5].contiguous(), "recall_idx: expected shape"),
    ("recall_idx < B", RIDX, lambda t: t[:1].contiguous(), "recall_idx: expected B=2"),
    ("recall_idx strided", RIDX, lambda t: t.transpose(0, 1).contiguous().transpose(0, 1),
     "recall_idx: expected a contiguous"),
    ("lens view", LENS, lambda t: torch.zeros(4, 2, dtype=torch.int32)[:3],
     "lens: expected a whole"),
    ("lse_ref dtype", LSE_REF, lambda t: t.half(), "lse_ref: expected dtype"),
    ("lse_ref shape", LSE_REF, lambda t: t[:, :2], "lse_ref: expected shape"),
    ("lse_ref B rows", LSE_REF, lambda t: t[:2].contiguous(), "lse_ref: expected shape"),
    ("lse_ref view", LSE_REF, lambda t: torch.zeros(4, 4)[:3], "lse_ref: expected a whole"),
    ("mass dtype", MASS, lambda t: t.bfloat16(), "mass: expected dtype"),
    ("mass one layer", MASS, lambda t: t[:, 0].contiguous(), "mass: expected shape"),
    ("mass short", MASS, lambda t: t[..., :64].contiguous(),
     "mass: expected at least T_cap \\+ ring rows = 80"),
    ("mass view", MASS, lambda t: torch.zeros(4, 2, 2, 80, dtype=torch.uint8)[:3],
     "mass: expected a whole"),
    ("layer dtype", LAYER_ARG, lambda t: t.long(), "layer: expected dtype"),
    ("layer 0-d", LAYER_ARG, lambda t: t[0], "layer: expected shape"),
    ("update dtype", UPDATE, lambda t: t.bool(), "update: expected dtype"),
    ("update slots", UPDATE, lambda t: t[:1], "update: expected shape"),
]


@pytest.mark.parametrize("name,index,make_bad,message", BAD_RECALL,
                         ids=[b[0] for b in BAD_RECALL])
def test_recall_op_bad_inputs_raise(name, index, make_bad, message):
    args = _recall_valid_args()
    args[index] = make_bad(args[index])
    with pytest.raises(ValueError, match=message):
        decode_attention_recall(*args)


def test_recall_refuses_the_gluon_kernel():
    with pytest.raises(ValueError, match="expected a launch without recall"):
        _plan(torch.device("cpu"), torch.float16, 2, 16, 128, 1, 4, 1, 128, 1, FRAGMENTS,
              rows=2, recall=True)


# ----------------------------------------------------------------------------------------------
# GPU: the pinned host store read in place, in a CUDA graph, without host sync
# ----------------------------------------------------------------------------------------------


def _gpu_case(dtype, b_max=4, h_kv=8, t_cap=4096, k=64, d=128):
    store = HostStore.allocate(max_batch_size=b_max, num_kv_heads=h_kv, capacity=t_cap,
                               head_dim=d, dtype=dtype, device="cuda")
    store.k.copy_(torch.randn(store.k.shape).to(dtype))
    store.v.copy_(torch.randn(store.v.shape).to(dtype))
    rk = torch.full((b_max, h_kv, k, d), float("nan"), dtype=dtype, device="cuda")
    idx = torch.full((b_max, h_kv, k), -1, dtype=torch.int32, device="cuda")
    return store, rk, rk.clone(), idx


def _expected(store, idx, rk, rv):
    """The reference on CPU copies (the GPU buffers are left alone)."""
    out_k, out_v = rk.cpu(), rv.cpu()
    recall_gather_ref(store.k, store.v, idx.cpu(), out_k, out_v)
    return out_k, out_v


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_gather_matches_reference(dtype):
    store, rk, rv, idx = _gpu_case(dtype)
    idx[:3].copy_(_indices(3, 8, 64, 4096))
    before_k, before_v = rk.clone(), rv.clone()
    recall_gather(store, idx[:3], rk, rv)
    expected_k, expected_v = _expected(store, idx[:3], before_k, before_v)
    _assert_same(rk.cpu(), expected_k)
    _assert_same(rv.cpu(), expected_v)


# No opcheck on CUDA: opcheck runs the op on clones of its arguments, and a clone of the pinned
# store is pageable memory, which the kernel cannot read (Triton refuses the pointer). The CPU
# opcheck above covers the schema, the fake kernel and the mutations; the compiled capture below
# covers the fake kernel with the CUDA kernel behind it.


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_gpu_cuda_graph_replay_follows_idx_and_host_rows(compiled):
    """Capture once (eager, or the fullgraph-compiled wrapper as the engine's step does),
    under the sync-debug guard; then change idx on the device and the host rows in place:
    every replay matches the reference, and slots >= B stay untouched (NaN)."""
    batch = 3
    store, rk, rv, idx = _gpu_case(torch.bfloat16)

    def gather():
        recall_gather(store, idx[:batch], rk, rv)

    step = torch.compile(gather, fullgraph=True) if compiled else gather
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up: Triton (and the compiler) run outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    rk.fill_(float("nan")), rv.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            step()
    finally:
        torch.cuda.set_sync_debug_mode(previous)

    for _ in range(3):
        torch.cuda.synchronize()  # the GPU no longer reads the host rows we are about to write
        idx[:batch].copy_(_indices(batch, 8, 64, 4096, device="cuda"))
        store.k[:batch].copy_(torch.randn(store.k[:batch].shape).to(store.k.dtype))
        store.v[1].zero_()
        graph.replay()
        torch.cuda.synchronize()
        nan = torch.full_like(rk, float("nan"))
        expected_k, expected_v = _expected(store, idx[:batch], nan, nan.clone())
        _assert_same(rk.cpu(), expected_k)
        _assert_same(rv.cpu(), expected_v)


@pytest.mark.gpu
def test_gpu_store_writes_pinned_rows_in_a_cuda_graph():
    """recall_store from CUDA rings into the pinned store: eager, then captured under the
    sync-debug guard and replayed after the rings, counters and ring rows change in place."""
    case = _store_case(4, 8, 512, 129, 128, torch.bfloat16, 3)
    store = HostStore.allocate(max_batch_size=4, num_kv_heads=8, capacity=512, head_dim=128,
                               dtype=torch.bfloat16, device="cuda")
    store.k.copy_(case[0].k), store.v.copy_(case[0].v)
    k_ring, v_ring, lens, ring_index = (t.cuda() for t in case[1:])
    expected = _expected_store(store, k_ring.cpu(), v_ring.cpu(), lens.cpu(), ring_index.cpu())
    recall_store(store, k_ring, v_ring, lens, ring_index)
    torch.cuda.synchronize()
    _assert_same(store.k, expected[0])
    _assert_same(store.v, expected[1])
    graph = torch.cuda.CUDAGraph()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            recall_store(store, k_ring, v_ring, lens, ring_index)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    for _ in range(2):
        k_ring.normal_(), v_ring.normal_()
        ring_index.copy_(torch.randint(-1, 129, (3,), dtype=torch.int32))
        lens[:, 0].copy_(torch.randint(0, 400, (4,), dtype=torch.int32))
        torch.cuda.synchronize()
        expected = _expected_store(store, k_ring.cpu(), v_ring.cpu(), lens.cpu(), ring_index.cpu())
        graph.replay()
        torch.cuda.synchronize()
        _assert_same(store.k, expected[0])
        _assert_same(store.v, expected[1])


@pytest.mark.gpu
def test_gpu_gather_never_syncs_with_the_host():
    store, rk, rv, idx = _gpu_case(torch.float16, b_max=2, k=16)
    recall_gather(store, idx, rk, rv)  # warm-up (compiles the kernel)
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        recall_gather(store, idx, rk, rv)  # eager
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            recall_gather(store, idx, rk, rv)
        graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------
# GPU: attention with recall at real sizes, and the recall part of a step in a CUDA graph
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("bits,group_size", [(2, 16), (4, 16), (1, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("h_kv,gqa,d", [(8, 4, 128), (3, 3, 64)], ids=["llama3", "smollm2"])
def test_gpu_recall_matches_oracle(h_kv, gqa, d, bits, group_size, dtype):
    # R = 2 (Llama-3-8B: 2 x 4 = 8 rows per KV group); 64 recall rows, partly unused
    # slot 2 holds a single group
    rc = recall_case(4, 5, h_kv, gqa, 2, d, 4096, 128, bits, dtype, [4096, 1024, group_size, 2048],
                     [128, 2, 65, 7], k=64, group_size=group_size, device="cuda")
    out, lse = run_recall_op(rc, d ** -0.5)
    assert_recall_within_2x(out, lse, rc, d ** -0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_one_row_without_recall_is_decode_attention_bit_for_bit(bits, dtype):
    # a size where decode_attention's plan is the Triton kernel too (below the Gluon threshold)
    rc = recall_case(4, 4, 8, 4, 1, 128, 4096, 128, bits, dtype, [4096, 1024, 16, 2048],
                     [128, 2, 65, 7], k=64, device="cuda")
    rc.recall[2].fill_(-1)
    out, _ = run_recall_op(rc, 128 ** -0.5)
    assert torch.equal(out[:, 0], decode_attention(rc.q[:, 0], *rc.cache.bufs, 128 ** -0.5,
                                                   bits, 16))


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [2, 4])
def test_gpu_recall_of_everything_is_full_precision_attention(bits):
    b_max, h_kv, t_cap, d = 2, 8, 1024, 128
    k = t_cap + 16
    idx = torch.stack([torch.stack([torch.cat([torch.randperm(t_cap), torch.full((16,), -1)])
                                    [torch.randperm(k)] for _ in range(h_kv)])
                       for _ in range(b_max)]).to(torch.int32)
    rc = recall_case(2, b_max, h_kv, 4, 2, d, t_cap, 128, bits, torch.bfloat16, [1024, 512],
                     [128, 3], k=k, device="cuda", idx=idx)
    store = HostStore.allocate(max_batch_size=b_max, num_kv_heads=h_kv, capacity=t_cap,
                               head_dim=d, dtype=torch.bfloat16, device="cuda")
    store.k.copy_(torch.randn(store.k.shape).bfloat16())
    store.v.copy_(torch.randn(store.v.shape).bfloat16())
    recall_gather(store, rc.recall[2], rc.recall[0], rc.recall[1])
    out, lse = run_recall_op(rc, d ** -0.5)
    assert_recall_within_2x(out, lse, rc, d ** -0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_gpu_recall_step_replays_in_a_cuda_graph(compiled):
    """The recall part of a decode step (gather this step's rows from the pinned store, attend
    with them, choose the next step's indices and keep the lse), captured once under the
    sync-debug guard (eager, or fullgraph-compiled as the engine's step is); then q, the ring
    lengths and the host rows change in place and each replay equals the same step run
    eagerly from the same state, which carries idx and lse_ref from replay to replay."""
    batch, b_max, h_kv, gqa, d, t_cap, k = 3, 4, 8, 4, 128, 2048, 32
    rc = recall_case(batch, b_max, h_kv, gqa, 2, d, t_cap, 128, 2, torch.bfloat16,
                     [2048, 512, 16], [100, 3, 64], k=k, device="cuda")
    bufs, q = rc.cache.bufs, rc.q
    rk, rv, idx, lse_ref, mass, layer, update = rc.recall
    idx.fill_(-1)
    mass.zero_()  # as the cache allocates it
    store = HostStore.allocate(max_batch_size=b_max, num_kv_heads=h_kv, capacity=t_cap,
                               head_dim=d, dtype=torch.bfloat16, device="cuda")
    store.k.copy_(torch.randn(store.k.shape).bfloat16())
    store.v.copy_(torch.randn(store.v.shape).bfloat16())

    def eager_step():
        recall_gather(store, idx[:batch], rk, rv)
        out = decode_attention_recall(q, *bufs, rk, rv, idx, lse_ref, mass, layer, update,
                                      d ** -0.5, 2, 16)
        idx[:batch].copy_(recall_topk(mass[:batch], k)[:, LAYER])
        return out

    step = torch.compile(eager_step, fullgraph=True) if compiled else eager_step
    update.copy_(torch.tensor([0, 1, -1], dtype=torch.int32))  # advance, give back, not live
    state = [idx, lse_ref, mass, bufs[8]]
    start = [t.clone() for t in state]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up: Triton (and the compiler) run outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    for t, s in zip(state, start):
        t.copy_(s)
    graph = torch.cuda.CUDAGraph()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            out = step()
    finally:
        torch.cuda.set_sync_debug_mode(previous)

    for n_ring in ([100, 2, 64], [101, 3, 65], [102, 4, 66]):
        torch.cuda.synchronize()
        q.copy_(torch.randn_like(q))
        bufs[8][:batch, 1].copy_(torch.tensor(n_ring, dtype=torch.int32))
        store.k[:batch].copy_(torch.randn(store.k[:batch].shape).bfloat16())
        before = [t.clone() for t in state]
        graph.replay()
        torch.cuda.synchronize()
        got = [out.clone()] + [t.clone() for t in state]
        # slot 2 holds 16 positions: the rest of its k are -1
        assert (got[1][:2] >= 0).all() and int((got[1][2] == -1).sum()) == h_kv * (k - 16)
        # slot 1 gave its token back, slot 2 (not live) kept its lse_ref and lens
        assert got[4][:batch, 1].tolist() == [n_ring[0], n_ring[1] - 1, n_ring[2]]
        assert torch.equal(got[2][2], before[1][2]) and not torch.equal(got[2][0], before[1][0])
        for t, s in zip(state, before):
            t.copy_(s)
        expected = [eager_step()] + [t.clone() for t in state]
        for a, b in zip(got, expected):
            _assert_same(a, b)


@pytest.mark.gpu
def test_gpu_store_rows_then_gather_on_the_stream():
    """A chunk's rows stored into slot 1's pinned plane by the kernel, then gathered back by
    the next launch on the same stream, with no synchronization between them: the gather sees
    them (stream order), and nothing else of the store moved."""
    store = HostStore.allocate(max_batch_size=3, num_kv_heads=8, capacity=512, head_dim=128,
                               dtype=torch.bfloat16, device="cuda")
    store.k.normal_(), store.v.normal_()
    before_k, before_v = store.k.clone(), store.v.clone()
    k, v = (torch.randn(100, 8, 128, device="cuda").bfloat16().transpose(0, 1) for _ in range(2))
    recall_store_rows(store.k[1], store.v[1], k, v, 300)
    idx = (300 + torch.arange(100, dtype=torch.int32, device="cuda")).expand(1, 8, 100)
    rk = torch.zeros(1, 8, 100, 128, dtype=torch.bfloat16, device="cuda")
    rv = torch.zeros_like(rk)
    torch.ops.minikv.recall_gather(store.k[1:2], store.v[1:2], idx.contiguous(), rk, rv)
    torch.cuda.synchronize()
    _assert_same(rk[0].cpu(), k.cpu())
    _assert_same(rv[0].cpu(), v.cpu())
    before_k[1, :, 300:400], before_v[1, :, 300:400] = k.cpu(), v.cpu()
    _assert_same(store.k, before_k)
    _assert_same(store.v, before_v)
