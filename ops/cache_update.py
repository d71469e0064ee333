"""Writes into the static cache (layout: :mod:`.cache_layout`): one decode step of every layer
(``cache_begin_step`` flushes full rings and advances the counters of the live slots, then
``cache_write_ring`` writes each layer's new token), and the end-of-prefill write of one slot.

Flushes are lazy: a ring that became full at step ``s`` is quantized into the region at the
start of step ``s + 1``, so the attention of step ``s`` still saw it in full precision.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import triton
import triton.language as tl

from . import _gdc as gdc
from ._checks import FLOAT_DTYPES, check_tensor, codes_per_word, sm_count
from .cache_layout import (BUFFER_NAMES, TABLE_COLS, CacheLayout, LayerBuffers, check_base,
                           check_layer, ring_length, table_rows, value_group)
from .quant import (_quantize_key_block, _quantize_value_block, quantize_keys, quantize_keys_ref,
                    quantize_values, quantize_values_ref)

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
                     ROWS: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
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
    x = tl.load(ring_ptr + (bh * ROWS + t) * D + d[None, None, None, :],
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
                        ROWS: tl.constexpr, BITS: tl.constexpr, GV: tl.constexpr,
                        TOKENS: tl.constexpr, BLOCK_NG: tl.constexpr):
    """Quantize ring values [t0, t0 + TOKENS) of one (slot, head), all their channel groups of
    GV channels, into region tokens from ``n_quant + t0``."""
    P: tl.constexpr = 32 // BITS
    W: tl.constexpr = GV // P
    NG = D // GV
    t = t0 + tl.arange(0, TOKENS)
    g = tl.arange(0, BLOCK_NG)
    g_ok = g < NG
    w = tl.arange(0, W)
    p = tl.arange(0, P)
    # -- load [TOKENS, BLOCK_NG, W, P]: channel (g * W + w) * P + p
    c = (g[None, :, None, None] * W + w[None, None, :, None]) * P + p[None, None, None, :]
    x = tl.load(ring_ptr + (bh * ROWS + t[:, None, None, None]) * D + c,
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
                        RING: tl.constexpr, ROWS: tl.constexpr, TOKENS: tl.constexpr,
                        BLOCK_D: tl.constexpr):
    """bits == 16: copy ring tokens [t0, t0 + TOKENS) of one (slot, head) to region tokens from
    ``n_quant + t0``."""
    t = t0 + tl.arange(0, TOKENS)
    d = tl.arange(0, BLOCK_D)
    mask = (t < RING)[:, None] & (d < D)[None, :]
    x = tl.load(ring_ptr + (bh * ROWS + t[:, None]) * D + d[None, :], mask=mask)
    tl.store(cache_ptr + (bh * T_cap + n_quant + t[:, None]) * D + d[None, :], x, mask=mask)


@triton.jit
def _flush_chunk(k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring, bh, n_quant,
                 c, D, T_cap, RING: tl.constexpr, ROWS: tl.constexpr, BITS: tl.constexpr,
                 G: tl.constexpr, GV: tl.constexpr, SPLIT: tl.constexpr, BLOCK_DK: tl.constexpr,
                 TOKENS: tl.constexpr, BLOCK_NG: tl.constexpr, BLOCK_D: tl.constexpr):
    """Chunk ``c`` of the flush of one (slot, head) ring (``bh = slot * H + head``) into region
    tokens from ``n_quant``: with bits < 16, the channel block c % SPLIT of ring key group
    c // SPLIT plus the matching 1 / SPLIT of that group's value tokens; with bits == 16, TOKENS
    ring tokens of K and V (``_flush_tiles``). RING: the tokens a flush moves; ROWS: the ring's
    rows (RING + 1 with a spare row)."""
    if BITS == 16:
        _flush_plain_tokens(k_ring, k_cache, bh, n_quant, c * TOKENS, D, T_cap,
                            RING, ROWS, TOKENS, BLOCK_D)
        _flush_plain_tokens(v_ring, v_cache, bh, n_quant, c * TOKENS, D, T_cap,
                            RING, ROWS, TOKENS, BLOCK_D)
    else:
        j = c // SPLIT
        i = c % SPLIT
        _flush_key_group(k_ring, k_cache, k_scale, k_zero, bh, n_quant, j, i * BLOCK_DK, D,
                         T_cap, ROWS, BITS, G, BLOCK_DK)
        _flush_value_tokens(v_ring, v_cache, v_scale, v_zero, bh, n_quant,
                            j * G + i * TOKENS, D, T_cap, ROWS, BITS, GV, TOKENS, BLOCK_NG)


@triton.jit
def _write_token(k_new, v_new, k_ring, v_ring, b64, index,
                 stride_kb, stride_kh, stride_kd, stride_vb, stride_vh, stride_vd,
                 H, D, RING: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Slot ``b64``'s new k and v of every head -> ring row ``index``."""
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


@triton.jit
def _store_counters(lens, b, write, new_quant, new_ring):
    """``lens[b] = (new_quant, new_ring)`` where ``write``, after the CTA's reads of ``lens[b]``.

    Every thread of the program loaded lens[b] (a value is held by several threads), and a
    thread of another warp may run ahead: the CTA barrier makes all those reads complete before
    any thread overwrites lens[b]."""
    tl.debug_barrier()
    tl.store(lens + 2 * b, new_quant, mask=write)
    tl.store(lens + 2 * b + 1, new_ring, mask=write)


# -- one decode step of every layer: the flushes and counters up front, the ring rows later ----
#
# A launch over all layers reaches their buffers through the layout's address table
# (``CacheLayout.table``). Its columns as kernel constants (a @triton.jit function reads only
# constexpr globals):
_COLS = tl.constexpr(TABLE_COLS)
_LENS_COL = tl.constexpr(8)
_CAP_COL = tl.constexpr(9)


@triton.jit
def _layer_ptr(table, layer, COL: tl.constexpr, DT: tl.constexpr):
    return tl.load(table + layer * _COLS + COL).to(tl.pointer_type(DT))


@triton.jit
def _flush_layers_kernel(
    table, live, L, batch, H, D,
    RING: tl.constexpr, ROWS: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
    GV: tl.constexpr, SPLIT: tl.constexpr, BLOCK_DK: tl.constexpr, TOKENS: tl.constexpr,
    BLOCK_NG: tl.constexpr,
    BLOCK_D: tl.constexpr, CHUNKS: tl.constexpr, RING_DT: tl.constexpr, CODE_DT: tl.constexpr,
    BLOCK_P: tl.constexpr, PDL: tl.constexpr,
):
    # Launch 1 of cache_begin_step: every full ring of every layer, as one list of work items.
    # A (layer, live slot) pair whose ring is full brings H * CHUNKS items (``_flush_tiles``);
    # program p takes items p, p + P, p + 2P, ... of the list. Every
    # program reads all the counters (from L2: 8 bytes a pair) and on the common step, with no
    # full ring, that is all it does: a grid sized to the GPU, not to the possible work.
    gdc.launch_dependents_then_wait(PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    per_pair = H * CHUNKS
    pairs = L * batch
    done = pid * 0  # full rings in the tiles of pairs before this one
    for p0 in range(0, pairs, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        ok = p < pairs
        layer = p // batch
        slot = p % batch
        lens = tl.load(table + layer * _COLS + _LENS_COL, mask=ok, other=0)
        lens = lens.to(tl.pointer_type(tl.int32))
        n_quant = tl.load(lens + 2 * slot, mask=ok, other=0)
        n_ring = tl.load(lens + 2 * slot + 1, mask=ok, other=0)
        t_cap = tl.load(table + layer * _COLS + _CAP_COL, mask=ok, other=0)
        alive = tl.load(live + slot, mask=ok, other=0) != 0
        full = (ok & alive & (n_ring == RING) & (n_quant + RING <= t_cap)).to(tl.int32)
        rank = tl.cumsum(full, 0)           # full rings among pairs [p0, p]
        count = tl.sum(full, 0)
        lo = done * per_pair                # this tile's items: [lo, hi) of the list
        hi = (done + count) * per_pair
        for w in range(lo + (pid - lo % nprog + nprog) % nprog, hi, nprog):
            r = w // per_pair - done        # the item's ring is the tile's r-th full one
            at = tl.sum((rank <= r).to(tl.int32), 0)
            pair = p0 + at
            ly = pair // batch
            item = w % per_pair
            bh = ((pair % batch) * H + item // CHUNKS).to(tl.int64)
            nq = tl.sum(tl.where(p == pair, n_quant, 0), 0)
            cap = tl.load(table + ly * _COLS + _CAP_COL)
            # (with bits == 16 the scale/zero pointers are those of empty buffers, never read)
            _flush_chunk(_layer_ptr(table, ly, 0, CODE_DT), _layer_ptr(table, ly, 1, tl.float16),
                         _layer_ptr(table, ly, 2, tl.float16), _layer_ptr(table, ly, 3, CODE_DT),
                         _layer_ptr(table, ly, 4, tl.float16), _layer_ptr(table, ly, 5, tl.float16),
                         _layer_ptr(table, ly, 6, RING_DT), _layer_ptr(table, ly, 7, RING_DT),
                         bh, nq, item % CHUNKS, D, cap, RING, ROWS, BITS, G, GV, SPLIT,
                         BLOCK_DK, TOKENS, BLOCK_NG, BLOCK_D)
        done += count


@triton.jit
def _commit_kernel(table, live, ring_index, batch, RING: tl.constexpr, BLOCK_B: tl.constexpr,
                   PDL: tl.constexpr):
    # Launch 2 of cache_begin_step, after every flush program has read the counters: one program
    # per layer advances its live slots' counters and says where each one's new token goes.
    gdc.launch_dependents_then_wait(PDL)
    layer = tl.program_id(0)
    lens = _layer_ptr(table, layer, _LENS_COL, tl.int32)
    t_cap = tl.load(table + layer * _COLS + _CAP_COL)
    b = tl.arange(0, BLOCK_B)
    ok = b < batch
    n_quant = tl.load(lens + 2 * b, mask=ok, other=0)
    n_ring = tl.load(lens + 2 * b + 1, mask=ok, other=0)
    alive = tl.load(live + b, mask=ok, other=0) != 0
    _, write, index, new_quant, new_ring = _append_plan(n_quant, n_ring, t_cap, RING)
    write = write & alive
    tl.store(ring_index + layer * batch + b, tl.where(write, index, -1), mask=ok)
    _store_counters(lens, b, ok & write, new_quant, new_ring)


@triton.jit
def _table_row_kernel(row, a0, a1, a2, a3, a4, a5, a6, a7, a8, t_cap):
    # One row of an address table, from scalar arguments: a table written on the device, where
    # a copy from the host would not be allowed (inside a graph capture).
    tl.store(row + 0, a0.to(tl.int64))
    tl.store(row + 1, a1.to(tl.int64))
    tl.store(row + 2, a2.to(tl.int64))
    tl.store(row + 3, a3.to(tl.int64))
    tl.store(row + 4, a4.to(tl.int64))
    tl.store(row + 5, a5.to(tl.int64))
    tl.store(row + 6, a6.to(tl.int64))
    tl.store(row + 7, a7.to(tl.int64))
    tl.store(row + 8, a8.to(tl.int64))
    tl.store(row + 9, t_cap.to(tl.int64))


@triton.jit
def _write_ring_kernel(
    k_new, v_new, k_ring, v_ring, ring_index,
    stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
    H, D, RING: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    # cache_write_ring: program (b, s), all heads: slot b's token s to ring row
    # ring_index[b] + s (the row cache_begin_step gave it, and the rows after).
    gdc.launch_dependents_then_wait(PDL)
    b = tl.program_id(0)
    s = tl.program_id(1)
    index = tl.load(ring_index + b)
    if index >= 0:
        _write_token(k_new + s * stride_ks, v_new + s * stride_vs, k_ring, v_ring,
                     b.to(tl.int64), index + s, stride_kb, stride_kh, stride_kd, stride_vb,
                     stride_vh, stride_vd, H, D, RING, BLOCK_H, BLOCK_D)


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


def _flush_constants(R: int, D: int, bits: int, G: int) -> Tuple[int, dict]:
    """(CHUNKS, the constexprs of ``_flush_chunk``) for rings of R x D tokens."""
    chunks, split, block_dk, tokens = _flush_tiles(R, D, bits, G)
    GV = value_group(G, D)
    return chunks, dict(RING=R, BITS=bits, G=G, GV=GV, SPLIT=split, BLOCK_DK=block_dk,
                        TOKENS=tokens, BLOCK_NG=triton.next_power_of_2(max(D // GV, 1)),
                        BLOCK_D=triton.next_power_of_2(D))


def _write_constants(H: int, D: int) -> dict:
    """BLOCK_H / BLOCK_D of ``_write_token``: all heads of a slot, ~_TILE_ELEMENTS at a time."""
    block_d = triton.next_power_of_2(D)
    return dict(BLOCK_H=max(1, min(triton.next_power_of_2(H), _TILE_ELEMENTS // block_d)),
                BLOCK_D=block_d)


# The flush of cache_begin_step: programs per SM. Enough warps per SM to overlap the dependent
# loads of the items when many rings are full at once (every layer of every slot that started
# together), and one wave, so that the common step (nothing full) costs one launch of L2 reads.
_FLUSH_PROGRAMS_PER_SM = 8
_PAIRS_PER_TILE = 1024  # (layer, slot) counters a flush program holds at once
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _cache_begin_step_triton(table, table_host, k_cache, k_scale, k_zero, v_cache, v_scale,
                             v_zero, k_ring, v_ring, lens, live, batch: int, bits: int,
                             group_size: int) -> torch.Tensor:
    layers = list(zip(k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring, lens))
    L = len(lens)
    _, H, rows_, D = k_ring[0].shape
    R = ring_length(rows_, bits, group_size)
    dev = table.device
    rows = table_rows(layers)
    if tuple(map(tuple, table_host.tolist())) != rows:
        # Not the layout's own buffers (functionalization hands the op copies when it cannot
        # write in place: opcheck, AOT tracing): the kernels must write the tensors they were
        # given, so they get a table of those, written on the device (one launch per layer).
        table = torch.empty(L, TABLE_COLS, dtype=torch.int64, device=dev)
        for layer, row in enumerate(rows):
            _table_row_kernel[(1,)](table[layer], *row)
    ring_index = torch.empty(L, batch, dtype=torch.int32, device=dev)
    chunks, flush = _flush_constants(R, D, bits, group_size)
    pairs = L * batch
    programs = min(_FLUSH_PROGRAMS_PER_SM * sm_count(dev), pairs * H * chunks)
    pdl = gdc.supported(dev)
    ring_dt = _TL_DTYPES[k_ring[0].dtype]
    _flush_layers_kernel[(programs,)](
        table, live, L, batch, H, D, ROWS=rows_, CHUNKS=chunks, RING_DT=ring_dt,
        CODE_DT=ring_dt if bits == 16 else tl.int32,
        BLOCK_P=min(_PAIRS_PER_TILE, triton.next_power_of_2(pairs)), PDL=pdl, launch_pdl=pdl,
        **flush)
    _commit_kernel[(L,)](table, live, ring_index, batch, RING=R,
                         BLOCK_B=triton.next_power_of_2(batch), PDL=pdl, num_warps=1,
                         launch_pdl=pdl)
    return ring_index


def _cache_write_ring_triton(k_new, v_new, k_ring, v_ring, ring_index) -> None:
    if k_new.dim() == 3:  # one token per slot
        k_new, v_new = k_new.unsqueeze(1), v_new.unsqueeze(1)
    B, S, H, D = k_new.shape
    pdl = gdc.supported(k_new.device)
    _write_ring_kernel[(B, S)](
        k_new, v_new, k_ring, v_ring, ring_index, *k_new.stride(), *v_new.stride(), H, D,
        RING=k_ring.shape[2], PDL=pdl, launch_pdl=pdl, **_write_constants(H, D))


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
    GV = value_group(G, k_tok.shape[2])
    codes, scale, zero = quantize_v(v_tok[None], bits, GV)      # (1, H, n, D/P), (1, H, n, D/GV)
    v_cache[slot, :, start:start + n] = codes[0]
    v_scale[slot, :, start:start + n] = scale[0]
    v_zero[slot, :, start:start + n] = zero[0]


def _begin_slot_ref(b, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring, lens,
                    bits: int, group_size: int) -> int:
    """Live slot ``b``'s flush (if its ring is full and the region has room) and counters for one
    new token; returns the ring row the token goes to, or -1 (full ring, no room: no token)."""
    R, T_cap = ring_length(k_ring.shape[2], bits, group_size), v_cache.shape[2]
    n_quant, n_ring = lens[b].tolist()
    flush = n_ring == R and n_quant + R <= T_cap
    if not (n_ring < R or flush):
        return -1
    if flush:
        _store_region(b, n_quant, k_ring[b, :, :R], v_ring[b, :, :R], k_cache, k_scale, k_zero, v_cache,
                      v_scale, v_zero, bits, group_size, quantize_keys_ref, quantize_values_ref)
        n_quant, n_ring = n_quant + R, 0
    lens[b, 0] = n_quant
    lens[b, 1] = n_ring + 1
    return n_ring


def cache_write_ring_ref(k_new, v_new, k_ring, v_ring, ring_index) -> None:
    """Reference for :func:`cache_write_ring`."""
    if k_new.dim() == 3:
        k_new, v_new = k_new.unsqueeze(1), v_new.unsqueeze(1)
    for b, index in enumerate(ring_index.tolist()):
        if index >= 0:
            k_ring[b, :, index:index + k_new.shape[1]] = k_new[b].transpose(0, 1)
            v_ring[b, :, index:index + v_new.shape[1]] = v_new[b].transpose(0, 1)


def cache_begin_step_ref(table, table_host, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero,
                         k_ring, v_ring, lens, live, batch: int, bits: int, group_size: int
                         ) -> torch.Tensor:
    """Reference for :func:`cache_begin_step` (lists of the layers' buffers; tables unused)."""
    ring_index = torch.full((len(lens), batch), -1, dtype=torch.int32, device=lens[0].device)
    alive = live.tolist()
    for layer, bufs in enumerate(zip(k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring,
                                     v_ring, lens)):
        for b in range(batch):
            if alive[b]:
                ring_index[layer, b] = _begin_slot_ref(b, *bufs, bits, group_size)
    return ring_index


# ----------------------------------------------------------------------------------------------
# Registered ops
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("minikv::cache_write_prefill", mutates_args=BUFFER_NAMES)
def _cache_write_prefill_op(k_sel: torch.Tensor, v_sel: torch.Tensor, slot: int,
                            k_cache: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
                            v_cache: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor,
                            k_ring: torch.Tensor, v_ring: torch.Tensor, lens: torch.Tensor,
                            bits: int, group_size: int, ring_tokens: int) -> None:
    # One implementation for every device: the quantize ops dispatch to Triton on CUDA.
    n = k_sel.shape[1]
    n_quant = n - ring_tokens
    if n_quant:
        _store_region(slot, 0, k_sel[:, :n_quant], v_sel[:, :n_quant], k_cache, k_scale, k_zero,
                      v_cache, v_scale, v_zero, bits, group_size, quantize_keys, quantize_values)
    k_ring[slot, :, : n - n_quant] = k_sel[:, n_quant:]
    v_ring[slot, :, : n - n_quant] = v_sel[:, n_quant:]
    lens[slot, 0].fill_(n_quant)  # fill_ with a Python int: no host-to-device copy
    lens[slot, 1].fill_(n - n_quant)


@_cache_write_prefill_op.register_fake
def _(k_sel, v_sel, slot, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring,
      lens, bits, group_size, ring_tokens):
    return None


@torch.library.custom_op("minikv::cache_begin_step", mutates_args=BUFFER_NAMES[:6] + ("lens",))
def _cache_begin_step_op(table: torch.Tensor, table_host: torch.Tensor,
                         k_cache: List[torch.Tensor], k_scale: List[torch.Tensor],
                         k_zero: List[torch.Tensor], v_cache: List[torch.Tensor],
                         v_scale: List[torch.Tensor], v_zero: List[torch.Tensor],
                         k_ring: List[torch.Tensor], v_ring: List[torch.Tensor],
                         lens: List[torch.Tensor], live: torch.Tensor, batch: int, bits: int,
                         group_size: int) -> torch.Tensor:
    return cache_begin_step_ref(table, table_host, k_cache, k_scale, k_zero, v_cache, v_scale,
                                v_zero, k_ring, v_ring, lens, live, batch, bits, group_size)


@_cache_begin_step_op.register_fake
def _(table, table_host, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring, lens,
      live, batch, bits, group_size):
    return table.new_empty(len(lens), batch, dtype=torch.int32)


_cache_begin_step_op.register_kernel("cuda")(_cache_begin_step_triton)


@torch.library.custom_op("minikv::cache_write_ring", mutates_args=("k_ring", "v_ring"))
def _cache_write_ring_op(k_new: torch.Tensor, v_new: torch.Tensor, k_ring: torch.Tensor,
                         v_ring: torch.Tensor, ring_index: torch.Tensor) -> None:
    cache_write_ring_ref(k_new, v_new, k_ring, v_ring, ring_index)


@_cache_write_ring_op.register_fake
def _(k_new, v_new, k_ring, v_ring, ring_index):
    return None


_cache_write_ring_op.register_kernel("cuda")(_cache_write_ring_triton)


# ----------------------------------------------------------------------------------------------
# Public wrappers
# ----------------------------------------------------------------------------------------------


def _check_new_tokens(k_new: torch.Tensor, v_new: torch.Tensor, k_ring: torch.Tensor) -> None:
    Bmax, H, R, D = k_ring.shape
    if k_new.dim() == 4:  # (B, S, H, D): S consecutive tokens per slot
        check_tensor("k_new", k_new, shape=(None, None, H, D), dtypes=(k_ring.dtype,),
                     device=k_ring.device)
        if not 0 < k_new.shape[1] <= R:
            raise ValueError(f"k_new: expected 1 <= tokens per slot (dim 1) <= ring rows={R}, "
                             f"got shape {tuple(k_new.shape)}")
    else:
        check_tensor("k_new", k_new, shape=(None, H, D), dtypes=(k_ring.dtype,),
                     device=k_ring.device)
    check_tensor("v_new", v_new, shape=tuple(k_new.shape), dtypes=(k_ring.dtype,),
                 device=k_ring.device)
    if not 0 < k_new.shape[0] <= Bmax:
        raise ValueError(f"k_new: expected 1 <= batch <= max_batch_size={Bmax}, "
                         f"got shape {tuple(k_new.shape)}")


def cache_begin_step(layout: CacheLayout, batch: int, live: torch.Tensor) -> torch.Tensor:
    """Start one decode step of every layer: flush full rings, advance the counters, and say
    which ring row each live slot's new token goes to. :func:`cache_write_ring` then writes the
    token, layer by layer.

    For every layer ``l`` and live slot ``b < batch``: a full ring with room in the region is
    quantized into it (``lens[b] = (n_quant + R, 0)``); then the slot takes a token at ring row
    ``i = lens[b, 1]``, ``lens[b, 1] += 1``, and ``ring_index[l, b] = i``. A full ring without
    room is left as it is and ``ring_index[l, b] = -1`` (the engine sizes ``T_cap`` so that this
    never happens). Slots that are not live, and slots ``>= batch``, are not touched (-1).
    Between this op and the ring writes, ``lens`` counts a token that is not in the ring yet:
    write it before anything reads the ring.

    Why all layers at once: a per-layer flush launch does nothing on 127 steps of 128 but still
    sits on the step's critical path; here every layer's flushes and counters are two launches
    per step, and a layer keeps one small launch (the ring write).

    Args:
        layout: the cache (mutated in place: the regions and ``lens``); the kernels reach the
            layers through ``layout.table``.
        batch: slots ``[0, batch)`` are stepped; ``1 <= batch <= Bmax``.
        live: ``(batch,)`` bool: which of them hold a request that is still generating.

    Returns:
        ``ring_index (L, batch)`` int32: the ring row of each slot's new token, or -1.

    On CUDA this is two launches. 1: the flushes of every layer as one list of work items over a
    grid sized to the GPU; on a step with no full ring each program reads the counters and ends.
    2: one program per layer advances its counters after launch 1 has read them.
    """
    if not isinstance(layout, CacheLayout):
        raise ValueError(f"layout: expected a CacheLayout, got {type(layout).__name__}")
    if not (isinstance(batch, int) and 0 < batch <= layout.max_batch_size):
        raise ValueError(f"batch: expected an int in [1, max_batch_size={layout.max_batch_size}],"
                         f" got {batch!r}")
    check_tensor("live", live, shape=(batch,), dtypes=(torch.bool,), device=layout.device,
                 contiguous=True)
    return torch.ops.minikv.cache_begin_step(layout.table, layout.table_host, *layout.columns(),
                                             live, batch, layout.bits, layout.group_size)


def cache_write_ring(k_new: torch.Tensor, v_new: torch.Tensor, k_ring: torch.Tensor,
                     v_ring: torch.Tensor, ring_index: torch.Tensor) -> None:
    """Write each slot's new k and v to the ring row :func:`cache_begin_step` gave it:
    ``k_ring[b, :, i] = k_new[b]`` (and v) for ``i = ring_index[b] >= 0``; slots with -1 and
    slots ``>= B`` are not touched. With S tokens per slot (SpeCache's token and speculation),
    token s goes to row ``i + s``: the rows after the counted one, which ``lens`` does not count.

    Args:
        k_new, v_new: ``(B, H, D)``, or ``(B, S, H, D)`` for S tokens per slot, in the ring's
            dtype, ``B <= Bmax``, any strides.
        k_ring, v_ring: one layer's rings ``(Bmax, H, R, D)``, contiguous, not views; mutated.
        ring_index: ``(B,)`` int32, contiguous: that layer's row of ``cache_begin_step``'s
            result (values in ``[-1, R - S]``: a ring of ``R + 1`` rows has the spare row the
            second of two tokens needs when the first fills the ring).
    """
    check_tensor("k_ring", k_ring, ndim=4, dtypes=FLOAT_DTYPES, contiguous=True)
    check_tensor("v_ring", v_ring, shape=tuple(k_ring.shape), dtypes=(k_ring.dtype,),
                 device=k_ring.device, contiguous=True)
    for name, t in (("k_ring", k_ring), ("v_ring", v_ring)):
        check_base(name, t)
    _check_new_tokens(k_new, v_new, k_ring)
    check_tensor("ring_index", ring_index, shape=(k_new.shape[0],), dtypes=(torch.int32,),
                 device=k_ring.device, contiguous=True)
    torch.ops.minikv.cache_write_ring(k_new, v_new, k_ring, v_ring, ring_index)


def cache_write_prefill(k_sel: torch.Tensor, v_sel: torch.Tensor, slot: int,
                        layer: LayerBuffers, bits: int, group_size: int,
                        ring_tokens: Optional[int] = None) -> None:
    """Store one sequence's selected prompt tokens in slot ``slot`` of one layer (eager, end of
    prefill).

    The first ``n_q = n - ring_tokens`` tokens go to the region from token 0 (quantized unless
    ``bits == 16``), the last ``ring_tokens`` to the ring from index 0, and
    ``lens[slot] = (n_q, ring_tokens)``. ``ring_tokens`` (default ``n % G``, the fewest) must
    leave ``n_q`` a multiple of G and fit the ring. Other slots are not touched.

    Args:
        k_sel, v_sel: ``(H, n, D)`` in the ring's dtype, tokens in position order, any strides;
            ``n <= T_cap + G - 1``.
        slot: ``0 <= slot < Bmax``.
        layer: the layer's nine buffers (``CacheLayout.layers[l]``, or any sequence of them in
            that order), mutated in place.
        bits, group_size: the layout's.
    """
    Bmax, H, T_cap, R, D = check_layer(layer, bits, group_size)
    k_ring = layer[6]
    check_tensor("k_sel", k_sel, shape=(H, None, D), dtypes=(k_ring.dtype,), device=k_ring.device)
    check_tensor("v_sel", v_sel, shape=tuple(k_sel.shape), dtypes=(k_ring.dtype,),
                 device=k_ring.device)
    n = k_sel.shape[1]
    t = n % group_size if ring_tokens is None else ring_tokens
    if not (isinstance(t, int) and 0 <= t <= min(n, R) and (n - t) % group_size == 0):
        raise ValueError(f"ring_tokens: expected an int in [0, min(n, R) = {min(n, R)}] leaving "
                         f"a multiple of G = {group_size} of the n = {n} tokens, got {t!r}")
    if n - t > T_cap:
        raise ValueError(f"k_sel: expected at most T_cap = {T_cap} tokens besides the "
                         f"{t} for the ring, got shape {tuple(k_sel.shape)}")
    if not (isinstance(slot, int) and 0 <= slot < Bmax):
        raise ValueError(f"slot: expected an int in [0, {Bmax}), got {slot!r}")
    torch.ops.minikv.cache_write_prefill(k_sel, v_sel, slot, *layer, bits, group_size, t)
