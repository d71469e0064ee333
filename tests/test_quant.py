"""minikv::quantize_keys / dequantize_keys / quantize_values / dequantize_values.

Three layers of checks: the PyTorch reference against a straightforward per-group NumPy version
of the contract's math (bit-exact); the Triton launchers against the reference (bit-exact; on CPU
through TRITON_INTERPRET=1); properties of the quantizer itself (error bound, constant groups).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from minikv_compile.ops import dequantize_keys, dequantize_values, quantize_keys, quantize_values
from minikv_compile.ops.quant import (_dequantize_keys_triton, _dequantize_values_triton,
                                      _quantize_keys_triton, _quantize_values_triton,
                                      dequantize_keys_ref, dequantize_values_ref,
                                      quantize_keys_ref, quantize_values_ref)

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# (B, H, T, D): odd batch and head counts; T a multiple of 16 (and of 32 for the 64-token shape).
SHAPES = [(3, 5, 48, 64), (1, 3, 16, 16), (2, 1, 64, 64)]
# (bits, G): 1 bit packs 32 tokens of one key group into a word, so its groups start at 32.
BITS_G = [(2, 16), (2, 32), (4, 16), (4, 32), (1, 32), (1, 64)]


def kv(shape, dtype, seed=0, device="cpu"):
    """Random keys/values with outlier channels (10x, 30x, 50x), like real K caches."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    D = shape[-1]
    for c, f in zip((1, D // 2, D - 1), (10.0, 30.0, 50.0)):
        x[..., c] *= f
    return x.to(dtype=dtype, device=device)


def fits(shape, G, what):
    T, D = shape[2], shape[3]
    return T % G == 0 if what == "keys" else D % G == 0


# ----------------------------------------------------------------------------------------------
# An independent statement of the contract: one group at a time, NumPy float32 / float16.
# ----------------------------------------------------------------------------------------------


def np_quantize_group(x: np.ndarray, bits: int):
    """x: the G float32 members of one group -> (codes list, scale fp16, zero fp16)."""
    qmax = np.float32(2**bits - 1)
    mn, mx = x.min(), x.max()
    if bits == 1:  # levels at the midpoints of the two halves of [min, max]
        span = np.float32(mx - mn)
        scale_h = np.float16(span / np.float32(2))
        zero_h = np.float16(np.float32(mn + span / np.float32(4)))
    else:
        scale_h = np.float16(np.float32(mx - mn) / qmax)
        zero_h = np.float16(mn)
    s, z = np.float32(scale_h), np.float32(zero_h)
    if s == 0:
        return [0] * len(x), scale_h, zero_h
    codes = []
    for xi in x:
        y = np.floor(np.float32(np.float32(xi - z) / s) + np.float32(0.5))
        codes.append(int(min(max(y, 0), qmax)))
    return codes, scale_h, zero_h


def np_pack(codes, bits: int) -> int:
    word = 0
    for i, c in enumerate(codes):
        word |= c << (i * bits)
    return word - 2**32 if word >= 2**31 else word  # the int32 with the same bits


def np_quantize_keys(k: torch.Tensor, bits: int, G: int):
    x = k.float().numpy()
    B, H, T, D = x.shape
    P = 32 // bits
    codes = np.zeros((B, H, T, D), dtype=np.int64)
    scale = np.zeros((B, H, T // G, D), dtype=np.float16)
    zero = np.zeros_like(scale)
    for b in range(B):
        for h in range(H):
            for g in range(T // G):
                for d in range(D):
                    c, s, z = np_quantize_group(x[b, h, g * G:(g + 1) * G, d], bits)
                    codes[b, h, g * G:(g + 1) * G, d] = c
                    scale[b, h, g, d], zero[b, h, g, d] = s, z
    packed = np.zeros((B, H, T // P, D), dtype=np.int32)
    for b, h, r, d in np.ndindex(*packed.shape):
        packed[b, h, r, d] = np_pack(codes[b, h, r * P:(r + 1) * P, d].tolist(), bits)
    return torch.from_numpy(packed), torch.from_numpy(scale), torch.from_numpy(zero)


def np_quantize_values(v: torch.Tensor, bits: int, G: int):
    x = v.float().numpy()
    B, H, T, D = x.shape
    P = 32 // bits
    codes = np.zeros((B, H, T, D), dtype=np.int64)
    scale = np.zeros((B, H, T, D // G), dtype=np.float16)
    zero = np.zeros_like(scale)
    for b, h, t, g in np.ndindex(*scale.shape):
        c, s, z = np_quantize_group(x[b, h, t, g * G:(g + 1) * G], bits)
        codes[b, h, t, g * G:(g + 1) * G] = c
        scale[b, h, t, g], zero[b, h, t, g] = s, z
    packed = np.zeros((B, H, T, D // P), dtype=np.int32)
    for b, h, t, col in np.ndindex(*packed.shape):
        packed[b, h, t, col] = np_pack(codes[b, h, t, col * P:(col + 1) * P].tolist(), bits)
    return torch.from_numpy(packed), torch.from_numpy(scale), torch.from_numpy(zero)


def assert_same(got, want):
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------
# Reference vs the independent math
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits,G", BITS_G)
def test_reference_matches_group_math(bits, G, dtype):
    shape = {16: (3, 5, 48, 16), 32: (3, 5, 32, 64), 64: (2, 3, 64, 64)}[G]
    x = kv(shape, dtype)
    assert_same(quantize_keys_ref(x, bits, G), np_quantize_keys(x, bits, G))
    assert_same(quantize_values_ref(x, bits, G), np_quantize_values(x, bits, G))


def test_packing_layout_by_hand():
    # Keys, 2 bit, G = 16: one group per channel; a ramp 0..15 of step 1 has scale 5 and codes
    # round(t / 5) = 0,0,0,1,1,1,1,1,2,2,2,2,2,3,3,3 -> token t's code at bits 2t of row 0.
    k = torch.arange(16, dtype=torch.float32).view(1, 1, 16, 1)
    codes, scale, zero = quantize_keys(k, bits=2, group_size=16)
    want = [0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3]
    assert np_pack(want, 2) == codes.item()
    assert scale.item() == 5.0 and zero.item() == 0.0
    # Values: the same ramp along channels packs the same way into column 0.
    v_codes, v_scale, _ = quantize_values(k.view(1, 1, 1, 16), bits=2, group_size=16)
    assert v_codes.item() == codes.item() and v_scale.item() == 5.0


def test_one_bit_levels_by_hand():
    # 1 bit, G = 32: a ramp 0..31 has scale (31 - 0) / 2 = 15.5 and zero 0 + 31 / 4 = 7.75, so
    # the levels are 7.75 and 23.25 (the midpoints of each half) and the code flips at 15.5:
    # tokens 0..15 -> 0, 16..31 -> 1, i.e. the word 0xFFFF0000.
    k = torch.arange(32, dtype=torch.float32).view(1, 1, 32, 1)
    codes, scale, zero = quantize_keys(k, bits=1, group_size=32)
    assert codes.item() == np_pack([0] * 16 + [1] * 16, 1) == -65536
    assert scale.item() == 15.5 and zero.item() == 7.75
    k_hat = dequantize_keys(codes, scale, zero, bits=1, group_size=32, dtype=torch.float32)
    assert k_hat.flatten().tolist() == [7.75] * 16 + [23.25] * 16


# ----------------------------------------------------------------------------------------------
# Triton (interpreter on CPU) vs reference
# ----------------------------------------------------------------------------------------------


def _assert_dequant_same(got, want):
    if got.dtype == torch.bfloat16 and got.device.type == "cpu":
        # The interpreter casts fp32 -> bf16 by truncation, the GPU (and torch) round to nearest
        # even; one bf16 ulp apart at most. test_triton_matches_reference_gpu holds it bit-exact.
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=0)
    else:
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.interpret
@pytest.mark.parametrize("bits,G,dtype,shape", [
    (bits, G, dtype, shape) for bits, G in BITS_G for dtype in DTYPES
    for shape in SHAPES + [(1, 2, 32, 80)] if fits(shape, G, "keys") or fits(shape, G, "values")])
def test_triton_matches_reference(bits, G, dtype, shape):
    x = kv(shape, dtype, seed=1)
    if fits(shape, G, "keys"):
        q = quantize_keys_ref(x, bits, G)
        assert_same(_quantize_keys_triton(x, bits, G), q)
        for out_dtype in (torch.float32, dtype):
            _assert_dequant_same(_dequantize_keys_triton(*q, bits, G, out_dtype),
                                 dequantize_keys_ref(*q, bits, G, out_dtype))
    if fits(shape, G, "values"):
        q = quantize_values_ref(x, bits, G)
        assert_same(_quantize_values_triton(x, bits, G), q)
        for out_dtype in (torch.float32, dtype):
            _assert_dequant_same(_dequantize_values_triton(*q, bits, G, out_dtype),
                                 dequantize_values_ref(*q, bits, G, out_dtype))


@pytest.mark.interpret
@pytest.mark.parametrize("bits", [2, 4])
def test_triton_strided_input(bits):
    # (B, T, H, D) storage seen as (B, H, T, D): the kernels follow the strides.
    x = kv((2, 32, 3, 64), torch.float16).transpose(1, 2)
    assert_same(_quantize_keys_triton(x, bits, 16), quantize_keys_ref(x.contiguous(), bits, 16))
    assert_same(_quantize_values_triton(x, bits, 16), quantize_values_ref(x.contiguous(), bits, 16))


# ----------------------------------------------------------------------------------------------
# Properties of the quantizer
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits,G", BITS_G)
def test_error_bound(bits, G, dtype):
    """|x - x_hat| <= scale_h / 2 plus what fp16 storage of scale and zero moves the grid by
    (at 1 bit the grid's exact levels are min + span / 4 and min + 3 span / 4)."""
    x = kv((2, 3, 64, 64), dtype, seed=2)
    qmax = 2**bits - 1
    for what in ("keys", "values"):
        if what == "keys":
            q = quantize_keys(x, bits, G)
            x_hat = dequantize_keys(*q, bits, G, torch.float32)
            groups = x.float().reshape(2, 3, 64 // G, G, 64)          # group along dim 3
            scale, zero = q[1].float().unsqueeze(3), q[2].float().unsqueeze(3)
            gdim = 3
        else:
            q = quantize_values(x, bits, G)
            x_hat = dequantize_values(*q, bits, G, torch.float32)
            groups = x.float().reshape(2, 3, 64, 64 // G, G)          # group along dim 4
            scale, zero = q[1].float().unsqueeze(4), q[2].float().unsqueeze(4)
            gdim = 4
        mn = groups.amin(gdim, keepdim=True)
        span = groups.amax(gdim, keepdim=True) - mn
        exact_scale, exact_zero = (span / 2, mn + span / 4) if bits == 1 else (span / qmax, mn)
        # at 1 bit the values beyond the two levels sit up to exact_scale / 2 from them, half a
        # scale error more than scale_h / 2
        steps = qmax + 0.5 if bits == 1 else qmax
        bound = (scale / 2 + (zero - exact_zero).abs() + steps * (scale - exact_scale).abs()
                 + 1e-6 * (groups.abs() + span))                       # fp32 rounding slack
        err = (x_hat.reshape(groups.shape) - groups).abs()
        assert torch.isfinite(x_hat).all()
        assert (err <= bound).all(), f"{what}: worst excess {(err - bound).max().item()}"


@pytest.mark.parametrize("bits,G", [(2, 16), (4, 16), (1, 32)])
@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_constant_groups_round_trip(bits, G, impl):
    x = kv((1, 2, 64, 32), torch.float16, seed=3)
    if impl == "triton" and torch.cuda.is_available():
        x = x.cuda()                          # no interpreter on a GPU machine
    x[:, :, :G, :] = 0.0                      # constant key groups (all channels, tokens 0..G-1)
    x[:, :, :G, 5] = -2.5
    x[:, 0, 40, :] = 0.125                    # constant value groups (one token, every group)
    qk, dk, qv, dv = ((quantize_keys_ref, dequantize_keys_ref, quantize_values_ref,
                       dequantize_values_ref) if impl == "ref" else
                      (_quantize_keys_triton, _dequantize_keys_triton, _quantize_values_triton,
                       _dequantize_values_triton))
    k_hat = dk(*qk(x, bits, G), bits, G, torch.float16)
    v_hat = dv(*qv(x, bits, G), bits, G, torch.float16)
    assert torch.isfinite(k_hat).all() and torch.isfinite(v_hat).all()
    assert torch.equal(k_hat[:, :, :G], x[:, :, :G])
    assert torch.equal(v_hat[:, 0, 40], x[:, 0, 40])
    codes, scale, _ = qk(x, bits, G)
    assert (scale[:, :, 0] == 0).all() and (codes[:, :, : G * bits // 32] == 0).all()


# ----------------------------------------------------------------------------------------------
# torch.library and torch.compile
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits,G", [(2, 16), (4, 16), (1, 32)])
def test_opcheck(bits, G):
    x = kv((2, 3, 32, 32), torch.bfloat16)
    qk = quantize_keys(x, bits, G)
    qv = quantize_values(x, bits, G)
    torch.library.opcheck(torch.ops.minikv.quantize_keys.default, (x, bits, G))
    torch.library.opcheck(torch.ops.minikv.quantize_values.default, (x, bits, G))
    torch.library.opcheck(torch.ops.minikv.dequantize_keys.default, (*qk, bits, G, torch.bfloat16))
    torch.library.opcheck(torch.ops.minikv.dequantize_values.default,
                          (*qv, bits, G, torch.float32))


def test_compile_fullgraph():
    def round_trip(k, v):
        k_hat = dequantize_keys(*quantize_keys(k, 2, 16), 2, 16, k.dtype)
        v_hat = dequantize_values(*quantize_values(v, 4, 32), 4, 32, v.dtype)
        return k_hat + 1, v_hat * 2

    compiled = torch.compile(round_trip, fullgraph=True)
    for seed in range(2):  # a second call with new data must reuse the graph
        k, v = kv((2, 3, 32, 64), torch.float16, seed), kv((2, 3, 32, 64), torch.float16, seed + 9)
        for got, want in zip(compiled(k, v), round_trip(k, v)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------
# Bad inputs
# ----------------------------------------------------------------------------------------------


def test_bad_inputs():
    x = torch.randn(1, 2, 32, 64)
    with pytest.raises(ValueError, match="k: expected 4 dims"):
        quantize_keys(x[0])
    with pytest.raises(ValueError, match="divisible by group_size=16"):
        quantize_keys(torch.randn(1, 2, 24, 64))
    with pytest.raises(ValueError, match="divisible by group_size=32"):
        quantize_values(torch.randn(1, 2, 32, 48), group_size=32)
    with pytest.raises(ValueError, match="v: expected dtype"):
        quantize_values(torch.ones(1, 2, 32, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="bits: expected one of"):
        quantize_keys(x, bits=3)
    with pytest.raises(ValueError, match="group_size: expected one of"):
        quantize_values(x, group_size=8)
    with pytest.raises(ValueError, match=r"group_size: expected a multiple of 32 \(the codes "
                                         r"one int32 packs at bits=1\), got 16"):
        quantize_keys(x, bits=1, group_size=16)
    codes, scale, zero = quantize_keys(x)
    with pytest.raises(ValueError, match="codes: expected shape"):
        dequantize_keys(codes[:, :, :1], scale, zero)
    with pytest.raises(ValueError, match="codes: expected shape"):
        dequantize_keys(codes, scale, zero, bits=4)   # 4-bit codes would need twice the rows
    with pytest.raises(ValueError, match="zero: expected shape"):
        dequantize_keys(codes, scale, zero[:, :1])
    with pytest.raises(ValueError, match="scale: expected dtype"):
        dequantize_keys(codes, scale.float(), zero)
    with pytest.raises(ValueError, match="dtype: expected one of"):
        dequantize_keys(codes, scale, zero, dtype=torch.int8)
    v_codes, v_scale, v_zero = quantize_values(x)
    with pytest.raises(ValueError, match="codes: expected shape"):
        dequantize_values(v_codes[..., :1], v_scale, v_zero)
    with pytest.raises(ValueError, match="codes: expected dtype"):
        dequantize_values(v_codes.long(), v_scale, v_zero)


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits,G", [(2, 16), (4, 16), (1, 32), (1, 64)])
def test_triton_matches_reference_gpu(bits, G, dtype):
    x = kv((4, 8, 4096, 128), dtype, device="cuda")
    for quant, dequant, quant_ref, dequant_ref in (
            (quantize_keys, dequantize_keys, quantize_keys_ref, dequantize_keys_ref),
            (quantize_values, dequantize_values, quantize_values_ref, dequantize_values_ref)):
        q = quant(x, bits, G)                        # CUDA: the Triton kernel
        assert_same(q, quant_ref(x, bits, G))        # the reference on CUDA
        assert_same([t.cpu() for t in q], quant_ref(x.cpu(), bits, G))  # and on CPU
        for out_dtype in (torch.float32, dtype):
            torch.testing.assert_close(dequant(*q, bits, G, out_dtype),
                                       dequant_ref(*q, bits, G, out_dtype), rtol=0, atol=0)


@pytest.mark.gpu
def test_opcheck_gpu():
    x = kv((2, 4, 256, 128), torch.bfloat16, device="cuda")
    qk, qv = quantize_keys(x), quantize_values(x)
    torch.library.opcheck(torch.ops.minikv.quantize_keys.default, (x, 2, 16))
    torch.library.opcheck(torch.ops.minikv.quantize_values.default, (x, 4, 32))
    torch.library.opcheck(torch.ops.minikv.dequantize_keys.default, (*qk, 2, 16, torch.bfloat16))
    torch.library.opcheck(torch.ops.minikv.dequantize_values.default, (*qv, 2, 16, torch.float16))
