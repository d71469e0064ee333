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

from aot import compile_for_sm90
from test_decode_attention import DTYPES, ULP, Case, make_case, poisoned

from minikv_compile.ops import decode_attention, tail_attention
from minikv_compile.ops.attention_decode import decode_attention_ref
from minikv_compile.ops.attention_tail import (_tail_attention_triton, _tail_plan, _TailPlan,
                                               tail_attention_ref)


# ----------------------------------------------------------------------------------------------
# Cases and the fp64 oracle
# ----------------------------------------------------------------------------------------------


def make_tail_case(batch: int, b_max: int, h_kv: int, d: int, capacity: int, ring: int,
                   bits: int, group_size: int, dtype: torch.dtype, rows: int,
                   n_quant: Sequence[int], n_ring: Sequence[int], device: str = "cpu",
                   outliers: bool = False):
    """A cache whose slot b < batch holds ``n_quant[b]`` quantized tokens and ``n_ring[b] +
    rows - 1`` ring tokens, the last ``rows`` of them the chunk's; ``lens[b, 1] = n_ring[b]``
    (row 0's count). Returns (case, poisoned buffers): in the second, everything past the last
    row's token and every slot >= batch is NaN or garbage."""
    full = [n + rows - 1 for n in n_ring]
    case = make_case(batch, b_max, h_kv, d, capacity, ring, bits, group_size, dtype, n_quant,
                     full, outliers=outliers, device=device)
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
        keys, values = case.keys[b].cpu(), case.values[b].cpu()
        h_kv = keys.shape[0]
        for r in range(rows):
            n = n_seen0[b] + r
            k, v = keys[:, :n], values[:, :n]                                 # (H_kv, n, D)
            qr = q[b, r].double().cpu().view(h_kv, h_q // h_kv, d)
            probs = torch.softmax(qr @ k.transpose(1, 2) * scale, dim=-1)
            out[b, r] = (probs @ v).reshape(h_q, d)
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


# every shape at bits 2, 4 and 16, each bits in each dtype over the shapes
REF_CASES = [pytest.param(*shape.values, bits, DTYPES[(i + j) % 3],
                          id=f"{shape.id}-{bits}-{DTYPES[(i + j) % 3]}")
             for i, shape in enumerate(REF_SHAPES) for j, bits in enumerate((2, 4, 16))]


@pytest.mark.parametrize("batch,b_max,h_kv,gqa,d,capacity,ring,rows,group,n_quant,n_ring,bits,"
                         "dtype", REF_CASES)
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


# ----------------------------------------------------------------------------------------------
# CPU: the Triton kernel under the interpreter (tiny shapes: it runs as Python)
# ----------------------------------------------------------------------------------------------


def run_triton(q, case: Case, scale: float, bufs=None, **fields):
    """The kernel with ``_tail_plan``'s launch for these shapes, ``fields`` replaced."""
    k_cache, v_cache, k_ring = case.bufs[0], case.bufs[3], case.bufs[6]
    batch, rows, h_q, d = q.shape
    capacity = k_cache.shape[2] if case.bits == 16 else v_cache.shape[2]
    plan = _tail_plan(q.dtype, case.bits, case.group_size, d, batch, rows, h_q, k_ring.shape[1],
                      capacity, 1)._replace(**fields)
    return _tail_attention_triton(q, *(bufs or case.bufs), scale, case.bits, case.group_size,
                                  plan)


# (batch, b_max, h_kv, gqa, d, capacity, ring, rows T, n_quant per slot, n_ring per slot)
T5 = (2, 3, 2, 3, 16, 64, 32, 5, [48, 0], [1, 28])
T1 = (1, 1, 1, 1, 16, 32, 16, 1, [32], [7])
T17 = (2, 2, 1, 4, 32, 64, 32, 17, [64, 16], [16, 1])
# Every (bits, dtype) path on the 5-row chunk; the 1- and 17-row ones on one dtype per bits (the
# interpreter runs every program as Python: ~1-3 s a call).
KERNEL_CASES = (
    [pytest.param(T5, bits, dtype, id=f"T5-gqa3-{bits}-{dtype}") for bits in (2, 4, 16)
     for dtype in DTYPES]
    + [pytest.param(shape, bits, dtype, id=f"{name}-{bits}-{dtype}")
       for name, shape in (("T1-mha", T1), ("T17-gqa4", T17))
       for bits, dtype in ((2, torch.float32), (4, torch.bfloat16), (16, torch.float16))])


def _kernel_case(shape, bits, dtype, group_size=16):
    batch, b_max, h_kv, gqa, d, capacity, ring, rows, n_quant, n_ring = shape
    case, bad = make_tail_case(batch, b_max, h_kv, d, capacity, ring, bits, group_size, dtype,
                               rows, n_quant, n_ring)
    q = torch.randn(batch, rows, h_kv * gqa, d).to(dtype)
    return case, bad, q, seen0(n_quant, n_ring), d ** -0.5


@pytest.mark.interpret
@pytest.mark.parametrize("shape,bits,dtype", KERNEL_CASES)
def test_triton_matches_reference(shape, bits, dtype):
    case, _, q, n_seen0, scale = _kernel_case(shape, bits, dtype)
    # 16-token blocks, 3 splits over at most 64 tokens: some splits get one block, some none;
    # 32-row tiles: the 17 rows x 4 heads of T17 span 3 of them, the last mostly padding.
    out = run_triton(q, case, scale, num_splits=3, block_m=32, block_n=16)
    assert out.dtype == dtype and out.shape == q.shape
    assert_within_2x(out, q, case, n_seen0, scale)


@pytest.mark.interpret
@pytest.mark.parametrize("bits", [2, 16])
def test_triton_unused_capacity_and_slots_are_never_read(bits):
    """NaN scales and ring rows and random codes past every slot's last token (the last row's),
    and everything of the slot >= B: bit-identical results."""
    case, bad, q, _, scale = _kernel_case(T5, bits, torch.float16)
    clean = run_triton(q, case, scale, num_splits=3, block_m=16, block_n=16)
    assert torch.equal(run_triton(q, case, scale, bufs=bad, num_splits=3, block_m=16,
                                  block_n=16), clean)


@pytest.mark.interpret
@pytest.mark.parametrize("bits,group_size", [(1, 32), (1, 64), (2, 32), (2, 64), (4, 64)])
def test_triton_group_sizes(bits, group_size):
    case, _ = make_tail_case(2, 2, 1, 64, 128, 64, bits, group_size, torch.float32, 4,
                             [64, 128], [60, 9])
    q = torch.randn(2, 4, 2, 64)
    out = run_triton(q, case, 0.125, num_splits=2, block_m=16)
    assert_within_2x(out, q, case, [124, 137], 0.125)


@pytest.mark.interpret
def test_triton_default_plan_and_strided_query():
    # the launcher's own plan (one split on the CPU), q with a non-unit last stride
    case, _ = make_tail_case(2, 2, 2, 16, 64, 16, 2, 16, torch.float16, 3, [64, 16], [1, 12])
    q = torch.randn(2, 16, 4, 3).half().permute(0, 3, 2, 1)                # (2, 3, 4, 16)
    out = _tail_attention_triton(q, *case.bufs, 0.25, 2, 16)
    assert_within_2x(out, q, case, [65, 28], 0.25)


@pytest.mark.interpret
@pytest.mark.parametrize("bits", [2, 16])
def test_one_slot_views(bits):
    """The engine's call for one slot: every buffer's rows ``[slot, slot + 1)`` (views; empty
    scales as they are), so that slot 0 of the call is the cache's slot ``slot``."""
    case, _ = make_tail_case(3, 3, 2, 16, 64, 16, bits, 16, torch.float16, 4, [48, 16, 64],
                             [1, 9, 13])
    q = torch.randn(1, 4, 4, 16).half()
    views = [t[2:3] if t.numel() else t for t in case.bufs]
    out = tail_attention(q, *views, 0.25, bits, 16)
    one = Case(case.bufs, case.keys[2:], case.values[2:], bits, 16)
    torch.testing.assert_close(out.double(), tail_fp64(q, one, [64 + 13], 0.25),
                               rtol=ULP[torch.float16], atol=1e-5)
    kernel = run_triton(q, one, 0.25, bufs=views, num_splits=2, block_m=16, block_n=16)
    assert_within_2x(kernel, q, one, [64 + 13], 0.25)


@pytest.mark.interpret
def test_triton_one_row_matches_decode_attention():
    case, _ = make_tail_case(2, 2, 2, 16, 64, 16, 2, 16, torch.float32, 1, [48, 64], [3, 16])
    q = torch.randn(2, 1, 4, 16)
    out = run_triton(q, case, 0.25, num_splits=2, block_m=16, block_n=16)
    torch.testing.assert_close(out[:, 0], decode_attention(q[:, 0], *case.bufs, 0.25, 2, 16),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("field,value,message", [
    ("block_m", 24, "block_m: expected a power of two >= 16, got 24"),
    ("block_n", 8, "block_n: expected a power of two >= 16, got 8"),
    ("block_n", 16, "block_n: expected a multiple of group_size=32, got 16"),
    ("num_splits", 0, r"num_splits: expected 1..128, got 0"),
])
def test_bad_launch_plan_raises(field, value, message):
    case, _ = make_tail_case(1, 1, 1, 32, 64, 32, 2, 32, torch.float32, 2, [32], [1])
    with pytest.raises(ValueError, match=message):
        run_triton(torch.randn(1, 2, 1, 32), case, 0.25, **{field: value})


def test_launch_plan():
    # the 8B shape on an H100 (132 SMs): 128 rows x 64 tokens on 8 warps; 8 heads x 4 row
    # tiles x 8 splits = 256 quantized programs, within 2 per SM
    plan = _tail_plan(torch.bfloat16, 2, 16, 128, 1, 128, 32, 8, 32768, 132)
    assert plan == _TailPlan(num_splits=8, block_m=128, block_n=64, num_warps=8, num_stages=2)
    # more programs than 2 per SM without splitting: one split
    assert _tail_plan(torch.bfloat16, 2, 16, 128, 8, 128, 32, 8, 32768, 132).num_splits == 1
    # a short chunk of a small GQA model: the row tile shrinks to the rows there are
    assert _tail_plan(torch.float16, 2, 16, 64, 1, 3, 9, 3, 4096, 132).block_m == 16
    # fp32 models and groups longer than the default block
    assert _tail_plan(torch.float32, 2, 16, 128, 1, 64, 32, 8, 4096, 132)[1:4] == (32, 16, 8)
    assert _tail_plan(torch.bfloat16, 2, 128, 64, 1, 64, 9, 3, 4096, 132).block_n == 128


def test_tail_kernels_compile_for_sm90():
    # The 8B shape's default launch (bf16, bits 2) with and without recall, and the fp32 and
    # bits-16 paths, for an H100/H200, without a GPU (tests/aot.py says why).
    compile_for_sm90("""
from minikv_compile.ops import attention_tail as a
ptrs = ["q_ptr", "k_ptr", "ks_ptr", "kz_ptr", "v_ptr", "vs_ptr", "vz_ptr", "kr_ptr", "vr_ptr",
        "lens_ptr", "bm_ptr", "rk_ptr", "rv_ptr", "ridx_ptr", "m_ptr", "l_ptr", "acc_ptr"]
for dt, tdt, bits, block_m, block_n, warps, recall in (
        ("bf16", tl.bfloat16, 2, 128, 64, 8, False), ("bf16", tl.bfloat16, 2, 128, 64, 8, True),
        ("fp32", tl.float32, 16, 32, 16, 8, False)):
    codes = "*i32" if bits != 16 else "*" + dt
    types = dict(q_ptr="*" + dt, k_ptr=codes, ks_ptr="*fp16", kz_ptr="*fp16", v_ptr=codes,
                 vs_ptr="*fp16", vz_ptr="*fp16", kr_ptr="*" + dt, vr_ptr="*" + dt,
                 lens_ptr="*i32", bm_ptr="*i32", rk_ptr="*" + dt, rv_ptr="*" + dt,
                 ridx_ptr="*i32")
    sig = {p: types.get(p, "*fp32") for p in ptrs}
    sig.update({"qk_scale": "fp32", **{n: "i32" for n in (
        "stride_qb", "stride_qt", "stride_qh", "stride_qd", "ROWS", "H_KV", "T_CAP", "RING_ROWS",
        "NUM_SPLITS", "K_REC")}})
    triton.compile(ASTSource(fn=a._tail_attention_split_kernel, signature=dict(sig, **{
        k: "constexpr" for k in ("GQA", "BLOCK_M", "D", "BITS", "G", "GV", "BLOCK_N",
                                 "DOT_DTYPE", "INPUT_PRECISION", "BF16_BY_HAND", "RECALL",
                                 "PDL")}),
        constexprs=dict(GQA=4, BLOCK_M=block_m, D=128, BITS=bits, G=16, GV=16, BLOCK_N=block_n,
                        DOT_DTYPE=tdt, INPUT_PRECISION="ieee" if dt == "fp32" else "tf32",
                        BF16_BY_HAND=False, RECALL=recall, PDL=True)),
        target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=2))
""")


# ----------------------------------------------------------------------------------------------
# GPU: real sizes, determinism, CUDA-graph capture and replay
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [2, 4, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_llama_size(bits, dtype):
    # Llama-3.1-8B attention: 32 query / 8 KV heads, D 128; a 64-token chunk over up to 4k
    # quantized tokens (outlier key channels) and a 128-token ring with its spare row.
    ring = 128 if bits == 16 else 129
    n_quant, n_ring = [4096, 0, 1008], [1, 65, 30]
    case, _ = make_tail_case(3, 4, 8, 128, 4096, ring, bits, 16, dtype, 64, n_quant, n_ring,
                             device="cuda", outliers=True)
    q = torch.randn(3, 64, 32, 128, device="cuda").to(dtype)
    out = tail_attention(q, *case.bufs, 128 ** -0.5, bits, 16)
    assert out.dtype == dtype and out.shape == q.shape
    # The error rule alone: the kernel rounds P and the dequantized K/V to the model dtype as a
    # same-precision implementation does, the reference keeps them in fp32, so a fixed few ULPs
    # between the two is no bound (outlier channels: 20 of 786k elements 2x past 4 ULPs on H100).
    assert_within_2x(out, q, case, seen0(n_quant, n_ring), 128 ** -0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [2, 4, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_smollm_gqa(bits, dtype):
    # SmolLM2-135M attention: 9 query / 3 KV heads, D 64; 17 rows, partly filled slots.
    n_quant, n_ring = [2048, 0, 4000 // 16 * 16], [1, 100, 9]
    case, _ = make_tail_case(3, 5, 3, 64, 2048 + 2000, 128, bits, 16, dtype, 17, n_quant,
                             n_ring, device="cuda")
    q = torch.randn(3, 17, 9, 64, device="cuda").to(dtype)
    out = tail_attention(q, *case.bufs, 0.125, bits, 16)
    assert_within_2x(out, q, case, seen0(n_quant, n_ring), 0.125)


@pytest.mark.gpu
@pytest.mark.parametrize("bits,group_size", [(1, 32), (2, 32), (2, 64), (4, 128)])
def test_gpu_group_sizes(bits, group_size):
    g = group_size
    n_quant, n_ring = [4096, 10 * g], [1, 40]
    case, _ = make_tail_case(2, 2, 8, 128, 4096, 128, bits, g, torch.float16, 33, n_quant,
                             n_ring, device="cuda", outliers=True)
    q = torch.randn(2, 33, 32, 128, device="cuda").half()
    out = tail_attention(q, *case.bufs, 128 ** -0.5, bits, g)
    assert_within_2x(out, q, case, seen0(n_quant, n_ring), 128 ** -0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [2, 16])
def test_gpu_unused_capacity_and_slots_are_never_read_and_deterministic(bits):
    case, bad = make_tail_case(3, 5, 8, 128, 4096, 128, bits, 16, torch.bfloat16, 20,
                               [1024, 4096, 0], [3, 100, 1], device="cuda")
    q = torch.randn(3, 20, 32, 128, device="cuda").bfloat16()
    clean = tail_attention(q, *case.bufs, 128 ** -0.5, bits, 16)
    assert torch.equal(clean, tail_attention(q, *bad, 128 ** -0.5, bits, 16))
    for _ in range(3):
        assert torch.equal(clean, tail_attention(q, *case.bufs, 128 ** -0.5, bits, 16))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_one_row_matches_decode_attention(dtype):
    n_quant, n_ring = [4096, 16, 2048], [1, 128, 77]
    case, _ = make_tail_case(3, 3, 8, 128, 4096, 128, 2, 16, dtype, 1, n_quant, n_ring,
                             device="cuda")
    q = torch.randn(3, 1, 32, 128, device="cuda").to(dtype)
    out = tail_attention(q, *case.bufs, 128 ** -0.5, 2, 16)
    assert_within_2x(out, q, case, seen0(n_quant, n_ring), 128 ** -0.5)
    torch.testing.assert_close(out[:, 0], decode_attention(q[:, 0], *case.bufs, 128 ** -0.5),
                               rtol=8 * ULP[dtype], atol=8 * ULP[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [2, 16])
def test_gpu_opcheck(bits):
    case, _ = make_tail_case(2, 3, 2, 64, 256, 32, bits, 16, torch.float16, 5, [128, 256],
                             [1, 20], device="cuda")
    q = torch.randn(2, 5, 8, 64, device="cuda").half()
    torch.library.opcheck(torch.ops.minikv.tail_attention.default,
                          (q, *case.bufs, 0.125, bits, 16))


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_follows_lens():
    """Capture once; change lens on the device (in place) and q; replay matches the reference."""
    case, _ = make_tail_case(4, 6, 8, 128, 4096, 128, 2, 16, torch.bfloat16, 32,
                             [4096, 1024, 0, 16], [1, 97, 2, 64], device="cuda")
    lens = case.bufs[-1]
    q = torch.randn(4, 32, 32, 128, device="cuda").bfloat16()
    scale = 128 ** -0.5

    def step():
        return tail_attention(q, *case.bufs, scale, 2, 16)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up: Triton compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()

    for new_lens in ([[16, 5], [4096, 97], [2048, 1], [0, 40]],
                     [[4096, 1], [0, 1], [16, 60], [1024, 97]]):
        lens[:4].copy_(torch.tensor(new_lens, dtype=torch.int32, device="cuda"))
        q.copy_(torch.randn_like(q))
        graph.replay()
        expected = tail_attention_ref(q, *case.bufs, scale, 2, 16)
        torch.testing.assert_close(out, expected, rtol=4 * ULP[torch.bfloat16],
                                   atol=4 * ULP[torch.bfloat16])
        assert torch.equal(out, step())
