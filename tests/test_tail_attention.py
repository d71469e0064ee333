"""minikv::tail_attention: the reference against an independent fp64 oracle and against
decode_attention at T = 1, the registered op (opcheck, input checks), the Triton kernel against
both (CPU: TRITON_INTERPRET=1 on tiny shapes; GPU: real sizes).

Caches come from test_decode_attention's builder (the contract's quantization math and bit
layout written out, not ``ops.quant``); the oracle attends row by row over the dequantized
tokens in float64, with no mask: row r's keys are simply the first ``lens[b, 0] + lens[b, 1] +
r`` tokens. The kernel is held to test_decode_attention's rule: at most twice the error of the
same attention in the model dtype, against fp64.
"""
from __future__ import annotations

from typing import List, Sequence

import pytest
import torch

from test_decode_attention import DTYPES, ULP, Case, make_case, poisoned

from minikv_compile.ops import tail_attention
from minikv_compile.ops.attention_decode import decode_attention_ref
from minikv_compile.ops.attention_tail import tail_attention_ref


# ----------------------------------------------------------------------------------------------
# Cases and the fp64 oracle
# ----------------------------------------------------------------------------------------------


def make_tail_case(batch: int, b_max: int, h_kv: int, d: int, capacity: int, ring: int,
                   bits: int, group_size: int, dtype: torch.dtype, rows: int,
                   n_quant: Sequence[int], n_ring: Sequence[int], device: str = "cpu"):
    """A cache whose slot b < batch holds ``n_quant[b]`` quantized tokens and ``n_ring[b] +
    rows - 1`` ring tokens, the last ``rows`` of them the chunk's; ``lens[b, 1] = n_ring[b]``
    (row 0's count). Returns (case, poisoned buffers): in the second, everything past the last
    row's token and every slot >= batch is NaN or garbage."""
    full = [n + rows - 1 for n in n_ring]
    case = make_case(batch, b_max, h_kv, d, capacity, ring, bits, group_size, dtype, n_quant,
                     full, device=device)
    bad = poisoned(case, batch)
    for lens in (case.bufs[-1], bad[-1]):
        lens[:batch, 1] -= rows - 1
    return case, bad


def tail_fp64(q: torch.Tensor, case: Case, n_seen0: Sequence[int], scale: float) -> torch.Tensor:
    """Softmax attention in float64, row by row: row r of slot b over the first ``n_seen0[b] +
    r`` tokens of ``case.keys[b]``. q (B, T, H_q, D) -> (B, T, H_q, D) float64."""
    batch, rows, h_q, d = q.shape
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(batch):
        h_kv = case.keys[b].shape[0]
        for r in range(rows):
            n = n_seen0[b] + r
            k, v = case.keys[b][:, :n], case.values[b][:, :n]               # (H_kv, n, D)
            qr = q[b, r].double().cpu().view(h_kv, h_q // h_kv, d)
            probs = torch.softmax(qr @ k.cpu().transpose(1, 2) * scale, dim=-1)
            out[b, r] = (probs @ v.cpu()).reshape(h_q, d)
    return out


def tail_same_precision(q: torch.Tensor, case: Case, n_seen0: Sequence[int],
                        scale: float) -> torch.Tensor:
    """The same attention with every tensor and product in q's dtype (the tolerance baseline)."""
    batch, rows, h_q, d = q.shape
    dt = q.dtype
    out = torch.empty(q.shape, dtype=dt, device=q.device)
    for b in range(batch):
        h_kv = case.keys[b].shape[0]
        for r in range(rows):
            n = n_seen0[b] + r
            k, v = case.keys[b][:, :n].to(dt), case.values[b][:, :n].to(dt)
            qr = q[b, r].view(h_kv, h_q // h_kv, d)
            probs = torch.softmax((qr @ k.transpose(1, 2)) * scale, dim=-1)
            out[b, r] = (probs @ v).reshape(h_q, d)
    return out


def seen0(n_quant: Sequence[int], n_ring: Sequence[int]) -> List[int]:
    return [a + b for a, b in zip(n_quant, n_ring)]


def assert_within_2x(out, q, case, n_seen0, scale: float) -> None:
    oracle = tail_fp64(q, case, n_seen0, scale)
    base = tail_same_precision(q, case, n_seen0, scale)
    err = (out.double().cpu() - oracle).abs().max().item()
    base_err = (base.double().cpu() - oracle).abs().max().item()
    assert err <= 2 * base_err + 1e-6, f"kernel error {err:.3g} vs same-precision {base_err:.3g}"


# ----------------------------------------------------------------------------------------------
# CPU: the reference
# ----------------------------------------------------------------------------------------------

# (batch, b_max, h_kv, gqa, d, capacity, ring, rows T, group, n_quant per slot, n_ring per slot)
REF_SHAPES = [
    pytest.param(1, 1, 1, 1, 64, 64, 16, 1, 16, [32], [16], id="T1-mha-d64"),
    pytest.param(2, 3, 2, 3, 64, 64, 32, 3, 16, [48, 0], [1, 30], id="T3-gqa3-d64"),
    pytest.param(3, 4, 2, 4, 128, 128, 32, 17, 32, [64, 128, 0], [16, 1, 3], id="T17-gqa4-g32"),
    pytest.param(2, 2, 1, 4, 128, 128, 64, 17, 64, [128, 64], [1, 48], id="T17-gqa4-g64"),
    pytest.param(2, 4, 3, 3, 64, 128, 64, 3, 64, [0, 128], [62, 5], id="T3-gqa3-g64-d64"),
]


@pytest.mark.parametrize("bits", [2, 4, 16])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch,b_max,h_kv,gqa,d,capacity,ring,rows,group,n_quant,n_ring",
                         REF_SHAPES)
def test_reference_matches_fp64(batch, b_max, h_kv, gqa, d, capacity, ring, rows, group,
                                n_quant, n_ring, bits, dtype):
    case, bad = make_tail_case(batch, b_max, h_kv, d, capacity, ring, bits, group, dtype, rows,
                               n_quant, n_ring)
    q = torch.randn(batch, rows, h_kv * gqa, d).to(dtype)
    scale = d ** -0.5
    out = tail_attention_ref(q, *case.bufs, scale, bits, group)
    assert out.dtype == dtype and out.shape == q.shape
    oracle = tail_fp64(q, case, seen0(n_quant, n_ring), scale)
    torch.testing.assert_close(out.double(), oracle, rtol=ULP[dtype], atol=1e-5)
    # nothing past the last row's token, and no slot >= batch, is read
    assert torch.equal(tail_attention_ref(q, *bad, scale, bits, group), out)


def test_reference_one_bit():
    case, _ = make_tail_case(2, 2, 2, 64, 128, 32, 1, 32, torch.float32, 5, [96, 0], [3, 28])
    q = torch.randn(2, 5, 4, 64)
    out = tail_attention_ref(q, *case.bufs, 0.125, 1, 32)
    torch.testing.assert_close(out.double(), tail_fp64(q, case, [99, 28], 0.125),
                               rtol=ULP[torch.float32], atol=1e-5)


def test_reference_strided_query():
    case, _ = make_tail_case(2, 2, 2, 64, 64, 16, 2, 16, torch.float32, 4, [32, 16], [1, 9])
    q = torch.randn(2, 64, 4, 8).permute(0, 3, 2, 1)                      # (2, 8, 4, 64) strided
    q = q[:, :4]
    out = tail_attention_ref(q, *case.bufs, 0.125, 2, 16)
    torch.testing.assert_close(out.double(), tail_fp64(q, case, [33, 25], 0.125),
                               rtol=ULP[torch.float32], atol=1e-5)


@pytest.mark.parametrize("bits", [2, 4, 16])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_row_is_decode_attention(bits, dtype):
    case, _ = make_tail_case(3, 4, 2, 64, 64, 32, bits, 16, dtype, 1, [48, 0, 64], [1, 32, 7])
    q = torch.randn(3, 1, 8, 64).to(dtype)
    out = tail_attention_ref(q, *case.bufs, 0.125, bits, 16)
    assert torch.equal(out[:, 0], decode_attention_ref(q[:, 0], *case.bufs, 0.125, bits, 16))


def test_rows_are_causal():
    """Changing the chunk's last token's K/V changes the last row only."""
    case, _ = make_tail_case(1, 1, 2, 64, 64, 32, 2, 16, torch.float32, 6, [32], [4])
    q = torch.randn(1, 6, 4, 64)
    before = tail_attention_ref(q, *case.bufs, 0.125, 2, 16)
    k_ring, v_ring = case.bufs[6], case.bufs[7]
    k_ring[0, :, 4 + 6 - 2] += 1.0                                          # the last row's token
    v_ring[0, :, 4 + 6 - 2] -= 3.0
    after = tail_attention_ref(q, *case.bufs, 0.125, 2, 16)
    assert torch.equal(before[:, :5], after[:, :5])
    assert not torch.allclose(before[:, 5], after[:, 5])


# ----------------------------------------------------------------------------------------------
# CPU: the registered op (dispatch, opcheck) and input validation
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 16])
def test_public_op_runs_reference_on_cpu(bits):
    case, _ = make_tail_case(2, 3, 2, 16, 64, 16, bits, 16, torch.bfloat16, 3, [32, 0], [3, 14])
    q = torch.randn(2, 3, 6, 16).bfloat16()
    out = tail_attention(q, *case.bufs, 0.25, bits, 16)
    assert torch.equal(out, tail_attention_ref(q, *case.bufs, 0.25, bits, 16))


@pytest.mark.parametrize("bits", [2, 4, 16])
def test_opcheck(bits):
    case, _ = make_tail_case(2, 3, 2, 16, 32, 16, bits, 16, torch.float32, 3, [16, 32], [1, 14])
    q = torch.randn(2, 3, 4, 16)
    torch.library.opcheck(torch.ops.minikv.tail_attention.default,
                          (q, *case.bufs, 0.25, bits, 16))


def _valid_args(bits=2, rows=3):
    case, _ = make_tail_case(2, 3, 2, 16, 64, 16, bits, 16, torch.float16, rows, [32, 16], [1, 2])
    return [torch.randn(2, rows, 4, 16).half(), *case.bufs, 0.25, bits, 16]


Q, K_CACHE, K_SCALE, V_CACHE, K_RING, LENS, BITS, GROUP = 0, 1, 2, 4, 7, 9, 11, 12
BAD_INPUTS = [
    ("q rank", Q, lambda t: t[:, 0], "q: expected 4 dims"),
    ("q dtype", Q, lambda t: t.double(), "q: expected dtype"),
    ("head dim", Q, lambda t: torch.randn(2, 3, 4, 24).half(), r"head_dim \(q.shape\[3\]\)"),
    ("gqa", Q, lambda t: torch.randn(2, 3, 3, 16).half(), "divisible by KV heads"),
    ("batch > Bmax", Q, lambda t: torch.randn(4, 3, 4, 16).half(), "max_batch_size"),
    ("no rows", Q, lambda t: t[:, :0], r"at least one query row \(q.shape\[1\]\), got shape "
                                       r"\(2, 0, 4, 16\)"),
    ("rows > ring", Q, lambda t: torch.randn(2, 17, 4, 16).half(),
     r"query rows T \(q.shape\[1\]\) <= the ring's length R=16, got shape \(2, 17, 4, 16\)"),
    ("bits", BITS, lambda t: 3, "bits"),
    ("group", GROUP, lambda t: 8, "group_size"),
    ("k_cache shape", K_CACHE, lambda t: t[:, :, :-1], "k_cache: expected shape"),
    ("k_scale dtype", K_SCALE, lambda t: t.float(), "k_scale: expected dtype"),
    ("v_cache shape", V_CACHE, lambda t: t[:, :1].contiguous(), "v_cache: expected shape"),
    ("ring dtype", K_RING, lambda t: t.float(), "k_ring: expected dtype"),
    ("lens dtype", LENS, lambda t: t.long(), "lens: expected dtype"),
]


@pytest.mark.parametrize("name,index,make_bad,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_raise(name, index, make_bad, message):
    args = _valid_args()
    args[index] = make_bad(args[index])
    with pytest.raises(ValueError, match=message):
        tail_attention(*args)


def test_rows_up_to_the_ring_length_are_accepted():
    # a ring of R + 1 rows (spare row): T = R is fine, R + 1 is not
    case, _ = make_tail_case(1, 1, 1, 16, 32, 17, 2, 16, torch.float32, 16, [16], [1])
    q = torch.randn(1, 16, 2, 16)
    out = tail_attention(q, *case.bufs, 0.25, 2, 16)
    torch.testing.assert_close(out.double(), tail_fp64(q, case, [17], 0.25),
                               rtol=ULP[torch.float32], atol=1e-5)
    with pytest.raises(ValueError, match="R=16, got shape"):
        tail_attention(torch.randn(1, 17, 2, 16), *case.bufs, 0.25, 2, 16)
