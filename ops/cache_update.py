"""Writes into the static cache of one layer: the per-step ring append (with its flush) and the
end-of-prefill write.

Buffers (``Bmax`` slots, ``T_cap`` quantized tokens per slot, ring of ``R`` tokens, ``P = 32 /
bits`` codes per int32, group ``G``; the layout of :mod:`.quant`)::

    k_cache  (Bmax, H, T_cap / P, D) int32     v_cache  (Bmax, H, T_cap, D / P) int32
    k_scale, k_zero (Bmax, H, T_cap / G, D) fp16  v_scale, v_zero (Bmax, H, T_cap, D / G) fp16
    k_ring, v_ring  (Bmax, H, R, D) model dtype
    lens            (Bmax, 2) int32: [quantized tokens, ring tokens] per slot

With ``bits == 16`` k_cache/v_cache are ``(Bmax, H, T_cap, D)`` in the model dtype and the four
scale/zero tensors are empty and ignored. Slot ``b`` holds, in order, region tokens
``[0, lens[b, 0])`` then ring tokens ``[0, lens[b, 1])``.

``cache_append`` flushes lazily: a ring that became full at step ``s`` is quantized into the region
at the start of step ``s + 1``, so the attention of step ``s`` still saw it in full precision.
"""
from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from . import _gdc as gdc
from ._checks import FLOAT_DTYPES, check_choice, check_tensor, codes_per_word
from .quant import (_quantize_key_block, _quantize_value_block, quantize_keys, quantize_keys_ref,
                    quantize_values, quantize_values_ref)

_GROUP_SIZES = (16, 32, 64, 128)
# Elements of one input tensor that a program holds at once (16 registers per thread at 4 warps).
# A flush program quantizes one G x D block of ring keys and as many ring values: for B = 8 slots,
# H_kv = 8, R = D = 128, G = 16 that is B * H * R / G = 512 programs, enough for every SM of an
# H100/H200 (132). One program per (slot, head) quantizing its whole 128 x 128 ring serially took
# 64 us per layer on an H200 (most SMs idle, each program a chain of dependent tile loads).
_TILE_ELEMENTS = 2048


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _append_plan(n_quant, n_ring, T_cap, RING: tl.constexpr):
    """A slot's old counters -> (flush, write, ring index, new n_quant, new n_ring).

    A full ring is flushed first, unless the region has no room for it; then the slot takes no
    new token at all (the engine sizes T_cap so that this never happens).
    """
    flush = (n_ring == RING) & (n_quant + RING <= T_cap)
    write = (n_ring < RING) | flush
    index = tl.where(flush, 0, n_ring)
    new_quant = tl.where(flush, n_quant + RING, n_quant)
    new_ring = tl.where(write, index + 1, n_ring)
    return flush, write, index, new_quant, new_ring


@triton.jit
def _flush_key_group(ring_ptr, codes_ptr, scale_ptr, zero_ptr, bh, n_quant, j, d0, D, T_cap,
                     RING: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
                     BLOCK_DK: tl.constexpr):
    """Quantize ring key group ``j`` (tokens [j * G, (j + 1) * G)) of one (slot, head), channels
    [d0, d0 + BLOCK_DK), into region group ``n_quant / G + j``."""
    P: tl.constexpr = 32 // BITS
    W: tl.constexpr = G // P
    w = tl.arange(0, W)
    p = tl.arange(0, P)
    d = d0 + tl.arange(0, BLOCK_DK)
    d_ok = d < D
    # -- load [1, W, P, BLOCK_DK]: one group, token j * G + w * P + p
    t = j * G + w[None, :, None, None] * P + p[None, None, :, None]
    x = tl.load(ring_ptr + (bh * RING + t) * D + d[None, None, None, :],
                mask=d_ok[None, None, None, :], other=0.0)
    packed, scale_h, zero_h = _quantize_key_block(x.to(tl.float32), BITS)  # [1, W, BD], [1, BD]
    # -- store codes rows n_quant / P + j * W + w and scale/zero row n_quant / G + j
    row = n_quant // P + j * W + w[None, :, None]
    tl.store(codes_ptr + (bh * (T_cap // P) + row) * D + d[None, None, :], packed,
             mask=d_ok[None, None, :])
    sz = (bh * (T_cap // G) + n_quant // G + j) * D + d[None, :]
    tl.store(scale_ptr + sz, scale_h, mask=d_ok[None, :])
    tl.store(zero_ptr + sz, zero_h, mask=d_ok[None, :])


@triton.jit
def _flush_value_tokens(ring_ptr, codes_ptr, scale_ptr, zero_ptr, bh, n_quant, t0, D, T_cap,
                        RING: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
                        TOKENS: tl.constexpr, BLOCK_NG: tl.constexpr):
    """Quantize ring values [t0, t0 + TOKENS) of one (slot, head), all their channel groups,
    into region tokens from ``n_quant + t0``."""
    P: tl.constexpr = 32 // BITS
    W: tl.constexpr = G // P
    NG = D // G
    t = t0 + tl.arange(0, TOKENS)
    g = tl.arange(0, BLOCK_NG)
    g_ok = g < NG
    w = tl.arange(0, W)
    p = tl.arange(0, P)
    # -- load [TOKENS, BLOCK_NG, W, P]: channel (g * W + w) * P + p
    c = (g[None, :, None, None] * W + w[None, None, :, None]) * P + p[None, None, None, :]
    x = tl.load(ring_ptr + (bh * RING + t[:, None, None, None]) * D + c,
                mask=g_ok[None, :, None, None], other=0.0)
    packed, scale_h, zero_h = _quantize_value_block(x.to(tl.float32), BITS)  # [TB, NG, W], [TB, NG]
    # -- store codes columns g * W + w and scale/zero columns g of region tokens n_quant + t
    dst = bh * T_cap + n_quant + t
    col = g[None, :, None] * W + w[None, None, :]
    tl.store(codes_ptr + dst[:, None, None] * (D // P) + col, packed, mask=g_ok[None, :, None])
    sz = dst[:, None] * NG + g[None, :]
    tl.store(scale_ptr + sz, scale_h, mask=g_ok[None, :])
    tl.store(zero_ptr + sz, zero_h, mask=g_ok[None, :])


@triton.jit
def _flush_plain_tokens(ring_ptr, cache_ptr, bh, n_quant, t0, D, T_cap,
                        RING: tl.constexpr, TOKENS: tl.constexpr, BLOCK_D: tl.constexpr):
    """bits == 16: copy ring tokens [t0, t0 + TOKENS) of one (slot, head) to region tokens from
    ``n_quant + t0``."""
    t = t0 + tl.arange(0, TOKENS)
    d = tl.arange(0, BLOCK_D)
    mask = (t < RING)[:, None] & (d < D)[None, :]
    x = tl.load(ring_ptr + (bh * RING + t[:, None]) * D + d[None, :], mask=mask)
    tl.store(cache_ptr + (bh * T_cap + n_quant + t[:, None]) * D + d[None, :], x, mask=mask)


@triton.jit
def _flush_kernel(
    k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring, lens,
    H, D, T_cap,
    RING: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_DK: tl.constexpr, TOKENS: tl.constexpr, BLOCK_NG: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    # Launch 1 of cache_append. One program per (slot, kv head, ring chunk); a chunk is, with
    # bits < 16, the channel block c % SPLIT of ring key group c // SPLIT plus the matching
    # 1 / SPLIT of that group's value tokens; with bits == 16, TOKENS ring tokens of K and V.
    # Programs read the ring and lens and write only their own region cells, so no program reads
    # what another writes. The new token's ring write and the counter update come in launch 2.
    gdc.launch_dependents_then_wait(PDL)  # nothing is read or written before this
    b = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.program_id(2)
    n_quant = tl.load(lens + 2 * b)
    n_ring = tl.load(lens + 2 * b + 1)
    flush, _, _, _, _ = _append_plan(n_quant, n_ring, T_cap, RING)
    if flush:  # the other slots' programs end here (the common step: no slot flushes)
        bh = (b * H + h).to(tl.int64)
        if BITS == 16:
            _flush_plain_tokens(k_ring, k_cache, bh, n_quant, c * TOKENS, D, T_cap,
                                RING, TOKENS, BLOCK_D)
            _flush_plain_tokens(v_ring, v_cache, bh, n_quant, c * TOKENS, D, T_cap,
                                RING, TOKENS, BLOCK_D)
        else:
            j = c // SPLIT
            i = c % SPLIT
            _flush_key_group(k_ring, k_cache, k_scale, k_zero, bh, n_quant, j, i * BLOCK_DK, D,
                             T_cap, RING, BITS, G, BLOCK_DK)
            _flush_value_tokens(v_ring, v_cache, v_scale, v_zero, bh, n_quant,
                                j * G + i * TOKENS, D, T_cap, RING, BITS, G, TOKENS, BLOCK_NG)


@triton.jit
def _append_kernel(
    k_new, v_new, k_ring, v_ring, lens,
    stride_kb, stride_kh, stride_kd, stride_vb, stride_vh, stride_vd,
    H, D, T_cap,
    RING: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    # Launch 2 of cache_append, after every flush program has read the ring and lens. One program
    # per slot, all heads: it is the only reader and writer of lens[b] in this launch, so it can
    # advance the counters itself instead of a third launch (which would cost every decode step
    # another ~2 us per layer, not just the flush step).
    gdc.launch_dependents_then_wait(PDL)
    b = tl.program_id(0)
    b64 = b.to(tl.int64)
    n_quant = tl.load(lens + 2 * b)
    n_ring = tl.load(lens + 2 * b + 1)
    _, write, index, new_quant, new_ring = _append_plan(n_quant, n_ring, T_cap, RING)

    # -- append: the new token of every head -> ring row `index`
    if write:
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        for h0 in range(0, H, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            mask = (h < H)[:, None] & d_ok[None, :]
            k = tl.load(k_new + b64 * stride_kb + h[:, None] * stride_kh + d[None, :] * stride_kd,
                        mask=mask)
            v = tl.load(v_new + b64 * stride_vb + h[:, None] * stride_vh + d[None, :] * stride_vd,
                        mask=mask)
            dst = ((b64 * H + h[:, None]) * RING + index) * D + d[None, :]
            tl.store(k_ring + dst, k, mask=mask)
            tl.store(v_ring + dst, v, mask=mask)

    # -- counters. Every thread loaded lens[b] above, and a thread of another warp may run ahead:
    # the CTA barrier makes all those reads complete before any thread overwrites lens[b].
    tl.debug_barrier()
    if write:
        tl.store(lens + 2 * b, new_quant)
        tl.store(lens + 2 * b + 1, new_ring)


# ----------------------------------------------------------------------------------------------
# Launcher (callable on CPU tensors under TRITON_INTERPRET=1)
# ----------------------------------------------------------------------------------------------


def _flush_tiles(R: int, D: int, bits: int, G: int) -> Tuple[int, int, int, int]:
    """(CHUNKS, SPLIT, BLOCK_DK, TOKENS): the flush launch has CHUNKS programs per (slot, head).

    bits < 16: each ring key group (G tokens x D channels) is split into SPLIT channel blocks of
    BLOCK_DK, so that a key tile holds about _TILE_ELEMENTS; program ``c`` takes channel block
    ``c % SPLIT`` of group ``c // SPLIT`` and the TOKENS = G / SPLIT value tokens from
    ``(c // SPLIT) * G + (c % SPLIT) * TOKENS``. CHUNKS = (R / G) * SPLIT.
    bits == 16: program ``c`` copies ring tokens [c * TOKENS, (c + 1) * TOKENS); SPLIT = 1.
    """
    block_d = triton.next_power_of_2(D)
    if bits == 16:
        tokens = max(1, min(_TILE_ELEMENTS // block_d, triton.next_power_of_2(R)))
        return triton.cdiv(R, tokens), 1, block_d, tokens
    # Powers of two throughout, so SPLIT divides both G and block_d.
    split = max(1, min(G * block_d // _TILE_ELEMENTS, G, block_d))
    return R // G * split, split, block_d // split, G // split


def _cache_append_triton(k_new, v_new, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero,
                         k_ring, v_ring, lens, bits: int, group_size: int) -> None:
    B, H, D = k_new.shape
    R, T_cap, G = k_ring.shape[2], v_cache.shape[2], group_size
    block_d = triton.next_power_of_2(D)
    chunks, split, block_dk, tokens = _flush_tiles(R, D, bits, G)
    pdl = gdc.supported(k_new.device)
    _flush_kernel[(B, H, chunks)](
        k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring, lens, H, D, T_cap,
        RING=R, BITS=bits, G=G, SPLIT=split, BLOCK_DK=block_dk, TOKENS=tokens,
        BLOCK_NG=triton.next_power_of_2(max(D // G, 1)), BLOCK_D=block_d, PDL=pdl,
        launch_pdl=pdl)
    block_h = max(1, min(triton.next_power_of_2(H), _TILE_ELEMENTS // block_d))
    _append_kernel[(B,)](
        k_new, v_new, k_ring, v_ring, lens, *k_new.stride(), *v_new.stride(), H, D, T_cap,
        RING=R, BLOCK_H=block_h, BLOCK_D=block_d, PDL=pdl, launch_pdl=pdl)


# ----------------------------------------------------------------------------------------------
# Pure-PyTorch references
# ----------------------------------------------------------------------------------------------


def _store_region(slot, start, k_tok, v_tok, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero,
                  bits, group_size, quantize_k, quantize_v) -> None:
    """Write ``k_tok``/``v_tok`` ``(H, n, D)`` (``n % G == 0``) to slot ``slot``'s region at
    token offset ``start`` (a multiple of G), quantizing with ``quantize_k``/``quantize_v``."""
    n, G = k_tok.shape[1], group_size
    if bits == 16:
        k_cache[slot, :, start:start + n] = k_tok
        v_cache[slot, :, start:start + n] = v_tok
        return
    P = codes_per_word(bits)
    codes, scale, zero = quantize_k(k_tok[None], bits, G)       # (1, H, n/P, D), (1, H, n/G, D)
    k_cache[slot, :, start // P:(start + n) // P] = codes[0]
    k_scale[slot, :, start // G:(start + n) // G] = scale[0]
    k_zero[slot, :, start // G:(start + n) // G] = zero[0]
    codes, scale, zero = quantize_v(v_tok[None], bits, G)       # (1, H, n, D/P), (1, H, n, D/G)
    v_cache[slot, :, start:start + n] = codes[0]
    v_scale[slot, :, start:start + n] = scale[0]
    v_zero[slot, :, start:start + n] = zero[0]


def cache_append_ref(k_new, v_new, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero,
                     k_ring, v_ring, lens, bits: int, group_size: int) -> None:
    """Reference for :func:`cache_append`: the same per-slot plan, one slot at a time."""
    R, T_cap = k_ring.shape[2], v_cache.shape[2]
    for b, (n_quant, n_ring) in enumerate(lens[: k_new.shape[0]].tolist()):
        flush = n_ring == R and n_quant + R <= T_cap
        if not (n_ring < R or flush):
            continue  # full ring, no room to flush: the slot is left untouched
        if flush:
            _store_region(b, n_quant, k_ring[b], v_ring[b], k_cache, k_scale, k_zero, v_cache,
                          v_scale, v_zero, bits, group_size, quantize_keys_ref, quantize_values_ref)
            n_quant, n_ring = n_quant + R, 0
        k_ring[b, :, n_ring] = k_new[b]
        v_ring[b, :, n_ring] = v_new[b]
        lens[b, 0] = n_quant
        lens[b, 1] = n_ring + 1


# ----------------------------------------------------------------------------------------------
# Registered ops
# ----------------------------------------------------------------------------------------------

_CACHE_BUFFERS = ("k_cache", "k_scale", "k_zero", "v_cache", "v_scale", "v_zero", "k_ring",
                  "v_ring", "lens")


@torch.library.custom_op("minikv::cache_append", mutates_args=_CACHE_BUFFERS)
def _cache_append_op(k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                     k_scale: torch.Tensor, k_zero: torch.Tensor, v_cache: torch.Tensor,
                     v_scale: torch.Tensor, v_zero: torch.Tensor, k_ring: torch.Tensor,
                     v_ring: torch.Tensor, lens: torch.Tensor, bits: int, group_size: int) -> None:
    cache_append_ref(k_new, v_new, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring,
                     v_ring, lens, bits, group_size)


@_cache_append_op.register_fake
def _(k_new, v_new, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring, lens,
      bits, group_size):
    return None


_cache_append_op.register_kernel("cuda")(_cache_append_triton)


@torch.library.custom_op("minikv::cache_write_prefill", mutates_args=_CACHE_BUFFERS)
def _cache_write_prefill_op(k_sel: torch.Tensor, v_sel: torch.Tensor, slot: int,
                            k_cache: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
                            v_cache: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor,
                            k_ring: torch.Tensor, v_ring: torch.Tensor, lens: torch.Tensor,
                            bits: int, group_size: int) -> None:
    # One implementation for every device: the quantize ops dispatch to Triton on CUDA.
    n = k_sel.shape[1]
    n_quant = n // group_size * group_size
    if n_quant:
        _store_region(slot, 0, k_sel[:, :n_quant], v_sel[:, :n_quant], k_cache, k_scale, k_zero,
                      v_cache, v_scale, v_zero, bits, group_size, quantize_keys, quantize_values)
    k_ring[slot, :, : n - n_quant] = k_sel[:, n_quant:]
    v_ring[slot, :, : n - n_quant] = v_sel[:, n_quant:]
    lens[slot, 0].fill_(n_quant)  # fill_ with a Python int: no host-to-device copy
    lens[slot, 1].fill_(n - n_quant)


@_cache_write_prefill_op.register_fake
def _(k_sel, v_sel, slot, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring,
      lens, bits, group_size):
    return None


# ----------------------------------------------------------------------------------------------
# Public wrappers
# ----------------------------------------------------------------------------------------------


def _check_base(name: str, t: torch.Tensor) -> None:
    # A mutating op must see the whole allocation, not a view: kernels index the base layout.
    if t._base is not None:
        raise ValueError(f"{name}: expected a whole cache buffer, got a view of shape "
                         f"{tuple(t.shape)} into a {tuple(t._base.shape)} tensor")


def _check_cache(k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring, lens,
                 bits: int, group_size: int):
    """Validate one layer's buffers against the layout contract; return (Bmax, H, T_cap, R, D)."""
    check_choice("bits", bits, (2, 4, 16))
    check_choice("group_size", group_size, _GROUP_SIZES)
    G = group_size
    check_tensor("k_ring", k_ring, ndim=4, dtypes=FLOAT_DTYPES, contiguous=True)
    Bmax, H, R, D = k_ring.shape
    dev, dtype = k_ring.device, k_ring.dtype
    check_tensor("v_ring", v_ring, shape=(Bmax, H, R, D), dtypes=(dtype,), device=dev,
                 contiguous=True)
    check_tensor("lens", lens, shape=(Bmax, 2), dtypes=(torch.int32,), device=dev,
                 contiguous=True)
    if bits == 16:
        check_tensor("v_cache", v_cache, shape=(Bmax, H, None, D), dtypes=(dtype,), device=dev,
                     contiguous=True)
        T_cap = v_cache.shape[2]
        check_tensor("k_cache", k_cache, shape=(Bmax, H, T_cap, D), dtypes=(dtype,), device=dev,
                     contiguous=True)
        for name, t in (("k_scale", k_scale), ("k_zero", k_zero), ("v_scale", v_scale),
                        ("v_zero", v_zero)):
            check_tensor(name, t)  # unused with bits == 16
    else:
        P = codes_per_word(bits)
        if R % G or D % G:
            raise ValueError(f"k_ring: expected ring length R (dim 2) and head dim D (dim 3) "
                             f"divisible by group_size={G}, got shape {tuple(k_ring.shape)}")
        check_tensor("v_cache", v_cache, shape=(Bmax, H, None, D // P), dtypes=(torch.int32,),
                     device=dev, contiguous=True)
        T_cap = v_cache.shape[2]
        if T_cap % G:
            raise ValueError(f"v_cache: expected capacity T_cap (dim 2) divisible by "
                             f"group_size={G}, got shape {tuple(v_cache.shape)}")
        check_tensor("k_cache", k_cache, shape=(Bmax, H, T_cap // P, D), dtypes=(torch.int32,),
                     device=dev, contiguous=True)
        for name, t in (("k_scale", k_scale), ("k_zero", k_zero)):
            check_tensor(name, t, shape=(Bmax, H, T_cap // G, D), dtypes=(torch.float16,),
                         device=dev, contiguous=True)
        for name, t in (("v_scale", v_scale), ("v_zero", v_zero)):
            check_tensor(name, t, shape=(Bmax, H, T_cap, D // G), dtypes=(torch.float16,),
                         device=dev, contiguous=True)
    for name, t in zip(_CACHE_BUFFERS, (k_cache, k_scale, k_zero, v_cache, v_scale, v_zero,
                                        k_ring, v_ring, lens)):
        _check_base(name, t)
    return Bmax, H, T_cap, R, D


def cache_append(k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                 k_scale: torch.Tensor, k_zero: torch.Tensor, v_cache: torch.Tensor,
                 v_scale: torch.Tensor, v_zero: torch.Tensor, k_ring: torch.Tensor,
                 v_ring: torch.Tensor, lens: torch.Tensor, bits: int, group_size: int) -> None:
    """Append one decode token per slot to the ring, flushing full rings first.

    For every slot ``b < B``: if ``lens[b, 1] == R`` (the ring filled up last step), the R ring
    tokens are quantized into the region at token offset ``lens[b, 0]``, ``lens[b, 0] += R`` and
    ``lens[b, 1] = 0``; then the new token is written at ring index ``lens[b, 1]`` and
    ``lens[b, 1] += 1``. Slots flush independently, driven by their own counters; slots ``>= B``
    are not touched. A full ring whose flush would pass ``T_cap`` is left as it is and the token
    is dropped (size ``T_cap`` so that this never happens).

    Args:
        k_new, v_new: ``(B, H, D)`` in the ring's dtype, ``B <= Bmax``, any strides.
        k_cache ... lens: the layer's whole buffers (module docstring), contiguous, not views.
            Mutated in place; fixed shapes and addresses, so the op can sit in a CUDA graph.
        bits: 2, 4, or 16 (no quantization).
        group_size: 16, 32, 64 or 128; divides R, D and T_cap when bits < 16.

    On CUDA this is two launches. 1: the flush, one program per (slot, head, ring chunk) of about
    G x D keys and values (``_flush_tiles``); programs of slots that do not flush exit at once.
    2: one program per slot writes the new token of every head to the ring and advances
    ``lens``; it runs after the flush has read ring row 0 and the old counters.
    """
    Bmax, H, T_cap, R, D = _check_cache(k_cache, k_scale, k_zero, v_cache, v_scale, v_zero,
                                        k_ring, v_ring, lens, bits, group_size)
    check_tensor("k_new", k_new, shape=(None, H, D), dtypes=(k_ring.dtype,), device=k_ring.device)
    check_tensor("v_new", v_new, shape=tuple(k_new.shape), dtypes=(k_ring.dtype,),
                 device=k_ring.device)
    if not 0 < k_new.shape[0] <= Bmax:
        raise ValueError(f"k_new: expected 1 <= batch <= max_batch_size={Bmax}, "
                         f"got shape {tuple(k_new.shape)}")
    torch.ops.minikv.cache_append(k_new, v_new, k_cache, k_scale, k_zero, v_cache, v_scale,
                                  v_zero, k_ring, v_ring, lens, bits, group_size)


def cache_write_prefill(k_sel: torch.Tensor, v_sel: torch.Tensor, slot: int,
                        k_cache: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
                        v_cache: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor,
                        k_ring: torch.Tensor, v_ring: torch.Tensor, lens: torch.Tensor,
                        bits: int, group_size: int) -> None:
    """Store one sequence's selected prompt tokens in slot ``slot`` (eager, end of prefill).

    The first ``n_q = floor(n / G) * G`` tokens go to the region from token 0 (quantized unless
    ``bits == 16``), the last ``n % G`` to the ring from index 0, and ``lens[slot] = (n_q, n % G)``.
    Other slots are not touched.

    Args:
        k_sel, v_sel: ``(H, n, D)`` in the ring's dtype, tokens in position order, any strides;
            ``n <= T_cap + G - 1``.
        slot: ``0 <= slot < Bmax``.
        k_cache ... lens, bits, group_size: as in :func:`cache_append`.
    """
    Bmax, H, T_cap, R, D = _check_cache(k_cache, k_scale, k_zero, v_cache, v_scale, v_zero,
                                        k_ring, v_ring, lens, bits, group_size)
    check_tensor("k_sel", k_sel, shape=(H, None, D), dtypes=(k_ring.dtype,), device=k_ring.device)
    check_tensor("v_sel", v_sel, shape=tuple(k_sel.shape), dtypes=(k_ring.dtype,),
                 device=k_ring.device)
    n = k_sel.shape[1]
    if n > T_cap + group_size - 1 or n % group_size > R:
        raise ValueError(f"k_sel: expected at most T_cap + G - 1 = {T_cap + group_size - 1} "
                         f"tokens (and n % G <= R = {R}), got shape {tuple(k_sel.shape)}")
    if not (isinstance(slot, int) and 0 <= slot < Bmax):
        raise ValueError(f"slot: expected an int in [0, {Bmax}), got {slot!r}")
    torch.ops.minikv.cache_write_prefill(k_sel, v_sel, slot, k_cache, k_scale, k_zero, v_cache,
                                         v_scale, v_zero, k_ring, v_ring, lens, bits, group_size)
