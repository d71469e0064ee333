"""minikv::tail_recall_select and minikv::tail_attention_recall (recall in the tail prefill):
the ranking against an independent fp64 ranking, the attention against an fp64 oracle over the
region with the recalled positions' host rows put in, the public op end to end (rank, gather,
attend), the Triton kernel under the interpreter, the registered ops (opcheck) and bad input.

Caches come from test_decode_attention's builder through test_tail_attention's (the contract's
quantization written out); the host rows are random model-dtype rows, unrelated to the codes,
so that a position's recall visibly changes the output.
"""
from __future__ import annotations

from typing import List, Sequence

import pytest
import torch

from aot import compile_for_sm90
from test_decode_attention import DTYPES, ULP, Case
from test_tail_attention import assert_within_2x, make_tail_case, seen0, tail_fp64

from minikv_compile.ops import tail_attention, tail_attention_recall
from minikv_compile.ops.attention_tail import _tail_attention_triton, _tail_plan
from minikv_compile.ops.attention_tail_recall import (_tail_recall_select_triton,
                                                     tail_recall_select_ref)


def fp64_mass(q: torch.Tensor, case: Case, n_quant: Sequence[int], n_seen0: Sequence[int],
              scale: float) -> List[torch.Tensor]:
    """Per slot ``(H_kv, n_quant)`` float64: the softmax probabilities of every row and query
    head of a KV group over its keys (row r: the first n_seen0 + r tokens), summed per position
    of the quantized region."""
    batch, rows, h_q, d = q.shape
    out = []
    for b in range(batch):
        keys = case.keys[b].cpu()
        h_kv = keys.shape[0]
        mass = torch.zeros(h_kv, n_quant[b], dtype=torch.float64)
        for r in range(rows):
            qr = q[b, r].double().cpu().view(h_kv, h_q // h_kv, d)
            probs = torch.softmax(qr @ keys[:, :n_seen0[b] + r].transpose(1, 2) * scale, dim=-1)
            mass += probs[:, :, :n_quant[b]].sum(1)
        out.append(mass)
    return out


def with_recall(case: Case, idx: torch.Tensor, host_k: torch.Tensor, host_v: torch.Tensor,
                n_quant: Sequence[int]) -> Case:
    """The case's fp64 truth with every named position below n_quant holding its host row."""
    keys, values = [k.clone() for k in case.keys], [v.clone() for v in case.values]
    for b in range(len(keys)):
        for h in range(idx.shape[1]):
            for t in idx[b, h].tolist():
                if 0 <= t < n_quant[b]:
                    keys[b][h, t] = host_k[b, h, t].double()
                    values[b][h, t] = host_v[b, h, t].double()
    return Case(case.bufs, keys, values, case.bits, case.group_size)


def recall_case(shape, bits, dtype, group_size=16, seed=0):
    torch.manual_seed(seed)
    batch, b_max, h_kv, gqa, d, capacity, ring, rows, n_quant, n_ring = shape
    case, bad = make_tail_case(batch, b_max, h_kv, d, capacity, ring, bits, group_size, dtype,
                               rows, n_quant, n_ring)
    q = (2 * torch.randn(batch, rows, h_kv * gqa, d)).to(dtype)  # sharper attention
    host_k = torch.randn(b_max, h_kv, capacity, d).to(dtype)
    host_v = torch.randn(b_max, h_kv, capacity, d).to(dtype)
    return case, bad, q, host_k, host_v, d ** -0.5


# (batch, b_max, h_kv, gqa, d, capacity, ring, rows T, n_quant per slot, n_ring per slot)
T5 = (2, 3, 2, 3, 16, 64, 32, 5, [48, 0], [1, 28])
T9 = (2, 2, 2, 2, 32, 128, 32, 9, [128, 64], [12, 1])
T1 = (2, 2, 2, 3, 16, 64, 32, 1, [64, 16], [9, 1])


@pytest.mark.parametrize("shape", [T5, T9, T1], ids=["T5", "T9", "T1"])
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("k", [1, 8, 200])
def test_select_is_the_top_k_by_fp64_mass(shape, bits, k):
    case, bad, q, _, _, scale = recall_case(shape, bits, torch.float32)
    n_quant, n_ring = shape[8], shape[9]
    idx = tail_recall_select_ref(q, *case.bufs, scale, bits, 16, k)
    assert idx.shape == (shape[0], shape[2], k) and idx.dtype == torch.int32
    masses = fp64_mass(q, case, n_quant, seen0(n_quant, n_ring), scale)
    for b, mass in enumerate(masses):
        n = min(k, n_quant[b])
        assert (idx[b, :, n:] == -1).all()                       # fewer held than k: -1 after
        for h in range(mass.shape[0]):
            got = idx[b, h, :n].long()
            assert len(set(got.tolist())) == n and (got >= 0).all() and (got < n_quant[b]).all()
            # the chosen positions' fp64 masses are the top n, in decreasing order (up to fp32)
            want = torch.topk(mass[h], n).values
            torch.testing.assert_close(mass[h][got], want, rtol=1e-5, atol=1e-9)
    # nothing past the last row's token, and no slot >= batch, is read
    assert torch.equal(tail_recall_select_ref(q, *bad, scale, bits, 16, k), idx)


T20 = (2, 2, 2, 4, 32, 256, 32, 20, [192, 64], [3, 10])  # 80 (row, head) pairs a KV group


@pytest.mark.interpret
@pytest.mark.parametrize("shape,bits,dtype,k,splits", [
    (T5, 2, torch.float32, 8, 1), (T9, 4, torch.float32, 200, 1), (T1, 2, torch.float32, 20, 1),
    (T9, 2, torch.float16, 8, 1), (T5, 4, torch.bfloat16, 8, 1), (T20, 2, torch.float32, 16, 3),
    (T20, 2, torch.float16, 16, 4)],
    ids=["T5-2-fp32-k8", "T9-4-fp32-k200", "T1-2-fp32-k20", "T9-2-fp16-k8", "T5-4-bf16-k8",
         "T20-2-fp32-k16-3splits", "T20-2-fp16-k16-4splits"])
def test_triton_select_is_the_top_k_by_fp64_mass(shape, bits, dtype, k, splits):
    """The CUDA ranking (the tail kernel's partials for each row's log-sum-exp, the mass kernel,
    one top-k over the capacity) under the interpreter: the chosen positions' fp64 masses are
    the top ones (fp32 to its rounding; fp16/bf16 dots to 2%), -1 past the slot's tokens. T20:
    more (row, head) pairs than a block of them, several splits of the region merged, q
    transposed (the tail layer passes ``q.transpose(1, 2)``)."""
    case, bad, q, _, _, scale = recall_case(shape, bits, dtype)
    n_quant, n_ring = shape[8], shape[9]
    if shape is T20:
        q = q.transpose(1, 2).contiguous().transpose(1, 2)                 # (B, T, H_q, D)
        assert not q.is_contiguous()
    batch, _, h_kv, gqa, d, capacity, _, rows = shape[:8]
    plan = _tail_plan(dtype, bits, 16, d, batch, rows, h_kv * gqa, h_kv, capacity, 1)._replace(
        num_splits=splits, block_m=16, block_n=16)
    idx = _tail_recall_select_triton(q, *case.bufs, scale, bits, 16, k, plan)
    assert idx.shape == (shape[0], shape[2], k) and idx.dtype == torch.int32
    rtol = 1e-4 if dtype == torch.float32 else 2e-2
    masses = fp64_mass(q, case, n_quant, seen0(n_quant, n_ring), scale)
    for b, mass in enumerate(masses):
        n = min(k, n_quant[b])
        assert (idx[b, :, n:] == -1).all()
        for h in range(mass.shape[0]):
            got = idx[b, h, :n].long()
            assert len(set(got.tolist())) == n and (got >= 0).all() and (got < n_quant[b]).all()
            torch.testing.assert_close(mass[h][got].sort().values,
                                       torch.topk(mass[h], n).values.sort().values,
                                       rtol=rtol, atol=1e-9)
    assert torch.equal(_tail_recall_select_triton(q, *bad, scale, bits, 16, k, plan), idx)
    with pytest.raises(ValueError, match="bits: expected 1, 2 or 4"):
        _tail_recall_select_triton(q, *case.bufs, scale, 16, 16, k)


# groups over several code words (G > P: 2 words at bits 2 G 32, 2 at bits 1 G 64, 8 at bits 4
# G 64): the key scales reach each word from the group's row
T9G = (2, 2, 2, 2, 32, 128, 64, 9, [128, 64], [12, 1])


@pytest.mark.interpret
@pytest.mark.parametrize("bits,group", [(2, 64), (1, 64), (4, 64), (2, 32)])
def test_triton_select_at_larger_key_groups(bits, group):
    """The CUDA ranking at key groups spanning several code words, against the fp64 masses."""
    case, bad, q, _, _, scale = recall_case(T9G, bits, torch.float32, group_size=group)
    n_quant, n_ring = T9G[8], T9G[9]
    batch, _, h_kv, gqa, d, capacity, _, rows = T9G[:8]
    plan = _tail_plan(torch.float32, bits, group, d, batch, rows, h_kv * gqa, h_kv, capacity,
                      1)._replace(num_splits=2, block_m=16, block_n=group)
    idx = _tail_recall_select_triton(q, *case.bufs, scale, bits, group, 24, plan)
    for b, mass in enumerate(fp64_mass(q, case, n_quant, seen0(n_quant, n_ring), scale)):
        n = min(24, n_quant[b])
        for h in range(mass.shape[0]):
            got = idx[b, h, :n].long()
            assert len(set(got.tolist())) == n and (got >= 0).all() and (got < n_quant[b]).all()
            torch.testing.assert_close(mass[h][got].sort().values,
                                       torch.topk(mass[h], n).values.sort().values,
                                       rtol=1e-4, atol=1e-9)
    assert torch.equal(_tail_recall_select_triton(q, *bad, scale, bits, group, 24, plan), idx)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", [2, 4])
def test_public_op_ranks_gathers_and_attends(dtype, bits):
    case, _, q, host_k, host_v, scale = recall_case(T9, bits, dtype)
    n_quant, n_ring = T9[8], T9[9]
    K = 8
    recall_k = torch.zeros(2, 2, K, 32, dtype=dtype)
    recall_v = torch.zeros_like(recall_k)
    out = tail_attention_recall(q, *case.bufs, host_k[:2], host_v[:2], recall_k, recall_v,
                                scale, bits, 16)
    assert out.dtype == dtype and out.shape == q.shape
    # the oracle's own ranking (fp64, from the 2-bit keys), its host rows, its attention
    masses = fp64_mass(q, case, n_quant, seen0(n_quant, n_ring), scale)
    idx = torch.stack([torch.topk(m, K).indices for m in masses])          # (B, H_kv, K)
    truth = with_recall(case, idx, host_k, host_v, n_quant)
    torch.testing.assert_close(out.double(), tail_fp64(q, truth, seen0(n_quant, n_ring), scale),
                               rtol=ULP[dtype], atol=1e-5)
    # the recall buffers hold the host rows of the chosen positions (in the op's order)
    for b in range(2):
        for h in range(2):
            for got, host in ((recall_k, host_k), (recall_v, host_v)):
                same = (got[b, h][:, None] == host[b, h, idx[b, h]][None]).all(-1)  # (K, K)
                assert same.any(1).all() and same.any(0).all()
    # recall changes the answer: without it, the plain tail attention
    plain = tail_attention(q, *case.bufs, scale, bits, 16)
    assert (plain.float() - out.float()).abs().max() > 1e-2


def _fixed_idx(shape, K: int) -> torch.Tensor:
    """Distinct recall indices per head: the word boundaries 31, 32 and 63 where the slot holds
    them, spread positions, -1 rows and one position past n_quant (ignored)."""
    batch, h_kv, n_quant = shape[0], shape[2], shape[8]
    idx = torch.full((batch, h_kv, K), -1, dtype=torch.int32)
    for b in range(batch):
        for h in range(h_kv):
            edges = [t for t in (31, 32, 63) if t < n_quant[b]]
            rest = [t for t in torch.randperm(n_quant[b]).tolist() if t not in edges]
            pos = (edges + rest)[:K - 2]
            idx[b, h, :len(pos)] = torch.tensor(pos, dtype=torch.int32)
            idx[b, h, -1] = n_quant[b] + 3                              # past the region
    return idx


def _rows(host: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The recall buffer of ``idx (B, H_kv, K)``: host rows, zeros where ``idx`` is outside the
    host's capacity (as the gather gives them)."""
    t = idx.long()
    ok = (t >= 0) & (t < host.shape[2])
    rows = torch.gather(host[:idx.shape[0]], 2, t.clamp(0, host.shape[2] - 1)[..., None]
                        .expand(*t.shape, host.shape[3]))
    return torch.where(ok[..., None], rows, torch.zeros_like(rows))


@pytest.mark.parametrize("bits", [2, 4])
def test_reference_attention_with_given_rows(bits):
    case, bad, q, host_k, host_v, scale = recall_case(T5, bits, torch.float32)
    idx = _fixed_idx(T5, 6)
    rk, rv = _rows(host_k, idx), _rows(host_v, idx)
    out = torch.ops.minikv.tail_attention_recall(q, *case.bufs, rk, rv, idx, scale, bits, 16)
    truth = with_recall(case, idx, host_k, host_v, T5[8])
    torch.testing.assert_close(out.double(), tail_fp64(q, truth, seen0(T5[8], T5[9]), scale),
                               rtol=ULP[torch.float32], atol=1e-5)
    assert torch.equal(torch.ops.minikv.tail_attention_recall(q, *bad, rk, rv, idx, scale, bits,
                                                              16), out)


@pytest.mark.interpret
@pytest.mark.parametrize("shape,K,bits,dtype", [
    (T5, 6, 2, torch.float16), (T5, 6, 2, torch.bfloat16), (T5, 6, 4, torch.float32),
    (T5, 40, 2, torch.float16), (T1, 20, 2, torch.float32)],
    ids=["T5-K6-2-fp16", "T5-K6-2-bf16", "T5-K6-4-fp32", "T5-K40-2-fp16", "T1-K20-2-fp32"])
def test_triton_matches_the_oracle(shape, K, bits, dtype):
    """Three splits sharing bitmap words, K below and above a block of 16 recall rows, one
    query row; a slot holding nothing quantized (T5's second)."""
    case, bad, q, host_k, host_v, scale = recall_case(shape, bits, dtype)
    idx = _fixed_idx(shape, K)
    rk, rv = _rows(host_k, idx), _rows(host_v, idx)
    batch, _, h_kv, gqa, d, capacity, _, rows = shape[:8]
    plan = _tail_plan(dtype, bits, 16, d, batch, rows, h_kv * gqa, h_kv, capacity, 1)._replace(
        num_splits=3, block_m=16, block_n=16)
    out = _tail_attention_triton(q, *case.bufs, scale, bits, 16, plan, recall=(rk, rv, idx))
    truth = with_recall(case, idx, host_k, host_v, shape[8])
    assert_within_2x(out, q, truth, seen0(shape[8], shape[9]), scale)
    assert torch.equal(_tail_attention_triton(q, *bad, scale, bits, 16, plan,
                                              recall=(rk, rv, idx)), out)


@pytest.mark.parametrize("op,args", [
    ("tail_recall_select", "select"), ("tail_attention_recall", "attention")])
def test_opcheck(op, args):
    case, _, q, host_k, host_v, scale = recall_case(T5, 2, torch.float32)
    if args == "select":
        inputs = (q, *case.bufs, scale, 2, 16, 4)
    else:
        idx = _fixed_idx(T5, 4)
        rk = torch.randn(3, 2, 4, 16)
        inputs = (q, *case.bufs, rk, torch.randn_like(rk), idx, scale, 2, 16)
    torch.library.opcheck(getattr(torch.ops.minikv, op), inputs)


def _public_args(**over):
    case, _, q, host_k, host_v, scale = recall_case(T5, 2, torch.float16)
    rk = torch.zeros(3, 2, 4, 16, dtype=torch.float16)
    args = dict(q=q, bufs=case.bufs, host_k=host_k, host_v=host_v, recall_k=rk,
                recall_v=rk.clone(), scale=scale, bits=2)
    args.update(over)
    return args


@pytest.mark.parametrize("over,message", [
    (dict(bits=16), "bits: expected 1, 2 or 4"),
    (dict(host_k=torch.zeros(3, 2, 64, 16)), "host_k: expected dtype"),
    (dict(host_v=torch.zeros(3, 2, 32, 16, dtype=torch.float16)), "host_v: expected shape"),
    (dict(recall_k=torch.zeros(3, 2, 0, 16, dtype=torch.float16),
          recall_v=torch.zeros(3, 2, 0, 16, dtype=torch.float16)), "expected K >= 1"),
    (dict(recall_v=torch.zeros(3, 2, 5, 16, dtype=torch.float16)), "recall_v: expected shape"),
    (dict(host_k=torch.zeros(1, 2, 64, 16, dtype=torch.float16),
          host_v=torch.zeros(1, 2, 64, 16, dtype=torch.float16)), "recall_k: expected shape"),
    (dict(host_k=torch.zeros(1, 2, 64, 16, dtype=torch.float16),
          host_v=torch.zeros(1, 2, 64, 16, dtype=torch.float16),
          recall_k=torch.zeros(1, 2, 4, 16, dtype=torch.float16),
          recall_v=torch.zeros(1, 2, 4, 16, dtype=torch.float16)),
     r"host_k: expected at least B=2 slots \(q.shape\[0\]\), got shape \(1, 2, 64, 16\)"),
], ids=["bits16", "host-dtype", "host-v-shape", "k0", "recall-v-shape", "recall-slots",
        "host-slots"])
def test_bad_inputs_raise(over, message):
    a = _public_args(**over)
    with pytest.raises(ValueError, match=message):
        tail_attention_recall(a["q"], *a["bufs"], a["host_k"], a["host_v"], a["recall_k"],
                              a["recall_v"], a["scale"], a["bits"], 16)


def test_mass_kernel_compiles_for_sm90():
    # The ranking's mass kernel at the 8B shape's "accurate" launch (bf16, bits 2, group 64)
    # and at fp32, for an H100/H200, without a GPU (tests/aot.py says why).
    compile_for_sm90("""
from minikv_compile.ops import attention_tail_recall as r
for dt, tdt, bits, g, block_m, block_n in (("bf16", tl.bfloat16, 2, 64, 64, 64),
                                            ("fp32", tl.float32, 4, 16, 32, 32)):
    sig = {"q_ptr": "*" + dt, "k_ptr": "*i32", "ks_ptr": "*fp16", "kz_ptr": "*fp16",
           "lens_ptr": "*i32", "lse2_ptr": "*fp32", "mass_ptr": "*fp32", "qk_scale": "fp32",
           **{n: "i32" for n in ("stride_qb", "stride_qt", "stride_qh", "stride_qd", "ROWS",
                                 "H_KV", "T_CAP")}}
    build(r._tail_mass_kernel, sig, dict(GQA=4, BLOCK_M=block_m, D=128, BITS=bits, G=g,
                                          BLOCK_N=block_n, DOT_DTYPE=tdt,
                                          INPUT_PRECISION="ieee" if dt == "fp32" else "tf32",
                                          BF16_BY_HAND=False))
""")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_llama_size(dtype):
    """Llama-3.1-8B attention (32 query / 8 KV heads, D 128), a 23-token chunk over up to 4k
    quantized tokens, K = 64, the host rows pinned: the public op (the Triton ranking, the
    gather from host memory, the kernel under RECALL) against the fp64 oracle with the op's own
    choice of rows, and those rows' fp64 masses against the top ones (the ranking's dots in the
    model dtype: 2%, as under the interpreter)."""
    torch.manual_seed(0)
    n_quant, n_ring, K = [4096, 1008], [1, 30], 64
    case, _ = make_tail_case(2, 3, 8, 128, 4096, 129, 2, 16, dtype, 23, n_quant, n_ring,
                             device="cuda", outliers=True)
    q = (2 * torch.randn(2, 23, 32, 128, device="cuda")).to(dtype)
    host_k = torch.randn(3, 8, 4096, 128).to(dtype).pin_memory()
    host_v = torch.randn(3, 8, 4096, 128).to(dtype).pin_memory()
    recall_k = torch.zeros(3, 8, K, 128, dtype=dtype, device="cuda")
    recall_v = torch.zeros_like(recall_k)
    out = tail_attention_recall(q, *case.bufs, host_k, host_v, recall_k, recall_v,
                                128 ** -0.5, 2, 16)
    # the rows the op recalled (its Triton ranking), checked against the fp64 masses below
    idx = torch.ops.minikv.tail_recall_select(q, *case.bufs, 128 ** -0.5, 2, 16, K).cpu()
    truth = with_recall(case, idx, host_k, host_v, n_quant)
    assert_within_2x(out, q, truth, seen0(n_quant, n_ring), 128 ** -0.5)
    for b in range(2):
        for h in range(8):
            got = recall_k[b, h].cpu()
            torch.testing.assert_close(got, host_k[b, h, idx[b, h].long()], rtol=0, atol=0)
    masses = fp64_mass(q, case, n_quant, seen0(n_quant, n_ring), 128 ** -0.5)
    for b, mass in enumerate(masses):
        for h in range(8):
            want = torch.topk(mass[h], K).values.sort().values
            torch.testing.assert_close(mass[h][idx[b, h].long()].sort().values, want,
                                       rtol=2e-2, atol=1e-7)
