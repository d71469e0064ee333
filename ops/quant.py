"""Asymmetric B-bit group quantization of keys (per channel) and values (per token).

Layout (``P = 32 / bits`` codes per int32, least-significant bits first; ``G`` = group size)::

    keys   k (B, H, T, D) -> codes (B, H, T / P, D) int32   token t: row t // P, bit (t % P) * B
                             scale, zero (B, H, T / G, D) fp16  a group: one channel, G tokens
    values v (B, H, T, D) -> codes (B, H, T, D / P) int32   channel c: col c // P, bit (c % P) * B
                             scale, zero (B, H, T, D / G) fp16  a group: G channels, one token

Per group, in fp32: ``scale = (max - min) / (2^B - 1)`` and ``zero = min`` for B = 2 and 4; for
B = 1 ``scale = (max - min) / 2`` and ``zero = min + (max - min) / 4`` (SpeCache's rule: the two
levels are the midpoints of the range's halves: for evenly spread values a quarter of the squared
error of the levels {min, max}, half the largest error). Stored ``scale_h = fp16(scale)``,
``zero_h = fp16(zero)``; codes are computed from the *stored* fp16 values so that
dequantization ``code * scale_h + zero_h`` uses exactly what was rounded against:
``code = clamp(floor((x - zero_h) / scale_h + 0.5), 0, 2^B - 1)``, and ``code = 0`` where
``scale_h == 0`` (a constant group dequantizes to ``zero_h`` exactly, never NaN).

Bit-exactness between the Triton kernels and the references rests on three facts:
- every division is IEEE round-to-nearest (``tl.math.div_rn``; Triton's ``/`` is approximate on
  GPU, and torch's CUDA ``tensor / python_scalar`` multiplies by the reciprocal, so the reference
  divides by a tensor);
- min/max are exact in any order, and fp32 -> fp16 casts round to nearest-even on both sides;
- ``code * scale_h`` is exact in fp32 (a <= 4-bit integer times an 11-bit mantissa), so the one
  rounding in dequantization is the ``+ zero_h``, whether or not the compiler fuses it into an FMA.

The ``@triton.jit`` helpers ``_quantize_key_block`` / ``_quantize_value_block`` (and the dequant
twins) hold the per-group math on register tiles; ``cache_update`` reuses them so that a ring
flush quantizes bit-identically to ``quantize_keys`` / ``quantize_values``.
"""
from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from ._checks import FLOAT_DTYPES, check_quant_params, check_tensor, codes_per_word

# Elements per program tile in the standalone kernels: 8192 fp32 values are 64 registers per
# thread at 4 warps, enough bytes in flight per program without spilling.
_TILE_ELEMENTS = 8192


# ----------------------------------------------------------------------------------------------
# Per-group math on register tiles (shared with cache_update)
# ----------------------------------------------------------------------------------------------


@triton.jit
def _scale_zero(mn, mx, BITS: tl.constexpr):
    """fp32 group min/max -> (scale_h, zero_h) fp16, same shape."""
    span = mx - mn
    if BITS == 1:  # span / 2 and span / 4 are exact; the reference rounds the same way
        return (span * 0.5).to(tl.float16), (mn + span * 0.25).to(tl.float16)
    qmax = tl.full(span.shape, (1 << BITS) - 1, tl.float32)
    scale = tl.math.div_rn(span, qmax)
    return scale.to(tl.float16), mn.to(tl.float16)


@triton.jit
def _encode(x, scale_h, zero_h, BITS: tl.constexpr):
    """fp32 values -> int32 codes in [0, 2^BITS); scale_h/zero_h fp16, already broadcastable."""
    s = scale_h.to(tl.float32)
    z = zero_h.to(tl.float32)
    constant = s == 0.0
    num = x - z
    # Dividing by 1 where the group is constant keeps the arithmetic finite; the code is then
    # overwritten with 0 below.
    den = tl.broadcast_to(tl.where(constant, 1.0, s), num.shape)
    y = tl.math.div_rn(num, den) + 0.5
    # clamp(floor(y), 0, qmax) == trunc(clamp(y, 0, qmax)): the float -> int cast truncates.
    y = tl.minimum(tl.maximum(y, 0.0), (1 << BITS) - 1.0)
    return tl.where(constant, 0, y.to(tl.int32))


@triton.jit
def _quantize_key_block(x, BITS: tl.constexpr):
    """Quantize a tile of key groups.

    x: [NG, W, P, BD] fp32 -- NG groups of G = W * P consecutive tokens (token (g * W + w) * P + p
    of the tile), BD channels. Returns packed [NG, W, BD] int32 (word w of group g holds tokens
    (g * W + w) * P ... + P - 1), scale_h and zero_h [NG, BD] fp16.
    """
    mn = tl.min(tl.min(x, axis=2), axis=1)
    mx = tl.max(tl.max(x, axis=2), axis=1)
    scale_h, zero_h = _scale_zero(mn, mx, BITS)
    code = _encode(x, scale_h[:, None, None, :], zero_h[:, None, None, :], BITS)
    shift = (tl.arange(0, 32 // BITS) * BITS)[None, None, :, None]
    # The shifted fields are disjoint, so their sum is their bitwise OR; in int32 the top field
    # wraps into the sign bit and the sum never leaves the int32 range.
    packed = tl.sum(code << shift, axis=2)
    return packed, scale_h, zero_h


@triton.jit
def _quantize_value_block(x, BITS: tl.constexpr):
    """Quantize a tile of value groups.

    x: [TB, NG, W, P] fp32 -- TB tokens, NG groups of G = W * P consecutive channels (channel
    (g * W + w) * P + p). Returns packed [TB, NG, W] int32 (column g * W + w of the token),
    scale_h and zero_h [TB, NG] fp16.
    """
    mn = tl.min(tl.min(x, axis=3), axis=2)
    mx = tl.max(tl.max(x, axis=3), axis=2)
    scale_h, zero_h = _scale_zero(mn, mx, BITS)
    code = _encode(x, scale_h[:, :, None, None], zero_h[:, :, None, None], BITS)
    shift = (tl.arange(0, 32 // BITS) * BITS)[None, None, None, :]
    packed = tl.sum(code << shift, axis=3)  # disjoint fields: sum == OR (see keys)
    return packed, scale_h, zero_h


@triton.jit
def _dequantize_key_block(packed, scale_h, zero_h, BITS: tl.constexpr):
    """packed [NG, W, BD] int32, scale_h/zero_h [NG, BD] fp16 -> [NG, W, P, BD] fp32."""
    shift = (tl.arange(0, 32 // BITS) * BITS)[None, None, :, None]
    # >> on int32 is arithmetic: the mask drops the sign bits dragged in from the top field.
    code = (packed[:, :, None, :] >> shift) & ((1 << BITS) - 1)
    s = scale_h.to(tl.float32)[:, None, None, :]
    z = zero_h.to(tl.float32)[:, None, None, :]
    return code.to(tl.float32) * s + z


@triton.jit
def _dequantize_value_block(packed, scale_h, zero_h, BITS: tl.constexpr):
    """packed [TB, NG, W] int32, scale_h/zero_h [TB, NG] fp16 -> [TB, NG, W, P] fp32."""
    shift = (tl.arange(0, 32 // BITS) * BITS)[None, None, None, :]
    code = (packed[:, :, :, None] >> shift) & ((1 << BITS) - 1)
    s = scale_h.to(tl.float32)[:, :, None, None]
    z = zero_h.to(tl.float32)[:, :, None, None]
    return code.to(tl.float32) * s + z


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _key_offsets(pid_bh, g, w, p, d, T, D, P: tl.constexpr, W: tl.constexpr):
    """Where a key tile [GROUPS, W, P, BLOCK_D] of plane ``pid_bh`` lives, in the contiguous
    layouts: (tokens [G, W, P, 1] of the unpacked tile, its mask; code offsets [G, W, BLOCK_D]
    into codes (B, H, T / P, D), their mask; scale/zero offsets [G, BLOCK_D] into
    (B, H, T / G, D), their mask)."""
    n_groups = T // (W * P)
    t = (g[:, None, None, None] * W + w[None, :, None, None]) * P + p[None, None, :, None]
    x_mask = (g[:, None, None, None] < n_groups) & (d[None, None, None, :] < D)
    row = g[:, None, None] * W + w[None, :, None]
    code_off = (pid_bh * (T // P) + row) * D + d[None, None, :]
    code_mask = (g[:, None, None] < n_groups) & (d[None, None, :] < D)
    sz_off = (pid_bh * n_groups + g[:, None]) * D + d[None, :]
    sz_mask = (g[:, None] < n_groups) & (d[None, :] < D)
    return t, x_mask, code_off, code_mask, sz_off, sz_mask


@triton.jit
def _value_offsets(pid_bh, t, g, w, p, T, D, P: tl.constexpr, W: tl.constexpr):
    """Where a value tile [TOKENS, BLOCK_NG, W, P] of plane ``pid_bh`` lives: (channels
    [1, NG, W, P] of the unpacked tile, its mask; code offsets [TOKENS, NG, W] into codes
    (B, H, T, D / P), their mask; scale/zero offsets [TOKENS, NG] into (B, H, T, D / G), their
    mask)."""
    NG = D // (W * P)
    c = (g[None, :, None, None] * W + w[None, None, :, None]) * P + p[None, None, None, :]
    x_mask = (t[:, None, None, None] < T) & (g[None, :, None, None] < NG)
    col = g[None, :, None] * W + w[None, None, :]
    code_off = (pid_bh * T + t[:, None, None]) * (D // P) + col
    code_mask = (t[:, None, None] < T) & (g[None, :, None] < NG)
    sz_off = (pid_bh * T + t[:, None]) * NG + g[None, :]
    sz_mask = (t[:, None] < T) & (g[None, :] < NG)
    return c, x_mask, code_off, code_mask, sz_off, sz_mask


@triton.jit
def _store_quantized(codes_ptr, scale_ptr, zero_ptr, code_off, code_mask, sz_off, sz_mask,
                     packed, scale_h, zero_h):
    tl.store(codes_ptr + code_off, packed, mask=code_mask)
    tl.store(scale_ptr + sz_off, scale_h, mask=sz_mask)
    tl.store(zero_ptr + sz_off, zero_h, mask=sz_mask)


@triton.jit
def _load_quantized(codes_ptr, scale_ptr, zero_ptr, code_off, code_mask, sz_off, sz_mask):
    return (tl.load(codes_ptr + code_off, mask=code_mask, other=0),
            tl.load(scale_ptr + sz_off, mask=sz_mask, other=0.0),
            tl.load(zero_ptr + sz_off, mask=sz_mask, other=0.0))


@triton.jit
def _quantize_keys_kernel(
    k_ptr, codes_ptr, scale_ptr, zero_ptr,
    H, T, D,
    stride_kb, stride_kh, stride_kt, stride_kd,
    BITS: tl.constexpr, G: tl.constexpr, GROUPS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program: GROUPS token groups x BLOCK_D channels of one (batch, head).
    pid_bh = tl.program_id(0).to(tl.int64)
    P: tl.constexpr = 32 // BITS
    W: tl.constexpr = G // P
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    t, x_mask, code_off, code_mask, sz_off, sz_mask = _key_offsets(
        pid_bh, g, tl.arange(0, W), tl.arange(0, P), d, T, D, P, W)
    x = tl.load(k_ptr + (pid_bh // H) * stride_kb + (pid_bh % H) * stride_kh + t * stride_kt
                + d[None, None, None, :] * stride_kd, mask=x_mask, other=0.0).to(tl.float32)
    packed, scale_h, zero_h = _quantize_key_block(x, BITS)
    _store_quantized(codes_ptr, scale_ptr, zero_ptr, code_off, code_mask, sz_off, sz_mask,
                     packed, scale_h, zero_h)


@triton.jit
def _dequantize_keys_kernel(
    codes_ptr, scale_ptr, zero_ptr, out_ptr,
    T, D,
    BITS: tl.constexpr, G: tl.constexpr, GROUPS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_bh = tl.program_id(0).to(tl.int64)
    P: tl.constexpr = 32 // BITS
    W: tl.constexpr = G // P
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    t, x_mask, code_off, code_mask, sz_off, sz_mask = _key_offsets(
        pid_bh, g, tl.arange(0, W), tl.arange(0, P), d, T, D, P, W)
    packed, scale_h, zero_h = _load_quantized(codes_ptr, scale_ptr, zero_ptr, code_off, code_mask,
                                              sz_off, sz_mask)
    x = _dequantize_key_block(packed, scale_h, zero_h, BITS)
    tl.store(out_ptr + (pid_bh * T + t) * D + d[None, None, None, :],
             x.to(out_ptr.dtype.element_ty), mask=x_mask)


@triton.jit
def _quantize_values_kernel(
    v_ptr, codes_ptr, scale_ptr, zero_ptr,
    H, T, D,
    stride_vb, stride_vh, stride_vt, stride_vd,
    BITS: tl.constexpr, G: tl.constexpr, TOKENS: tl.constexpr, BLOCK_NG: tl.constexpr,
):
    # One program: TOKENS tokens x all D channels (BLOCK_NG >= D / G groups) of one (batch, head).
    pid_bh = tl.program_id(0).to(tl.int64)
    P: tl.constexpr = 32 // BITS
    W: tl.constexpr = G // P
    t = tl.program_id(1) * TOKENS + tl.arange(0, TOKENS)
    c, x_mask, code_off, code_mask, sz_off, sz_mask = _value_offsets(
        pid_bh, t, tl.arange(0, BLOCK_NG), tl.arange(0, W), tl.arange(0, P), T, D, P, W)
    x = tl.load(v_ptr + (pid_bh // H) * stride_vb + (pid_bh % H) * stride_vh
                + t[:, None, None, None] * stride_vt + c * stride_vd,
                mask=x_mask, other=0.0).to(tl.float32)
    packed, scale_h, zero_h = _quantize_value_block(x, BITS)
    _store_quantized(codes_ptr, scale_ptr, zero_ptr, code_off, code_mask, sz_off, sz_mask,
                     packed, scale_h, zero_h)


@triton.jit
def _dequantize_values_kernel(
    codes_ptr, scale_ptr, zero_ptr, out_ptr,
    T, D,
    BITS: tl.constexpr, G: tl.constexpr, TOKENS: tl.constexpr, BLOCK_NG: tl.constexpr,
):
    pid_bh = tl.program_id(0).to(tl.int64)
    P: tl.constexpr = 32 // BITS
    W: tl.constexpr = G // P
    t = tl.program_id(1) * TOKENS + tl.arange(0, TOKENS)
    c, x_mask, code_off, code_mask, sz_off, sz_mask = _value_offsets(
        pid_bh, t, tl.arange(0, BLOCK_NG), tl.arange(0, W), tl.arange(0, P), T, D, P, W)
    packed, scale_h, zero_h = _load_quantized(codes_ptr, scale_ptr, zero_ptr, code_off, code_mask,
                                              sz_off, sz_mask)
    x = _dequantize_value_block(packed, scale_h, zero_h, BITS)
    tl.store(out_ptr + (pid_bh * T + t[:, None, None, None]) * D + c,
             x.to(out_ptr.dtype.element_ty), mask=x_mask)


# ----------------------------------------------------------------------------------------------
# Launchers (callable on CPU tensors under TRITON_INTERPRET=1)
# ----------------------------------------------------------------------------------------------


def _key_tiles(T: int, D: int, G: int) -> Tuple[int, int]:
    """(GROUPS, BLOCK_D) for a key tile [GROUPS, W, P, BLOCK_D] of about _TILE_ELEMENTS."""
    block_d = min(triton.next_power_of_2(D), 128)
    groups = max(1, min(_TILE_ELEMENTS // (G * block_d), triton.next_power_of_2(T // G)))
    return groups, block_d


def _value_tiles(T: int, D: int, G: int) -> Tuple[int, int]:
    """(TOKENS, BLOCK_NG) for a value tile [TOKENS, BLOCK_NG, W, P] of about _TILE_ELEMENTS."""
    block_ng = triton.next_power_of_2(D // G)
    tokens = max(1, min(_TILE_ELEMENTS // (block_ng * G), triton.next_power_of_2(T)))
    return tokens, block_ng


def _quantize_keys_triton(k: torch.Tensor, bits: int, group_size: int):
    B, H, T, D = k.shape
    P = codes_per_word(bits)
    codes = torch.empty(B, H, T // P, D, dtype=torch.int32, device=k.device)
    scale = torch.empty(B, H, T // group_size, D, dtype=torch.float16, device=k.device)
    zero = torch.empty_like(scale)
    groups, block_d = _key_tiles(T, D, group_size)
    grid = (B * H, triton.cdiv(T // group_size, groups), triton.cdiv(D, block_d))
    _quantize_keys_kernel[grid](
        k, codes, scale, zero, H, T, D, *k.stride(),
        BITS=bits, G=group_size, GROUPS=groups, BLOCK_D=block_d)
    return codes, scale, zero


def _dequantize_keys_triton(codes, scale, zero, bits: int, group_size: int, dtype: torch.dtype):
    B, H, n_groups, D = scale.shape
    T = n_groups * group_size
    out = torch.empty(B, H, T, D, dtype=dtype, device=codes.device)
    groups, block_d = _key_tiles(T, D, group_size)
    grid = (B * H, triton.cdiv(n_groups, groups), triton.cdiv(D, block_d))
    _dequantize_keys_kernel[grid](
        codes, scale, zero, out, T, D,
        BITS=bits, G=group_size, GROUPS=groups, BLOCK_D=block_d)
    return out


def _quantize_values_triton(v: torch.Tensor, bits: int, group_size: int):
    B, H, T, D = v.shape
    P = codes_per_word(bits)
    codes = torch.empty(B, H, T, D // P, dtype=torch.int32, device=v.device)
    scale = torch.empty(B, H, T, D // group_size, dtype=torch.float16, device=v.device)
    zero = torch.empty_like(scale)
    tokens, block_ng = _value_tiles(T, D, group_size)
    grid = (B * H, triton.cdiv(T, tokens))
    _quantize_values_kernel[grid](
        v, codes, scale, zero, H, T, D, *v.stride(),
        BITS=bits, G=group_size, TOKENS=tokens, BLOCK_NG=block_ng)
    return codes, scale, zero


def _dequantize_values_triton(codes, scale, zero, bits: int, group_size: int, dtype: torch.dtype):
    B, H, T, n_groups = scale.shape
    D = n_groups * group_size
    out = torch.empty(B, H, T, D, dtype=dtype, device=codes.device)
    tokens, block_ng = _value_tiles(T, D, group_size)
    grid = (B * H, triton.cdiv(T, tokens))
    _dequantize_values_kernel[grid](
        codes, scale, zero, out, T, D,
        BITS=bits, G=group_size, TOKENS=tokens, BLOCK_NG=block_ng)
    return out


# ----------------------------------------------------------------------------------------------
# Pure-PyTorch references (same signatures and layouts; run on any device)
# ----------------------------------------------------------------------------------------------


def _quantize_groups_ref(x: torch.Tensor, dim: int, bits: int):
    """x fp32 with the G members of every group along ``dim`` -> (codes int64, scale_h, zero_h).

    codes has x's shape; scale_h/zero_h are fp16 with ``dim`` kept as size 1.
    """
    mn = x.amin(dim=dim, keepdim=True)
    mx = x.amax(dim=dim, keepdim=True)
    qmax = (1 << bits) - 1
    if bits == 1:
        span = mx - mn
        scale_h, zero_h = (span * 0.5).to(torch.float16), (mn + span * 0.25).to(torch.float16)
    else:
        # Divide by a tensor, not a Python number: CUDA torch turns `t / 3.0` into
        # `t * (1 / 3.0)`, which is not the correctly rounded quotient the kernels compute.
        scale_h = ((mx - mn) / torch.full_like(mx, qmax)).to(torch.float16)
        zero_h = mn.to(torch.float16)
    return _encode_ref(x, scale_h, zero_h, bits), scale_h, zero_h


def _encode_ref(x: torch.Tensor, scale_h: torch.Tensor, zero_h: torch.Tensor, bits: int
                ) -> torch.Tensor:
    """x fp32 -> int64 codes in ``[0, 2^bits)`` against the stored fp16 ``scale_h`` / ``zero_h``
    (broadcastable); 0 where ``scale_h == 0``."""
    s, z = scale_h.float(), zero_h.float()
    constant = s == 0
    y = (x - z) / torch.where(constant, torch.ones_like(s), s) + 0.5
    # clamp(floor(y), 0, qmax) == trunc(clamp(y, 0, qmax)), and the cast truncates. (torch.floor
    # on CPU goes through MKL's threading, which stalls for milliseconds on a busy machine.)
    return torch.where(constant, 0.0, y.clamp(0, (1 << bits) - 1)).to(torch.int64)


def _pack_ref(codes: torch.Tensor, dim: int, bits: int) -> torch.Tensor:
    """Pack the P = 32 / bits int64 codes along ``dim`` (size P) into one int32, LSB first."""
    P = codes_per_word(bits)
    shape = [1] * codes.dim()
    shape[dim] = P
    shifts = (torch.arange(P, device=codes.device) * bits).view(shape)
    word = (codes << shifts).sum(dim=dim)  # int64 in [0, 2^32)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def _unpack_ref(words: torch.Tensor, dim: int, bits: int) -> torch.Tensor:
    """int32 words -> int32 codes with a new axis of size P = 32 / bits inserted at ``dim``."""
    P = codes_per_word(bits)
    words = words.unsqueeze(dim)
    shape = [1] * words.dim()
    shape[dim] = P
    shifts = (torch.arange(P, device=words.device, dtype=torch.int32) * bits).view(shape)
    return (words >> shifts) & ((1 << bits) - 1)  # arithmetic shift, then mask


def quantize_keys_ref(k: torch.Tensor, bits: int = 2, group_size: int = 16):
    """Reference for :func:`quantize_keys` (same arguments, same outputs)."""
    B, H, T, D = k.shape
    G, P = group_size, codes_per_word(bits)
    x = k.float().reshape(B, H, T // G, G, D)                   # a group: one channel, G tokens
    codes, scale_h, zero_h = _quantize_groups_ref(x, 3, bits)   # codes (B, H, T/G, G, D)
    packed = _pack_ref(codes.reshape(B, H, T // P, P, D), 3, bits)  # (B, H, T/P, D)
    return packed, scale_h.squeeze(3), zero_h.squeeze(3)


def dequantize_keys_ref(codes, scale, zero, bits: int = 2, group_size: int = 16,
                        dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Reference for :func:`dequantize_keys`."""
    B, H, n_groups, D = scale.shape
    G = group_size
    c = _unpack_ref(codes, 3, bits).reshape(B, H, n_groups, G, D).float()  # (B, H, T/G, G, D)
    x = c * scale.float().unsqueeze(3) + zero.float().unsqueeze(3)
    return x.reshape(B, H, n_groups * G, D).to(dtype)


def quantize_values_ref(v: torch.Tensor, bits: int = 2, group_size: int = 16):
    """Reference for :func:`quantize_values` (same arguments, same outputs)."""
    B, H, T, D = v.shape
    G, P = group_size, codes_per_word(bits)
    x = v.float().reshape(B, H, T, D // G, G)                   # a group: one token, G channels
    codes, scale_h, zero_h = _quantize_groups_ref(x, 4, bits)   # codes (B, H, T, D/G, G)
    packed = _pack_ref(codes.reshape(B, H, T, D // P, P), 4, bits)  # (B, H, T, D/P)
    return packed, scale_h.squeeze(4), zero_h.squeeze(4)


def dequantize_values_ref(codes, scale, zero, bits: int = 2, group_size: int = 16,
                          dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Reference for :func:`dequantize_values`."""
    B, H, T, n_groups = scale.shape
    G = group_size
    c = _unpack_ref(codes, 4, bits).reshape(B, H, T, n_groups, G).float()  # (B, H, T, D/G, G)
    x = c * scale.float().unsqueeze(4) + zero.float().unsqueeze(4)
    return x.reshape(B, H, T, n_groups * G).to(dtype)


# ----------------------------------------------------------------------------------------------
# Registered ops: the reference by default (CPU), the Triton kernel on CUDA
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("minikv::quantize_keys", mutates_args=())
def _quantize_keys_op(k: torch.Tensor, bits: int, group_size: int
                      ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return quantize_keys_ref(k, bits, group_size)


@_quantize_keys_op.register_fake
def _(k, bits, group_size):
    B, H, T, D = k.shape
    codes = k.new_empty(B, H, T // codes_per_word(bits), D, dtype=torch.int32)
    scale = k.new_empty(B, H, T // group_size, D, dtype=torch.float16)
    return codes, scale, torch.empty_like(scale)


_quantize_keys_op.register_kernel("cuda")(_quantize_keys_triton)


@torch.library.custom_op("minikv::dequantize_keys", mutates_args=())
def _dequantize_keys_op(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                        group_size: int, dtype: torch.dtype) -> torch.Tensor:
    return dequantize_keys_ref(codes, scale, zero, bits, group_size, dtype)


@_dequantize_keys_op.register_fake
def _(codes, scale, zero, bits, group_size, dtype):
    B, H, n_groups, D = scale.shape
    return scale.new_empty(B, H, n_groups * group_size, D, dtype=dtype)


_dequantize_keys_op.register_kernel("cuda")(_dequantize_keys_triton)


@torch.library.custom_op("minikv::quantize_values", mutates_args=())
def _quantize_values_op(v: torch.Tensor, bits: int, group_size: int
                        ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return quantize_values_ref(v, bits, group_size)


@_quantize_values_op.register_fake
def _(v, bits, group_size):
    B, H, T, D = v.shape
    codes = v.new_empty(B, H, T, D // codes_per_word(bits), dtype=torch.int32)
    scale = v.new_empty(B, H, T, D // group_size, dtype=torch.float16)
    return codes, scale, torch.empty_like(scale)


_quantize_values_op.register_kernel("cuda")(_quantize_values_triton)


@torch.library.custom_op("minikv::dequantize_values", mutates_args=())
def _dequantize_values_op(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                          group_size: int, dtype: torch.dtype) -> torch.Tensor:
    return dequantize_values_ref(codes, scale, zero, bits, group_size, dtype)


@_dequantize_values_op.register_fake
def _(codes, scale, zero, bits, group_size, dtype):
    B, H, T, n_groups = scale.shape
    return scale.new_empty(B, H, T, n_groups * group_size, dtype=dtype)


_dequantize_values_op.register_kernel("cuda")(_dequantize_values_triton)


# ----------------------------------------------------------------------------------------------
# Public wrappers
# ----------------------------------------------------------------------------------------------


def quantize_keys(k: torch.Tensor, bits: int = 2, group_size: int = 16):
    """Quantize keys per channel: one group = one channel over ``group_size`` consecutive tokens.

    Args:
        k: ``(B, H, T, D)`` fp16/bf16/fp32, any strides; ``T % group_size == 0``.
        bits: 1, 2 or 4.
        group_size: 16, 32, 64 or 128 (32 and up at 1 bit).

    Returns:
        codes: ``(B, H, T * bits / 32, D)`` int32; token ``t`` in row ``t // (32 / bits)`` at bit
            offset ``(t % (32 / bits)) * bits``.
        scale, zero: ``(B, H, T / group_size, D)`` fp16; ``x_hat = code * scale + zero``.
    """
    check_quant_params(bits, group_size)
    check_tensor("k", k, ndim=4, dtypes=FLOAT_DTYPES)
    if k.shape[2] % group_size:
        raise ValueError(f"k: expected T (dim 2) divisible by group_size={group_size}, "
                         f"got shape {tuple(k.shape)}")
    return torch.ops.minikv.quantize_keys(k, bits, group_size)


def quantize_values(v: torch.Tensor, bits: int = 2, group_size: int = 16):
    """Quantize values per token: one group = ``group_size`` consecutive channels of one token.

    Args:
        v: ``(B, H, T, D)`` fp16/bf16/fp32, any strides; ``D % group_size == 0``.
        bits: 1, 2 or 4.
        group_size: 16, 32, 64 or 128 (32 and up at 1 bit).

    Returns:
        codes: ``(B, H, T, D * bits / 32)`` int32; channel ``c`` in column ``c // (32 / bits)`` at
            bit offset ``(c % (32 / bits)) * bits``.
        scale, zero: ``(B, H, T, D / group_size)`` fp16; ``x_hat = code * scale + zero``.
    """
    check_quant_params(bits, group_size)
    check_tensor("v", v, ndim=4, dtypes=FLOAT_DTYPES)
    if v.shape[3] % group_size:
        raise ValueError(f"v: expected D (dim 3) divisible by group_size={group_size}, "
                         f"got shape {tuple(v.shape)}")
    return torch.ops.minikv.quantize_values(v, bits, group_size)


def _check_dequant_inputs(codes, scale, zero, bits, group_size, dtype):
    check_quant_params(bits, group_size)
    check_tensor("scale", scale, ndim=4, dtypes=(torch.float16,), contiguous=True)
    check_tensor("zero", zero, shape=tuple(scale.shape), dtypes=(torch.float16,),
                 device=scale.device, contiguous=True)
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype: expected one of {[str(d) for d in FLOAT_DTYPES]}, got {dtype}")


def dequantize_keys(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int = 2,
                    group_size: int = 16, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Inverse of :func:`quantize_keys`.

    Args:
        codes: ``(B, H, T * bits / 32, D)`` int32, contiguous.
        scale, zero: ``(B, H, T / group_size, D)`` fp16, contiguous.
        dtype: output dtype (fp16/bf16/fp32); the value is computed in fp32, then cast.

    Returns:
        ``(B, H, T, D)`` in ``dtype``: ``code * scale + zero``.
    """
    _check_dequant_inputs(codes, scale, zero, bits, group_size, dtype)
    B, H, n_groups, D = scale.shape
    rows = n_groups * group_size // codes_per_word(bits)
    check_tensor("codes", codes, shape=(B, H, rows, D), dtypes=(torch.int32,),
                 device=scale.device, contiguous=True)
    return torch.ops.minikv.dequantize_keys(codes, scale, zero, bits, group_size, dtype)


def dequantize_values(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int = 2,
                      group_size: int = 16, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Inverse of :func:`quantize_values`.

    Args:
        codes: ``(B, H, T, D * bits / 32)`` int32, contiguous.
        scale, zero: ``(B, H, T, D / group_size)`` fp16, contiguous.
        dtype: output dtype (fp16/bf16/fp32); the value is computed in fp32, then cast.

    Returns:
        ``(B, H, T, D)`` in ``dtype``: ``code * scale + zero``.
    """
    _check_dequant_inputs(codes, scale, zero, bits, group_size, dtype)
    B, H, T, n_groups = scale.shape
    cols = n_groups * group_size // codes_per_word(bits)
    check_tensor("codes", codes, shape=(B, H, T, cols), dtypes=(torch.int32,),
                 device=scale.device, contiguous=True)
    return torch.ops.minikv.dequantize_values(codes, scale, zero, bits, group_size, dtype)
