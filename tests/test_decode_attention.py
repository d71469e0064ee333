"""minikv::decode_attention: the reference against an independent fp64 oracle, the Triton kernel
against both (CPU: TRITON_INTERPRET=1 on tiny shapes; GPU: real sizes, CUDA-graph replay).

Caches are built here from scratch with the contract's quantization math and bit layout, not with
``ops.quant``, so the oracle is independent of the code under test.

Tolerance rule for the kernel (flash-attention's): its max abs error against the fp64 oracle is at
most twice the max abs error of the same computation done with PyTorch in the model dtype (q, K, V,
scores, probabilities and output rounded to that dtype), plus 1e-6 for fp32 rounding noise. Every
kernel test runs over fp16, bf16 and fp32 models, which covers each path of the Triton kernel
(bits 16; "half2" for 1/2/4-bit fp16/bf16 models; fp32 dequantization for fp32 models): the "half2"
path rounds differently from the reference (fp16 dots also for bf16 models), so it is held to
this rule, never to bit-exactness.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence

import pytest
import torch

from minikv_compile.ops import decode_attention
from minikv_compile.ops import attention_decode as da_module
from minikv_compile.ops._checks import sm_count
from minikv_compile.ops.attention_decode import (
    FRAGMENTS,
    MAX_SPLITS,
    SPLIT,
    _decode_attention_triton,
    _plan,
    decode_attention_ref,
)

DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# rtol for "reference == oracle rounded to the output dtype" (about one unit in the last place).
ULP = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 1e-5}


# ----------------------------------------------------------------------------------------------
# An independent cache builder and fp64 oracle
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    """Buffers in the op's argument order plus the fp64 truth for the active slots."""

    bufs: List[torch.Tensor]  # k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, rings, lens
    keys: List[torch.Tensor]  # per active slot: (H_kv, T_b, D) float64, quantized region + ring
    values: List[torch.Tensor]
    bits: int
    group_size: int


def _quantize_groups(x: torch.Tensor, dim: int, bits: int):
    """The contract's math; x fp32 with each group's members along ``dim``."""
    mn = x.amin(dim, keepdim=True)
    mx = x.amax(dim, keepdim=True)
    if bits == 1:  # the levels at the midpoints of the range's two halves
        scale_h, zero_h = ((mx - mn) / 2).half(), (mn + (mx - mn) / 4).half()
    else:
        scale_h, zero_h = ((mx - mn) / (2 ** bits - 1)).half(), mn.half()
    s, z = scale_h.float(), zero_h.float()
    codes = torch.floor((x - z) / s + 0.5).clamp(0, 2 ** bits - 1)
    codes = torch.where(s == 0, 0.0, codes)  # constant group: 0/0 above
    return codes.long(), scale_h, zero_h


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def _pack_keys(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., T, D) codes -> (..., T / P, D) int32: token t in row t // P at bits (t % P) * bits."""
    p = 32 // bits
    words = torch.zeros_like(codes[..., ::p, :])
    for j in range(p):
        words |= codes[..., j::p, :] << (j * bits)
    return _to_int32(words)


def _pack_values(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., D) codes -> (..., D / P) int32: channel c in column c // P at bits (c % P) * bits."""
    p = 32 // bits
    words = torch.zeros_like(codes[..., ::p])
    for j in range(p):
        words |= codes[..., j::p] << (j * bits)
    return _to_int32(words)


def make_case(batch: int, b_max: int, h_kv: int, d: int, capacity: int, ring: int, bits: int,
              group_size: int, dtype: torch.dtype, n_quant: Sequence[int], n_ring: Sequence[int],
              outliers: bool = False, device: str = "cpu") -> Case:
    """A static cache of ``b_max`` slots whose first ``batch`` slots hold the given lengths."""
    g = group_size
    k = torch.randn(b_max, h_kv, capacity, d, device=device)
    v = torch.randn(b_max, h_kv, capacity, d, device=device)
    if outliers:
        # Per-channel key outliers, as in real models: a few channels 20x larger, off-center.
        k[..., 1] = 20 * k[..., 1] + 30
        k[..., d // 2] = -15 * k[..., d // 2]
    k_ring = torch.randn(b_max, h_kv, ring, d, device=device).to(dtype)
    v_ring = torch.randn(b_max, h_kv, ring, d, device=device).to(dtype)
    lens = torch.zeros(b_max, 2, dtype=torch.int32, device=device)
    lens[:batch, 0] = torch.tensor(n_quant, dtype=torch.int32)
    lens[:batch, 1] = torch.tensor(n_ring, dtype=torch.int32)

    if bits == 16:
        k_cache, v_cache = k.to(dtype), v.to(dtype)
        k_hat, v_hat = k_cache.double(), v_cache.double()
        empty = torch.empty(0, dtype=torch.float16, device=device)
        k_scale = k_zero = v_scale = v_zero = empty
    else:
        kc, k_scale, k_zero = _quantize_groups(k.view(b_max, h_kv, capacity // g, g, d), 3, bits)
        k_hat = (kc.double() * k_scale.double() + k_zero.double()).view(k.shape)
        k_cache = _pack_keys(kc.view(k.shape), bits)
        k_scale, k_zero = k_scale.squeeze(3), k_zero.squeeze(3)
        gv = min(g, d)  # a value group: g channels, or the whole head
        vc, v_scale, v_zero = _quantize_groups(v.view(b_max, h_kv, capacity, d // gv, gv), 4, bits)
        v_hat = (vc.double() * v_scale.double() + v_zero.double()).view(v.shape)
        v_cache = _pack_values(vc.view(v.shape), bits)
        v_scale, v_zero = v_scale.squeeze(4), v_zero.squeeze(4)

    keys, values = [], []
    for b in range(batch):
        nq, nr = n_quant[b], n_ring[b]
        keys.append(torch.cat([k_hat[b, :, :nq], k_ring[b, :, :nr].double()], dim=1))
        values.append(torch.cat([v_hat[b, :, :nq], v_ring[b, :, :nr].double()], dim=1))
    bufs = [k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring, lens]
    return Case(bufs, keys, values, bits, group_size)


def poisoned(case: Case, batch: int) -> List[torch.Tensor]:
    """Copies of the buffers with everything the op must not read overwritten: NaN scales, zeros
    and ring entries, random codes, and absurd lengths for the slots >= batch."""
    k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring, lens = (
        t.clone() for t in case.bufs)
    bits, g = case.bits, case.group_size
    for b in range(lens.shape[0]):
        nq, nr = lens[b].tolist() if b < batch else (0, 0)
        k_ring[b, :, nr:] = float("nan")
        v_ring[b, :, nr:] = float("nan")
        if bits == 16:
            k_cache[b, :, nq:] = float("nan")
            v_cache[b, :, nq:] = float("nan")
            continue
        rows = k_cache[b, :, nq * bits // 32:]
        rows.copy_(torch.randint_like(rows, -2 ** 31, 2 ** 31 - 1))
        cols = v_cache[b, :, nq:]
        cols.copy_(torch.randint_like(cols, -2 ** 31, 2 ** 31 - 1))
        k_scale[b, :, nq // g:] = float("nan")
        k_zero[b, :, nq // g:] = float("nan")
        v_scale[b, :, nq:] = float("nan")
        v_zero[b, :, nq:] = float("nan")
    lens[batch:] = torch.tensor([10 ** 6, 10 ** 6], dtype=torch.int32)
    return [k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring, lens]


def attention_fp64(q: torch.Tensor, keys, values, scale: float) -> torch.Tensor:
    """Plain softmax attention in float64, slot by slot; q (B, H_q, D) -> (B, H_q, D) float64."""
    out = []
    for b in range(q.shape[0]):
        h_kv = keys[b].shape[0]
        qb = q[b].double().view(h_kv, -1, q.shape[2])                       # (H_kv, gqa, D)
        probs = torch.softmax(qb @ keys[b].transpose(1, 2) * scale, dim=-1)  # (H_kv, gqa, T_b)
        out.append((probs @ values[b]).reshape(q.shape[1:]))
    return torch.stack(out)


def attention_same_precision(q: torch.Tensor, keys, values, scale: float) -> torch.Tensor:
    """The same attention with every tensor and product in q's dtype (the tolerance baseline)."""
    dt = q.dtype
    out = []
    for b in range(q.shape[0]):
        h_kv = keys[b].shape[0]
        qb = q[b].view(h_kv, -1, q.shape[2])
        scores = (qb @ keys[b].to(dt).transpose(1, 2)) * scale
        probs = torch.softmax(scores, dim=-1)
        out.append((probs @ values[b].to(dt)).reshape(q.shape[1:]))
    return torch.stack(out)


def assert_within_2x(out: torch.Tensor, q: torch.Tensor, case: Case, scale: float) -> None:
    oracle = attention_fp64(q, case.keys, case.values, scale)
    base = attention_same_precision(q, case.keys, case.values, scale)
    err = (out.double() - oracle).abs().max().item()
    base_err = (base.double() - oracle).abs().max().item()
    assert err <= 2 * base_err + 1e-6, f"kernel error {err:.3g} vs same-precision {base_err:.3g}"


def launch_plan(q, case: Case, kernel: Optional[str] = None, **fields):
    """``_plan``'s launch for these shapes (on ``kernel`` when given), ``fields`` replaced."""
    k_cache, v_cache, k_ring = case.bufs[0], case.bufs[3], case.bufs[6]
    capacity = k_cache.shape[2] if case.bits == 16 else v_cache.shape[2]
    plan = _plan(q.device, q.dtype, case.bits, case.group_size, q.shape[2], q.shape[0],
                 q.shape[1], k_ring.shape[1], capacity, sm_count(q.device), kernel)
    return plan._replace(**fields)


def run_triton(q, case: Case, scale: float, bufs: Optional[List[torch.Tensor]] = None,
               kernel: Optional[str] = None, **fields):
    return _decode_attention_triton(q, *(bufs or case.bufs), scale, case.bits, case.group_size,
                                    launch_plan(q, case, kernel, **fields))


# ----------------------------------------------------------------------------------------------
# CPU: reference vs fp64, Triton (interpreter) vs reference
# ----------------------------------------------------------------------------------------------

# (batch, b_max, h_kv, gqa, d, capacity, ring, n_quant per slot, n_ring per slot)
SHAPES = [
    pytest.param(1, 1, 1, 1, 64, 64, 16, [32], [16], id="b1-mha-d64"),
    pytest.param(3, 4, 2, 3, 16, 64, 32, [48, 0, 64], [1, 32, 7], id="b3-gqa3-d16"),
    pytest.param(3, 3, 1, 8, 64, 64, 16, [64, 16, 0], [16, 1, 5], id="b3-gqa8-d64"),
]


@pytest.mark.parametrize("bits", [2, 4, 16])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch,b_max,h_kv,gqa,d,capacity,ring,n_quant,n_ring", SHAPES)
def test_reference_matches_fp64(batch, b_max, h_kv, gqa, d, capacity, ring, n_quant, n_ring,
                                bits, dtype):
    case = make_case(batch, b_max, h_kv, d, capacity, ring, bits, 16, dtype, n_quant, n_ring)
    q = torch.randn(batch, h_kv * gqa, d).to(dtype)
    out = decode_attention_ref(q, *case.bufs, d ** -0.5, bits, 16)
    assert out.dtype == dtype and out.shape == q.shape
    oracle = attention_fp64(q, case.keys, case.values, d ** -0.5)
    torch.testing.assert_close(out.double(), oracle, rtol=ULP[dtype], atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_matches_fp64_one_bit(dtype):
    # groups of 32 (1 bit packs 32 tokens a word): lengths are multiples of 32
    case = make_case(3, 4, 2, 64, 128, 32, 1, 32, dtype, [96, 0, 128], [3, 32, 0])
    q = torch.randn(3, 6, 64).to(dtype)
    out = decode_attention_ref(q, *case.bufs, 0.125, 1, 32)
    oracle = attention_fp64(q, case.keys, case.values, 0.125)
    torch.testing.assert_close(out.double(), oracle, rtol=ULP[dtype], atol=1e-5)


@pytest.mark.parametrize("bits", [2, 4, 16])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch,b_max,h_kv,gqa,d,capacity,ring,n_quant,n_ring", SHAPES)
def test_triton_matches_reference(batch, b_max, h_kv, gqa, d, capacity, ring, n_quant, n_ring,
                                  bits, dtype):
    case = make_case(batch, b_max, h_kv, d, capacity, ring, bits, 16, dtype, n_quant, n_ring)
    q = torch.randn(batch, h_kv * gqa, d).to(dtype)
    # 3 splits over 64 tokens in blocks of 16: some splits get one block, some none.
    out = run_triton(q, case, d ** -0.5, num_splits=3, block_n=16)
    assert out.dtype == dtype and out.shape == q.shape
    assert_within_2x(out, q, case, d ** -0.5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("num_splits,block_n", [(1, 16), (1, 64), (2, 32), (5, 16), (64, 16)])
@pytest.mark.parametrize("bits", [2, 4])
def test_triton_split_and_block_configs(num_splits, block_n, bits, dtype):
    # n_quant = 80 is not a multiple of any block above 16: the last block is partial.
    case = make_case(2, 2, 2, 64, 128, 32, bits, 16, dtype, [80, 128], [32, 3])
    q = torch.randn(2, 8, 64).to(dtype)
    out = run_triton(q, case, 0.125, num_splits=num_splits, block_n=block_n)
    assert_within_2x(out, q, case, 0.125)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("group_size", [32, 64])
def test_triton_group_sizes(bits, group_size, dtype):
    case = make_case(2, 2, 1, 64, 128, 64, bits, group_size, dtype, [64, 128], [64, 9])
    q = torch.randn(2, 3, 64).to(dtype)
    out = run_triton(q, case, 0.125, num_splits=2)
    assert_within_2x(out, q, case, 0.125)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("bits", [1, 2, 4])
def test_triton_key_groups_longer_than_the_head(bits, dtype):
    # keys over 128 tokens, values over the head's 64 channels; lengths multiples of 128
    case = make_case(2, 2, 1, 64, 256, 128, bits, 128, dtype, [128, 256], [64, 9])
    assert case.bufs[4].shape[3] == 1 and case.bufs[1].shape[2] == 2  # one value group a token
    q = torch.randn(2, 3, 64).to(dtype)
    out = run_triton(q, case, 0.125, num_splits=2)
    assert_within_2x(out, q, case, 0.125)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits,group_size", [(2, 16), (4, 16), (1, 32)])
def test_triton_outlier_key_channels(bits, group_size, dtype):
    case = make_case(2, 2, 2, 64, 64, 32, bits, group_size, dtype, [64, 32], [16, 2],
                     outliers=True)
    q = torch.randn(2, 4, 64).to(dtype)
    out = run_triton(q, case, 0.125, num_splits=2, block_n=32)
    assert_within_2x(out, q, case, 0.125)


def test_triton_bf16_query_beyond_fp16_range():
    """bf16 q up to ~2^19: the half2 path's fp16 dots must prescale q, not overflow to inf."""
    case = make_case(2, 2, 2, 64, 64, 16, 2, 16, torch.bfloat16, [64, 48], [16, 5])
    q = (torch.randn(2, 4, 64) * 2.0 ** 17).bfloat16()
    out = run_triton(q, case, 2.0 ** -24, num_splits=2, block_n=32)
    assert torch.isfinite(out).all()
    assert_within_2x(out, q, case, 2.0 ** -24)


@pytest.mark.parametrize("bits", [2, 16])
def test_triton_ring_only(bits):
    case = make_case(2, 2, 2, 64, 64, 32, bits, 16, torch.float16, [0, 0], [1, 32])
    q = torch.randn(2, 4, 64).half()
    out = run_triton(q, case, 0.125, num_splits=2)
    assert_within_2x(out, q, case, 0.125)


@pytest.mark.parametrize("bits", [2, 4, 16])
def test_unused_capacity_and_slots_are_never_read(bits):
    """NaN scales/ring entries and random codes past every length, and NaN everywhere in the slots
    >= B (with absurd lengths): kernel and reference give bit-identical results."""
    batch = 2
    case = make_case(batch, 4, 2, 16, 64, 32, bits, 16, torch.float16, [16, 48], [5, 32])
    bad = poisoned(case, batch)
    q = torch.randn(batch, 4, 16).half()
    clean = run_triton(q, case, 0.25, num_splits=3, block_n=16)
    dirty = run_triton(q, case, 0.25, bufs=bad, num_splits=3, block_n=16)
    assert torch.equal(clean, dirty)
    torch.testing.assert_close(decode_attention_ref(q, *bad, 0.25, bits, 16),
                               decode_attention_ref(q, *case.bufs, 0.25, bits, 16),
                               rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_default_launch_config_runs(dtype):
    # The launcher's own plan: BLOCK_N and NUM_SPLITS from ``_plan`` (1 split on CPU).
    case = make_case(1, 2, 2, 64, 128, 32, 2, 16, dtype, [112], [4])
    q = torch.randn(1, 4, 64).to(dtype)
    out = _decode_attention_triton(q, *case.bufs, 0.125, 2, 16)
    assert_within_2x(out, q, case, 0.125)


def test_more_than_8_query_heads_per_kv_head_raises():
    # The dots' N axis holds a KV group's query heads, padded to 8.
    case = make_case(1, 1, 1, 16, 16, 16, 2, 16, torch.float16, [16], [1])
    with pytest.raises(ValueError, match="at most 8 query heads per KV head, got 9"):
        run_triton(torch.randn(1, 9, 16).half(), case, 0.25)


def test_split_count_out_of_range_raises():
    case = make_case(1, 1, 1, 16, 16, 16, 2, 16, torch.float16, [16], [1])
    q = torch.randn(1, 1, 16).half()
    for bad in (0, MAX_SPLITS + 1):
        with pytest.raises(ValueError, match=f"num_splits: expected 1..{MAX_SPLITS}, got {bad}"):
            run_triton(q, case, 0.25, num_splits=bad)


def test_unknown_kernel_raises():
    case = make_case(1, 1, 1, 16, 16, 16, 2, 16, torch.float16, [16], [1])
    with pytest.raises(ValueError, match="kernel"):
        run_triton(torch.randn(1, 1, 16).half(), case, 0.25, kernel="fp8")


# ----------------------------------------------------------------------------------------------
# CPU: the registered op (dispatch, opcheck, torch.compile) and input validation
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 16])
def test_public_op_runs_reference_on_cpu(bits):
    case = make_case(2, 3, 2, 16, 64, 16, bits, 16, torch.bfloat16, [32, 0], [3, 16])
    q = torch.randn(2, 6, 16).bfloat16()
    out = decode_attention(q, *case.bufs, 0.25, bits, 16)
    torch.testing.assert_close(out, decode_attention_ref(q, *case.bufs, 0.25, bits, 16),
                               rtol=0, atol=0)


@pytest.mark.parametrize("bits", [2, 4, 16])
def test_opcheck(bits):
    case = make_case(2, 3, 2, 16, 32, 16, bits, 16, torch.float32, [16, 32], [1, 16])
    q = torch.randn(2, 4, 16)
    torch.library.opcheck(torch.ops.minikv.decode_attention.default,
                          (q, *case.bufs, 0.25, bits, 16))


def test_compile_fullgraph_no_recompile_on_new_lens():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    case = make_case(2, 2, 2, 16, 64, 16, 2, 16, torch.float32, [32, 16], [4, 16])
    q = torch.randn(2, 4, 16)

    @torch.compile(backend=counter, fullgraph=True)
    def step(q, *bufs):
        return decode_attention(q * 2.0, *bufs, 0.25, 2, 16) + 1.0

    out = step(q, *case.bufs)
    torch.testing.assert_close(out, decode_attention_ref(q * 2, *case.bufs, 0.25, 2, 16) + 1)
    case.bufs[-1][:, 1] -= 1  # new lengths, same shapes: no recompile
    out = step(q, *case.bufs)
    torch.testing.assert_close(out, decode_attention_ref(q * 2, *case.bufs, 0.25, 2, 16) + 1)
    assert counter.frame_count == 1


def _valid_args(bits=2):
    case = make_case(2, 3, 2, 16, 64, 16, bits, 16, torch.float16, [32, 16], [1, 2])
    return [torch.randn(2, 4, 16).half(), *case.bufs, 0.25, bits, 16]


# (case, argument index in the op's order, how to break that argument, expected message)
Q, K_CACHE, K_SCALE, K_ZERO, V_CACHE, V_SCALE, K_RING, V_RING, LENS, BITS, GROUP = (
    0, 1, 2, 3, 4, 5, 7, 8, 9, 11, 12)
BAD_INPUTS = [
    ("q rank", Q, lambda t: t[0], "q: expected 3 dims"),
    ("q dtype", Q, lambda t: t.double(), "q: expected dtype"),
    ("head dim", Q, lambda t: torch.randn(2, 4, 24).half(), "head_dim"),
    ("gqa", Q, lambda t: torch.randn(2, 3, 16).half(), "divisible by KV heads"),
    ("batch > Bmax", Q, lambda t: torch.randn(4, 4, 16).half(), "max_batch_size"),
    ("bits", BITS, lambda t: 3, "bits"),
    ("group", GROUP, lambda t: 8, "group_size"),
    ("k_cache shape", K_CACHE, lambda t: t[:, :, :-1], "k_cache: expected shape"),
    ("k_cache dtype", K_CACHE, lambda t: t.float(), "k_cache: expected dtype"),
    ("k_scale shape", K_SCALE, lambda t: t[:, :1].contiguous(), "k_scale: expected shape"),
    ("k_zero dtype", K_ZERO, lambda t: t.float(), "k_zero: expected dtype"),
    ("v_cache shape", V_CACHE, lambda t: t[:, :1].contiguous(), "v_cache: expected shape"),
    ("v_scale shape", V_SCALE, lambda t: t[:, :, :-1].contiguous(), "v_scale: expected shape"),
    ("ring dtype", K_RING, lambda t: t.float(), "k_ring: expected dtype"),
    ("v_ring shape", V_RING, lambda t: t[:, :, :8].contiguous(), "v_ring: expected shape"),
    ("lens dtype", LENS, lambda t: t.long(), "lens: expected dtype"),
    ("lens shape", LENS, lambda t: t[:2].contiguous(), "lens: expected shape"),
    ("not contiguous", K_SCALE, lambda t: t.transpose(2, 3).contiguous().transpose(2, 3),
     "k_scale: expected a contiguous"),
]


@pytest.mark.parametrize("name,index,make_bad,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_raise(name, index, make_bad, message):
    args = _valid_args()
    args[index] = make_bad(args[index])
    with pytest.raises(ValueError, match=message):
        decode_attention(*args)


@pytest.mark.parametrize("bits,group_size,d,dtype", [
    (4, 16, 128, torch.float16),
    (2, 32, 128, torch.float16),
    (2, 16, 64, torch.float16),
    (2, 16, 128, torch.float32),
])
def test_fragments_refuses_what_it_does_not_cover(bits, group_size, d, dtype):
    # (and every CPU call: the Gluon kernel needs a GPU)
    case = make_case(1, 1, 1, d, 128, 32, bits, group_size, dtype, [128], [1])
    q = torch.randn(1, 4, d).to(dtype)
    with pytest.raises(ValueError, match="kernel='fragments': expected a CUDA"):
        run_triton(q, case, 0.125, kernel=FRAGMENTS)


@pytest.mark.parametrize("batch,capacity,pays_off,splits", [
    # the cases measured on the H200 (132 SMs; perf/NOTES.md), 8 KV heads
    (1, 16384, False, 64), (8, 4096, False, 16), (8, 16384, True, 16), (1, 131072, True, 128),
    (32, 16384, True, 13), (64, 16384, True, 7),
])
def test_fragments_launch_heuristics(batch, capacity, pays_off, splits):
    assert da_module._fragments_pay_off(batch, 8, capacity, 132) == pays_off
    assert da_module._fragments_num_splits(batch, 8, capacity, 132) == splits
    blocks_per_split = -(-(capacity // 128) // splits)
    assert (splits - 1) * blocks_per_split < capacity // 128  # a full plane leaves no split empty


def test_bits16_requires_empty_scales():
    args = _valid_args(bits=16)
    args[2] = torch.zeros(1, dtype=torch.float16)
    with pytest.raises(ValueError, match="k_scale: expected an empty tensor"):
        decode_attention(*args)


# ----------------------------------------------------------------------------------------------
# GPU: real sizes, determinism, CUDA-graph capture and replay
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [2, 4, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_llama_size(bits, dtype):
    # Llama-3-8B attention: 32 query / 8 KV heads, D = 128; 16k quantized tokens + a 128 ring.
    batch, n_q = 8, 16384
    n_quant = [n_q, n_q - 1024, 0, 4096, n_q, 16, 8192, n_q]
    n_ring = [128, 1, 64, 128, 17, 128, 100, 5]
    case = make_case(batch, batch, 8, 128, n_q, 128, bits, 16, dtype, n_quant, n_ring,
                     outliers=True, device="cuda")
    q = torch.randn(batch, 32, 128, device="cuda").to(dtype)
    # the Triton kernel, at a size where bits 2 get the Gluon one by default
    out = run_triton(q, case, 128 ** -0.5, kernel=SPLIT)
    assert_within_2x(out, q, case, 128 ** -0.5)
    ref = decode_attention_ref(q, *case.bufs, 128 ** -0.5, bits, 16)
    torch.testing.assert_close(out, ref, rtol=4 * ULP[dtype], atol=4 * ULP[dtype])
    # the public op runs the launcher's own plan
    assert torch.equal(decode_attention(q, *case.bufs, 128 ** -0.5, bits, 16),
                       run_triton(q, case, 128 ** -0.5))


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [2, 4, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_smollm_gqa(bits, dtype):
    # SmolLM2-135M attention: 9 query / 3 KV heads, D = 64; capacity 8k, partly filled.
    case = make_case(5, 6, 3, 64, 8192, 128, bits, 16, dtype,
                     [8192, 0, 4000 // 16 * 16, 16, 2048], [1, 128, 60, 128, 7], device="cuda")
    q = torch.randn(5, 9, 64, device="cuda").to(dtype)
    out = run_triton(q, case, 0.125)
    assert_within_2x(out, q, case, 0.125)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_gpu_group_sizes(bits, group_size, dtype):
    # G = 128 makes the key block 128 tokens (8 warps); lengths are multiples of G.
    g = group_size
    case = make_case(3, 3, 8, 128, 4096, 128, bits, g, dtype, [4096, 0, 10 * g],
                     [128, 1, 5], outliers=True, device="cuda")
    q = torch.randn(3, 32, 128, device="cuda").to(dtype)
    out = run_triton(q, case, 128 ** -0.5)
    assert_within_2x(out, q, case, 128 ** -0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits", [1, 2])
def test_gpu_key_groups_longer_than_the_head(bits, dtype):
    # SmolLM2's head of 64 channels with keys over 128 tokens: values over the whole head
    case = make_case(3, 3, 3, 64, 4096, 128, bits, 128, dtype, [4096, 0, 1280], [128, 1, 5],
                     outliers=True, device="cuda")
    q = torch.randn(3, 9, 64, device="cuda").to(dtype)
    out = run_triton(q, case, 64 ** -0.5)
    assert_within_2x(out, q, case, 64 ** -0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [SPLIT, FRAGMENTS])
def test_gpu_bf16_query_beyond_fp16_range(kernel):
    case = make_case(2, 2, 8, 128, 4096, 128, 2, 16, torch.bfloat16, [4096, 1024], [128, 3],
                     device="cuda")
    q = (torch.randn(2, 32, 128, device="cuda") * 2.0 ** 17).bfloat16()
    out = run_triton(q, case, 2.0 ** -24, kernel=kernel)
    assert torch.isfinite(out).all()
    assert_within_2x(out, q, case, 2.0 ** -24)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [2, 4])
def test_gpu_unused_capacity_and_slots_are_never_read(bits):
    case = make_case(3, 5, 8, 128, 4096, 128, bits, 16, torch.bfloat16, [1024, 4096, 0],
                     [3, 128, 1], device="cuda")
    q = torch.randn(3, 32, 128, device="cuda").bfloat16()
    clean = run_triton(q, case, 128 ** -0.5)
    assert torch.equal(clean, run_triton(q, case, 128 ** -0.5, bufs=poisoned(case, 3)))


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [2, 16])
def test_gpu_deterministic(bits):
    case = make_case(4, 4, 8, 128, 8192, 128, bits, 16, torch.bfloat16, [8192, 4096, 16, 0],
                     [128, 7, 1, 64], device="cuda")
    q = torch.randn(4, 32, 128, device="cuda").bfloat16()
    first = run_triton(q, case, 128 ** -0.5)
    for _ in range(3):
        assert torch.equal(first, run_triton(q, case, 128 ** -0.5))


# -- the Gluon kernel (codes unpacked into mma fragments): bits 2, G 16, D 128, GQA <= 8


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_fragments_llama_size(dtype):
    batch, n_q = 8, 16384
    n_quant = [n_q, n_q - 1024, 0, 4096, n_q, 16, 8192 + 48, n_q - 128 - 16]
    n_ring = [128, 1, 64, 128, 17, 128, 100, 5]
    case = make_case(batch, batch, 8, 128, n_q, 128, 2, 16, dtype, n_quant, n_ring,
                     outliers=True, device="cuda")
    q = torch.randn(batch, 32, 128, device="cuda").to(dtype)
    out = run_triton(q, case, 128 ** -0.5, kernel=FRAGMENTS)
    assert_within_2x(out, q, case, 128 ** -0.5)
    ref = decode_attention_ref(q, *case.bufs, 128 ** -0.5, 2, 16)
    torch.testing.assert_close(out, ref, rtol=4 * ULP[dtype], atol=4 * ULP[dtype])
    # a large launch (8 x 8 planes x 128 blocks): ``_plan`` picks this kernel on an H100/H200
    assert torch.equal(out, run_triton(q, case, 128 ** -0.5))


@pytest.mark.gpu
@pytest.mark.parametrize("gqa", [1, 2, 3, 4, 5, 8])
def test_gpu_fragments_group_sizes_and_splits(gqa):
    # lengths: one group, one block, block + group, odd multiples of 16; 1..many splits
    n_quant = [16, 128, 144, 2000 // 16 * 16, 4096, 4096 - 16]
    n_ring = [1, 128, 0, 33, 64, 2]
    case = make_case(6, 7, 4, 128, 4096, 128, 2, 16, torch.bfloat16, n_quant, n_ring,
                     outliers=True, device="cuda")
    q = torch.randn(6, 4 * gqa, 128, device="cuda").bfloat16()
    for splits in ({}, {"num_splits": 1}, {"num_splits": 3}, {"num_splits": 64}):
        out = run_triton(q, case, 128 ** -0.5, kernel=FRAGMENTS, **splits)
        assert_within_2x(out, q, case, 128 ** -0.5)


@pytest.mark.gpu
def test_gpu_fragments_unused_capacity_and_slots_are_never_read():
    case = make_case(3, 5, 8, 128, 4096, 128, 2, 16, torch.float16, [1024, 4096, 0],
                     [3, 128, 1], device="cuda")
    q = torch.randn(3, 32, 128, device="cuda").half()
    clean = run_triton(q, case, 128 ** -0.5, kernel=FRAGMENTS)
    assert torch.equal(clean, run_triton(q, case, 128 ** -0.5, bufs=poisoned(case, 3),
                                         kernel=FRAGMENTS))
    for _ in range(3):  # deterministic
        assert torch.equal(clean, run_triton(q, case, 128 ** -0.5, kernel=FRAGMENTS))


@pytest.mark.gpu
def test_gpu_fragments_strided_query():
    case = make_case(2, 2, 8, 128, 1024, 128, 2, 16, torch.bfloat16, [1024, 512], [1, 9],
                     device="cuda")
    q = torch.randn(2, 128, 32, device="cuda").bfloat16().transpose(1, 2)  # stride(2) != 1
    out = run_triton(q, case, 128 ** -0.5, kernel=FRAGMENTS)
    assert_within_2x(out, q, case, 128 ** -0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [2, 4, 16])
def test_gpu_opcheck(bits):
    case = make_case(2, 3, 2, 64, 256, 32, bits, 16, torch.float16, [128, 256], [1, 32],
                     device="cuda")
    q = torch.randn(2, 8, 64, device="cuda").half()
    torch.library.opcheck(torch.ops.minikv.decode_attention.default,
                          (q, *case.bufs, 0.125, bits, 16))


@pytest.mark.gpu
@pytest.mark.parametrize("bits,kernel", [(2, None), (16, None), (2, FRAGMENTS)])
def test_gpu_cuda_graph_replay_follows_lens(bits, kernel):
    """Capture once; change lens on the device (in place) and q; replay matches the reference."""
    capacity, ring = 4096, 128
    case = make_case(4, 6, 8, 128, capacity, ring, bits, 16, torch.bfloat16,
                     [4096, 1024, 0, 16], [1, 128, 2, 64], device="cuda")
    lens = case.bufs[-1]
    q = torch.randn(4, 32, 128, device="cuda").bfloat16()
    scale = 128 ** -0.5

    def step():
        if kernel is None:
            return decode_attention(q, *case.bufs, scale, bits, 16)
        return run_triton(q, case, scale, kernel=kernel)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up: Triton compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()

    for new_lens in ([[16, 5], [4096, 128], [2048, 1], [0, 128]],
                     [[4096, 128], [0, 1], [16, 1], [1024, 64]]):
        lens[:4].copy_(torch.tensor(new_lens, dtype=torch.int32, device="cuda"))
        q.copy_(torch.randn_like(q))
        graph.replay()
        expected = decode_attention_ref(q, *case.bufs, scale, bits, 16)
        torch.testing.assert_close(out, expected, rtol=4 * ULP[torch.bfloat16],
                                   atol=4 * ULP[torch.bfloat16])
        assert torch.equal(out, step())
