"""minikv::recall_gather and the SpeCache references (ops/recall.py, issue 25).

CPU: the Triton gather under TRITON_INTERPRET=1 against the reference (exact: it is a copy), the
registered op (dispatch, opcheck, torch.compile), input validation, the attention-with-recall
oracle against the existing decode-attention reference at both ends (nothing recalled, every
position recalled), and the top-k rule on a hand-made example. GPU: the gather reading a pinned
host store, captured in a CUDA graph and replayed after idx and the host rows change, and the
capture under the sync-debug guard.
"""
from __future__ import annotations

import pytest
import torch

from minikv_compile.ops import HostStore, recall_gather
from minikv_compile.ops.attention_decode import decode_attention_ref
from minikv_compile.ops.quant import quantize_keys_ref, quantize_values_ref
from minikv_compile.ops.recall import (_recall_gather_triton, decode_attention_recall_ref,
                                       recall_gather_ref, recall_topk_ref)

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
    (2, 2, 3, 33, 70, 8),    # K > T_cap: several program columns, repeated rows
])
def test_triton_gather_matches_reference(dtype, b_max, batch, h_kv, t_cap, k, d):
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
    out = decode_attention_recall_ref(q, *bufs, rk, rv, idx, d ** -0.5, bits, 16)
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
    out = decode_attention_recall_ref(q, *bufs, rk, rv, idx, d ** -0.5, bits, 16)

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
    out = decode_attention_recall_ref(q, *bufs, rk, rv, idx, 0.25, bits, 16)

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
