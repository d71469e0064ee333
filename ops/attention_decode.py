"""Decode attention over the compressed KV cache: one new query token per sequence.

For every active slot ``b`` of the static cache and query head ``i`` (KV head
``i // (H_q / H_kv)``)::

    K_b = [dequant(k_cache[b, :, :lens[b, 0]]) ; k_ring[b, :, :lens[b, 1]]]      (T_b, D)
    V_b = [dequant(v_cache[b, :, :lens[b, 0]]) ; v_ring[b, :, :lens[b, 1]]]
    out[b, i] = softmax(q[b, i] . K_b^T * scale) . V_b

This is the decode hot path: it reads every KV byte it attends to exactly once, so it should run
at memory bandwidth. Flash-decoding in two launches:

1. the split launch, grid ``(B, H_kv, NUM_SPLITS + 1)``. Program ``(b, h, s)`` serves *all*
   query heads of KV group ``h`` from one read of K/V. Programs ``s < NUM_SPLITS`` cover an
   equal, block-aligned share of the slot's *valid* quantized tokens (the share is computed on
   the device from ``lens[b, 0]``, so work tracks tokens held, not capacity); program
   ``s == NUM_SPLITS`` covers the fp ring. Each writes a partial ``(m, l, acc)``; one with no
   tokens writes ``(-inf, 0, 0)``.
2. ``_decode_attention_combine_kernel``, grid ``(B * H_q, D / 32)``, merges the partials into
   ``out``.

The split launch runs one of two kernels, chosen by ``_plan`` (the only dispatch):

* ``_decode_attention_split_kernel`` (Triton). Its dots put the block's tokens on the
  tensor-core M axis and the group's heads, padded to 8, on N (``scores^T = K q^T``,
  ``acc^T += V^T p^T``): padding heads to the 16 rows of M instead cost ~10% more instructions
  per cached value. K and V are dequantized in registers right before the two dots; softmax is
  online, in fp32, with exp2. fp16/bf16 models dequantize 1/2/4-bit codes with packed fp16x2
  integer tricks and fp16 dots (``_dequant_last_half2``: lop3 + sub.f16x2 + fma.rn.f16x2 per 2
  values), 1.55x faster than one fp32 FMA per code on the H200 (bits 2, B 8, 16k: 113 against
  175 us); fp32 models take that fp32 path (``_dequant_last``), bits 16 no dequantization.
* ``_decode_attention_fragments_kernel`` (Gluon, :mod:`.attention_decode_gluon`) for large
  launches with 2-bit codes, group 16, D 128, fp16/bf16: it unpacks the codes straight into the
  tensor-core fragments instead of staging dequantized tiles through shared memory (batch 8 x
  16k on the H200: 1.23x the Triton kernel).

The "half2" tiles come out in a "pair order" that the other operand follows for free (the
probabilities are permuted back to token order as they are stored for the second dot; acc rows
are stored to the values' channels). Not bit-exact with the reference (fp16 instead of
model-dtype operands and probabilities; for bf16 models that is more precise): held, like every
path, to twice the error of a same-precision PyTorch attention against fp64.

``minikv::decode_attention_recall`` (SpeCache, :mod:`.attention_decode_recall`) runs the same
two launches under the split kernel's constexpr ``RECALL``.

``NUM_SPLITS`` depends only on shapes and the GPU's SM count (never on ``lens``), so the op has
fixed shapes, never syncs with the host, and can be captured in a CUDA graph. It is a run-time
argument, so batch sizes share one compiled kernel. The history of both kernels (versions,
instruction counts of the compiled loops, Nsight Compute accounts) is in ``perf/NOTES.md``,
"Decode attention".
"""
from __future__ import annotations

import os
from typing import NamedTuple, Optional, Union

import torch
import triton
import triton.language as tl

from . import _gdc as gdc
from ._checks import (FLOAT_DTYPES, check_choice, check_tensor,
                      codes_per_word, compiled_major, sm_count as sm_count_of)
from . import attention_decode_gluon as dag
from .cache_layout import check_layer, ring_length, value_group
from .quant import dequantize_keys_ref, dequantize_values_ref
from . import recall as rc

_LOG2E = 1.4426950408889634

_HEAD_DIMS = (16, 32, 64, 128, 256)

# The kernels of the split launch (``_Plan.kernel``): the Triton kernel, and the Gluon kernel of
# ``attention_decode_gluon`` (codes unpacked straight into mma fragments) where it covers the call.
SPLIT = "split"
FRAGMENTS = "fragments"
KERNELS = (SPLIT, FRAGMENTS)
# Query heads per KV head at most: the dots' N axis holds them, padded to 8 (BLOCK_H).
MAX_GQA = 8
# Splits of the quantized region per (slot, KV head) at most: the combine loads all of them at once.
MAX_SPLITS = 128


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _round_to(x, DTYPE: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    """fp32 -> DTYPE, round to nearest even.

    BF16_BY_HAND (interpreter only): Triton's interpreter truncates fp32 -> bf16 casts (triton 3.9),
    which biases every rounded value toward zero; there the rounding is done on the bits and the
    result, exactly representable in bf16, stays fp32 (the interpreter's dots run in fp32).
    """
    if BF16_BY_HAND:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(DTYPE)


@triton.jit
def _shift_tree(words, BITS: tl.constexpr):
    """(R, C) int32 words of P = 32 / BITS codes -> (R, C * P / 2): element c * P / 2 + j is
    ``words[r, c] >> (j * BITS)``, which holds code j at bit 0 and code j + P / 2 at bit 16.
    Interleaving puts the new elements in the thread that loaded the word: no data crosses
    threads."""
    H: tl.constexpr = 32 // BITS // 2
    x = words
    for level in tl.static_range(4):
        if (1 << level) < H:
            x = tl.interleave(x, x >> ((H // 2 >> level) * BITS))
    return x


@triton.jit
def _per_pair(x, G: tl.constexpr):
    """(R, C * P / G) -> (R, C * P / 2): one scale or zero per element of ``_shift_tree``'s
    output (a word never spans two groups: G is a multiple of P)."""
    for level in tl.static_range(7):
        if (1 << level) < G // 2:
            x = tl.interleave(x, x)
    return x


@triton.jit
def _dequant_last(words, scale, zero, BITS: tl.constexpr, G: tl.constexpr):
    """Dequantize along the last axis.

    words: (R, C) int32, each packing P = 32 / BITS codes (code j of word c is element c * P + j,
    at bits j * BITS); scale, zero: (R, C * P / G) fp16, one per G consecutive elements.
    Returns (R, C * P) fp32: code * scale + zero.

    Every step keeps a word's codes in the thread that loaded it (interleave and join add their
    new elements inside the thread; the final permute only relabels registers), so nothing moves
    through shared memory and each thread ends up with P consecutive values, stored to shared
    memory for the dots as 16-byte vectors. Unpacking with one broadcast shift per code and a
    reshape instead compiled to per-value shared-memory shuffles (11.8 vs 7.4 instructions per
    value before the other changes).
    """
    P: tl.constexpr = 32 // BITS
    H: tl.constexpr = P // 2
    R: tl.constexpr = words.shape[0]
    C: tl.constexpr = words.shape[1]
    x = _shift_tree(words, BITS)
    # -- codes j and j + H sit at bits 0 and 16 of x: one mask isolates both (and drops the sign
    #    bits the arithmetic >> dragged in). Read as fp16, each half is the subnormal code * 2^-24;
    #    widening it to fp32 is exact, one HADD2.F32 per value instead of a quarter-rate
    #    int-to-float conversion (I2F); the "half2" path avoids the widening (and the cast back to
    #    the model dtype) altogether. Multiplying the scale by 2^24 (exact)
    #    makes the FMA below compute code * s + z with the single rounding of the reference.
    y = x & (((1 << BITS) - 1) * 0x10001)
    lo = y.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (y >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    # -- scale/zero: one value per (word, j), like lo and hi
    s = _per_pair(scale.to(tl.float32) * 16777216.0, G)
    z = _per_pair(zero.to(tl.float32), G)
    lo = lo * s + z
    hi = hi * s + z
    # -- back to natural order: (R, C, H, 2) -> (R, C, 2, H), relabelling registers only
    out = tl.join(tl.reshape(lo, (R, C, H)), tl.reshape(hi, (R, C, H)))
    return tl.reshape(tl.permute(out, (0, 1, 3, 2)), (R, C * P))


# One int32 holding two codes (at bits 0 and 16; the bits above each code are garbage) -> the two
# values code * scale + zero as fp16, each rounded once. lop3 masks the codes and ORs in the
# exponent of 1024.0 (0x6400: fp16 1024 + code, exact), sub.f16x2 removes the 1024, fma.rn.f16x2
# applies scale and zero to both halves: 3 instructions per 2 values (the fp32 path needs ~7).
# $3/$4 are the same fp16 scale/zero for both halves; ptxas reads them as .H0_H0 operands.
def _half2_asm(mask: int) -> tl.constexpr:
    return tl.constexpr(f"""{{
    .reg .b32 t, m, s2, z2;
    lop3.b32 t, $2, {mask:#010x}, 0x64006400, 0xea;
    mov.b32 m, 0x64006400;
    sub.f16x2 t, t, m;
    mov.b32 s2, {{$3, $3}};
    mov.b32 z2, {{$4, $4}};
    fma.rn.f16x2 t, t, s2, z2;
    mov.b32 {{$0, $1}}, t;
}}""")


_HALF2_ASM_1BIT = _half2_asm(0x00010001)
_HALF2_ASM_2BIT = _half2_asm(0x00030003)
_HALF2_ASM_4BIT = _half2_asm(0x000F000F)


@triton.jit
def _code_pairs_to_half(x, s, z, BITS: tl.constexpr, INTERPRET: tl.constexpr):
    """x: int32 with one code at bits 0 and one at bits 16; s, z: fp16, same shape.
    Returns (lo, hi) fp16: code * s + z for the low and the high code, rounded once to fp16."""
    if INTERPRET:
        # The interpreter has no inline PTX: the same values from fp32 math (code * s exact).
        mask: tl.constexpr = (1 << BITS) - 1
        sf = s.to(tl.float32)
        zf = z.to(tl.float32)
        lo = ((x & mask).to(tl.float32) * sf + zf).to(tl.float16)
        hi = (((x >> 16) & mask).to(tl.float32) * sf + zf).to(tl.float16)
    elif BITS == 1:
        lo, hi = tl.inline_asm_elementwise(_HALF2_ASM_1BIT, "=h,=h,r,h,h", [x, s, z],
                                           dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
    elif BITS == 2:
        lo, hi = tl.inline_asm_elementwise(_HALF2_ASM_2BIT, "=h,=h,r,h,h", [x, s, z],
                                           dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
    else:
        lo, hi = tl.inline_asm_elementwise(_HALF2_ASM_4BIT, "=h,=h,r,h,h", [x, s, z],
                                           dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
    return lo, hi


@triton.jit
def _opaque(x):
    """Identity on fp16 (at most a register move per 2 values) that Triton's
    dot-operand heuristics cannot see through. See the kWidth note in
    ``_decode_attention_split_kernel``."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float16,
                                     is_pure=False, pack=2)


@triton.jit
def _dequant_last_half2(words, scale, zero, BITS: tl.constexpr, G: tl.constexpr,
                        INTERPRET: tl.constexpr):
    """Dequantize along the last axis to fp16, in *pair order*.

    words: (R, C) int32, each packing P = 32 / BITS codes (code j at bits j * BITS); scale, zero:
    (R, C * P / G) fp16. Returns (R, C * P) fp16 whose element c * P + i holds code
    ``_pair_order`` (i) of word c: codes j and j + P / 2 sit at bits 0 and 16 of ``word >> (j *
    BITS)``, so one packed fp16x2 register holds that pair, and keeping the pair adjacent is what
    lets it go to shared memory as is (natural order would cost a PRMT per 2 values). Callers
    permute the other operand instead: keys' tokens -> the order of the probabilities' rows;
    values' channels -> the rows the accumulator is stored to.
    """
    P: tl.constexpr = 32 // BITS
    R: tl.constexpr = words.shape[0]
    C: tl.constexpr = words.shape[1]
    lo, hi = _code_pairs_to_half(_shift_tree(words, BITS), _per_pair(scale, G),
                                 _per_pair(zero, G), BITS, INTERPRET)
    out = tl.reshape(tl.join(lo, hi), (R, C * P))
    if not INTERPRET:
        out = _opaque(out)
    return out


@triton.jit
def _pair_order(N: tl.constexpr, P: tl.constexpr):
    """(N,) int32: element i of a pair-ordered axis (see ``_dequant_last_half2``) is element
    ``_pair_order(N, P)[i]`` of the natural axis."""
    i = tl.arange(0, N)
    return i // P * P + (i % 2) * (P // 2) + (i % P) // 2


@triton.jit
def _unpair_rows(x, P: tl.constexpr):
    """(N, C) with rows in pair order (``_pair_order(N, P)``) -> rows in natural order."""
    N: tl.constexpr = x.shape[0]
    C: tl.constexpr = x.shape[1]
    x = tl.reshape(x, (N // P, P // 2, 2, C))
    return tl.reshape(tl.permute(x, (0, 2, 1, 3)), (N, C))


@triton.jit
def _interleave_rows(x, V: tl.constexpr):
    """(R, C) -> (R, C), row p = row (p % (R / V)) * V + p // (R / V) of x: rows that sat V to a
    thread (a 16-byte load) end up 1 apart across lanes. Only relabels registers; see the bank
    note in ``_decode_attention_split_kernel``."""
    R: tl.constexpr = x.shape[0]
    C: tl.constexpr = x.shape[1]
    return tl.reshape(tl.permute(tl.reshape(x, (R // V, V, C)), (1, 0, 2)), (R, C))


@triton.jit
def _spread_words(x, W: tl.constexpr):
    """(R, C) -> (R, C), the C columns being W words of C / W columns each (W >= 8): word
    4 k + j (the j-th of the 4 words that lane k of a row loads as 16 bytes) moves to position
    8 (j // 2) + 2 k + j % 2, so that the lanes sharing a row store to different banks.
    Only relabels registers; see the bank note in ``_decode_attention_split_kernel``."""
    R: tl.constexpr = x.shape[0]
    C: tl.constexpr = x.shape[1]
    x = tl.reshape(x, (R, W // 4, 2, 2, C // W))
    return tl.reshape(tl.permute(x, (0, 2, 1, 3, 4)), (R, C))


@triton.jit
def _load_keys_t(k_plane, ks_plane, kz_plane, start, hi,
                 D: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr):
    """The packed keys of tokens [start, start + BLOCK_N) of one (slot, KV head) plane, with the
    packed (token) axis last, where the dequantizers unpack: words (D, BLOCK_N / P) int32, and
    each word's scale and zero, (D, BLOCK_N / P) fp16 (dequantize with group P). A group of G > P
    tokens is loaded once per word (the same addresses, cached): scales of the words' shape stay
    in the words' threads, where (D, BLOCK_N / G) went through shared memory at every block (16
    barriers more than group 16's in the split kernel's loop at group 64, sm_90).

    k_plane: the plane's codes, (T_CAP / P, D) int32, token t in row t // P at bits
    (t % P) * BITS. ks_plane, kz_plane: its scales/zeros, (T_CAP / G, D) fp16 (one group = one
    channel over G tokens). Tokens >= hi read as 0 (nothing beyond the valid length is touched).
    """
    P: tl.constexpr = 32 // BITS
    offs_d = tl.arange(0, D)
    rows = start // P + tl.arange(0, BLOCK_N // P)
    mask = (rows * P < hi)[None, :]
    words = tl.load(k_plane + rows[None, :] * D + offs_d[:, None], mask=mask, other=0)
    # rows // 1 at G == P: rows stay contiguous to the compiler (rows * P // G would hide it)
    sz_offs = (rows // (G // P))[None, :] * D + offs_d[:, None]
    scale = tl.load(ks_plane + sz_offs, mask=mask, other=0.0)
    zero = tl.load(kz_plane + sz_offs, mask=mask, other=0.0)
    return words, scale, zero


@triton.jit
def _load_values(v_plane, vs_plane, vz_plane, tokens, valid,
                 D: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr):
    """The packed values of ``tokens`` (BLOCK_N,) of one plane: words (BLOCK_N, D / P) int32,
    scale and zero (BLOCK_N, D / G) fp16; invalid rows read 0.

    v_plane: the plane's codes, (T_CAP, D / P) int32, channel c in column c // P at bits
    (c % P) * BITS. vs_plane, vz_plane: (T_CAP, D / G) fp16 (one group = G channels of one token).
    """
    P: tl.constexpr = 32 // BITS
    cols = tl.arange(0, D // P)
    words = tl.load(v_plane + tokens[:, None] * (D // P) + cols[None, :],
                    mask=valid[:, None], other=0)
    gcols = tl.arange(0, D // G)
    sz_offs = tokens[:, None] * (D // G) + gcols[None, :]
    scale = tl.load(vs_plane + sz_offs, mask=valid[:, None], other=0.0)
    zero = tl.load(vz_plane + sz_offs, mask=valid[:, None], other=0.0)
    return words, scale, zero


@triton.jit
def _softmax_step(s, valid, m_i):
    """Online-softmax step. s: (BLOCK_N, BLOCK_H) fp32 scores in the log2 domain; valid:
    (BLOCK_N,); m_i: (BLOCK_H,) running max. Returns the new max, the factor alpha (BLOCK_H,)
    that rescales what was accumulated so far, and p = exp2(s - new max), 0 where invalid."""
    s = tl.where(valid[:, None], s, float("-inf"))
    # Every block holds >= 1 valid token, so m_new is finite and exp2(-inf - m_new) == 0.
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    return m_new, tl.exp2(m_i - m_new), tl.exp2(s - m_new[None, :])


@triton.jit
def _keys_step_half2(kw, ks, kz, valid, q_h, qk_scale, m_i, l_rows,
                     BITS: tl.constexpr, INTERPRET: tl.constexpr):
    """First half of a "half2" block: dequantize the loaded keys (``_load_keys_t``), score them
    against q_h (D, BLOCK_H) fp16 and take the online-softmax step. valid: (BLOCK_N,) in the
    keys' pair order, like the rows of s and p. Returns (m_i, alpha, p, l_rows)."""
    k_t = _interleave_rows(_dequant_last_half2(kw, ks, kz, BITS, 32 // BITS, INTERPRET), 4)
    s = tl.dot(tl.trans(k_t), q_h) * qk_scale                             # (BLOCK_N, BLOCK_H)
    m_i, alpha, p = _softmax_step(s, valid, m_i)
    return m_i, alpha, p, l_rows * alpha[None, :] + p


@triton.jit
def _values_step_half2(vw, vs, vz, p, alpha, acc, D: tl.constexpr, BITS: tl.constexpr,
                       G: tl.constexpr, INTERPRET: tl.constexpr):
    """Second half: dequantize the loaded values (``_load_values``, rows in token order) and
    accumulate p^T V into acc (D, BLOCK_H), its rows in the values' pair order."""
    P: tl.constexpr = 32 // BITS
    v = _dequant_last_half2(vw, vs, vz, BITS, G, INTERPRET)                # (BLOCK_N, D) fp16
    if D // P >= 8:
        v = _spread_words(v, D // P)
    p_nat = _unpair_rows(p.to(tl.float16), P)
    return acc * alpha[None, :] + tl.dot(tl.trans(v), p_nat)


@triton.jit
def _attend_block(q_t, k_t, v, valid, m_i, l_i, acc, qk_scale, ELEM: tl.constexpr,
                  DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                  BF16_BY_HAND: tl.constexpr):
    """One online-softmax step over a block of BLOCK_N tokens, heads on the dots' N axis.

    q_t: (D, BLOCK_H) in DOT_DTYPE; k_t: (D, BLOCK_N) and v: (BLOCK_N, D) holding model-dtype
    (ELEM) values; valid: (BLOCK_N,) bool. m_i, l_i: (BLOCK_H,) fp32 running max (log2 domain) and
    denominator; acc: (D, BLOCK_H) fp32. Transposes only relabel (registers or shared memory).
    """
    s = tl.dot(tl.trans(k_t.to(DOT_DTYPE)), q_t, input_precision=INPUT_PRECISION) * qk_scale
    m_new, alpha, p = _softmax_step(s, valid, m_i)                      # (BLOCK_N, BLOCK_H)
    l_i = l_i * alpha + tl.sum(p, axis=0)
    # p is rounded to the model dtype like in any fp16/bf16 flash attention.
    p_lo = _round_to(p, ELEM, BF16_BY_HAND).to(DOT_DTYPE)
    pv = tl.dot(tl.trans(v.to(DOT_DTYPE)), p_lo, input_precision=INPUT_PRECISION)  # (D, BLOCK_H)
    return m_new, l_i, acc * alpha[None, :] + pv


@triton.jit
def _load_rows(k_base, v_base, rows, valid, D: tl.constexpr):
    """Rows ``rows`` (BLOCK_N,) of a (rows, D) K and V in the model dtype, the ring's layout and
    the recall buffers': k_t (D, BLOCK_N), v (BLOCK_N, D); invalid rows read 0."""
    offs_d = tl.arange(0, D)
    k_t = tl.load(k_base + rows[None, :] * D + offs_d[:, None], mask=valid[None, :], other=0.0)
    v = tl.load(v_base + rows[:, None] * D + offs_d[None, :], mask=valid[:, None], other=0.0)
    return k_t, v


@triton.jit
def _attend_block_masked(q_t, k_t, v, valid, m_i, l_i, acc, qk_scale, ELEM: tl.constexpr,
                         DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                         BF16_BY_HAND: tl.constexpr):
    """``_attend_block`` for the recall launch: ``valid`` per (token, column), (BLOCK_N, BLOCK_H)
    or (BLOCK_N, 1) bool (the ring is causal across query rows, recalled tokens leave the
    quantized blocks), and the probabilities returned for the attention mass. A column may have
    no valid token in a block: m_i starts at a finite floor there, not at -inf (-inf - -inf would
    be NaN). Returns (m_i, l_i, acc, p), p (BLOCK_N, BLOCK_H) fp32, 0 where invalid."""
    s = tl.dot(tl.trans(k_t.to(DOT_DTYPE)), q_t, input_precision=INPUT_PRECISION) * qk_scale
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[None, :])
    l_i = l_i * alpha + tl.sum(p, axis=0)
    p_lo = _round_to(p, ELEM, BF16_BY_HAND).to(DOT_DTYPE)
    pv = tl.dot(tl.trans(v.to(DOT_DTYPE)), p_lo, input_precision=INPUT_PRECISION)  # (D, BLOCK_H)
    return m_new, l_i, acc * alpha[None, :] + pv, p


@triton.jit
def _decode_attention_split_kernel(
    q_ptr, k_ptr, ks_ptr, kz_ptr, v_ptr, vs_ptr, vz_ptr, kr_ptr, vr_ptr, lens_ptr,
    m_ptr, l_ptr, acc_ptr,
    bm_ptr, rk_ptr, rv_ptr, ridx_ptr, lse_ref_ptr, mass_ptr, layer_ptr,
    qk_scale,
    stride_qb, stride_qr, stride_qh, stride_qd, stride_lb, stride_lh,
    H_KV, T_CAP, R, NUM_SPLITS, K_REC, T_MASS, N_LAYERS, R_FLUSH,
    GQA: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr,
    RECALL: tl.constexpr,
    BITS: tl.constexpr, G: tl.constexpr, GV: tl.constexpr, BLOCK_N: tl.constexpr,
    HALF2: tl.constexpr,
    DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, BF16_BY_HAND: tl.constexpr,
    INTERPRET: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
):
    """Program (b, h, s); ``_decode_attention_triton`` and ``_decode_attention_recall_triton``
    give the layouts. ROWS: query rows per slot (q (B, ROWS, H_q, D), partials (B * ROWS, H_q,
    S)); column n of the dots' N axis is row n // GQA, query head h * GQA + n % GQA. RECALL: the
    recall launch (bitmap, recall rows, the mass of the last row, causal ring rows); without
    it, the pointers and strides of the recall arguments are never read."""
    gdc.launch_dependents_then_wait(PDL)  # nothing is read or written before this
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    # int64: Bmax * H_kv * T_cap * D exceeds 2^31 for large caches; offsets inside one plane fit.
    plane = b.to(tl.int64) * H_KV + h
    # Clamping keeps a corrupt length from reading outside the buffers.
    n_quant = tl.minimum(tl.load(lens_ptr + 2 * b), T_CAP)
    n_ring = tl.load(lens_ptr + 2 * b + 1)
    if RECALL:  # lens counts row 0's token; the later rows' follow it in the ring, uncounted
        n_ring += ROWS - 1
    n_ring = tl.minimum(n_ring, R)

    # columns >= ROWS * GQA are padding for tl.dot: q = 0, never stored
    heads = tl.arange(0, BLOCK_H)
    head_ok = heads < ROWS * GQA
    offs_d = tl.arange(0, D)
    if ROWS == 1:
        q_cols = (h * GQA + heads) * stride_qh
    else:
        q_cols = heads // GQA * stride_qr + (h * GQA + heads % GQA) * stride_qh
    q_t = tl.load(q_ptr + b * stride_qb + q_cols[None, :] + offs_d[:, None] * stride_qd,
                  mask=head_ok[None, :], other=0.0)

    if RECALL:
        # A block may hold no valid token for a column (all recalled, or ring tokens after the
        # row): a finite floor keeps exp2(m_i - m_new) a number.
        m_i = tl.full((BLOCK_H,), -1.0e30, tl.float32)
        # the last row's reference log-sum-exp, log2 domain; +inf (mass weight 0) elsewhere
        last = (heads >= (ROWS - 1) * GQA) & head_ok
        lse2 = tl.load(lse_ref_ptr + b * stride_lb + (h * GQA + heads - (ROWS - 1) * GQA)
                       * stride_lh, mask=last, other=float("inf")) * 1.4426950408889634
        # mass (Bmax, L, H_kv, T_MASS): this layer's plane of slot b, head h (clamped like lens)
        layer = tl.minimum(tl.maximum(tl.load(layer_ptr), 0), N_LAYERS - 1)
        mass_plane = mass_ptr + ((b.to(tl.int64) * N_LAYERS + layer) * H_KV + h) * T_MASS
    else:
        m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    # (read only with RECALL) the plane's recall bitmap scratch and its K recall indices
    bm_plane = bm_ptr + plane * tl.cdiv(T_CAP, 32)
    rec_plane = plane * K_REC
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((D, BLOCK_H), tl.float32)
    elem_ty = kr_ptr.dtype.element_ty
    acc_rows = offs_d  # the channel each row of acc holds

    if split < NUM_SPLITS:
        # -- quantized region: this split's block-aligned share of [0, n_quant)
        split_len = tl.cdiv(tl.cdiv(n_quant, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = split * split_len
        hi = tl.minimum(lo + split_len, n_quant)
        if RECALL:
            # this split's words of the recall bitmap, read back by its blocks (``rc.kept``):
            # built here, not by a launch before the splits (H200, 8B shape, 1 x 32k, against
            # the launch: 5.50 -> 5.45 ms a step; in the block loop instead: 5.59 -> 5.64)
            rc.mark_recalled(bm_plane, ridx_ptr + rec_plane, K_REC, lo, hi)
            tl.debug_barrier()  # every thread's words written before any thread reads them
        if BITS == 16:
            k_plane = k_ptr + plane * T_CAP * D
            v_plane = v_ptr + plane * T_CAP * D
        else:
            P: tl.constexpr = 32 // BITS
            k_plane = k_ptr + plane * (T_CAP // P * D)
            ks_plane = ks_ptr + plane * (T_CAP // G * D)
            kz_plane = kz_ptr + plane * (T_CAP // G * D)
            v_plane = v_ptr + plane * (T_CAP * (D // P))
            vs_plane = vs_ptr + plane * (T_CAP * (D // GV))
            vz_plane = vz_ptr + plane * (T_CAP * (D // GV))
        if HALF2:
            # -- packed fp16x2 dequantization, fp16 dots (also for bf16 models: dequantized
            #    values are fp16 by construction, fp16 scale and zero; probabilities are in
            #    [0, 1]). bf16 q converts exactly unless |q| >= 2^16: a power-of-two prescale,
            #    undone in the softmax scale, keeps max |q| below 2^15.
            qf = q_t.to(tl.float32)
            if elem_ty == tl.bfloat16:
                q_exp = tl.maximum(tl.ceil(tl.log2(tl.max(tl.abs(qf)))) - 15.0, 0.0)
                qf = qf * tl.exp2(-q_exp)
                qk_scale = qk_scale * tl.exp2(q_exp)
            # Keys come out with their tokens in pair order, and so do the rows of s and p; p
            # is put back in token order for the second dot (value rows load in token order:
            # in pair order their cp.async staging was 3.8x bank conflicted on the H200).
            # Values come out with their channels in pair order: acc rows are stored so.
            # kWidth note: Triton 3.6 sizes the mma.sync operands of a dot from the narrowest
            # load in the operands' backward slice, halved when a join is on the way; the
            # fp16 scale loads and the joins of the dequantizer made that 8 bits -> kWidth 4,
            # which made every transposed ldmatrix of the tiles 2-way bank conflicted (ncu:
            # half of all shared-memory wavefronts) and cost ~70 register moves per block.
            # ``_opaque`` ends the slice at the dequantized fp16 tile: kWidth 2, 1.28x faster.
            # Bank note: on top, both tiles get a channel relabelling (q follows the keys', acc
            # rows the values') for their 16-byte stores to the swizzled shared-memory tiles of
            # the dots. Without it, a quarter-warp's 8 stores fell into 2 (keys: 4 channels per
            # thread, so rows 4 apart) or 4 (values) of the 8 bank groups: 4x and 2x the
            # conflict-free time. With it, 1x: computed from the ttgir layouts (triton 3.6 and
            # 3.9, D 128, BLOCK_N 64, 4 warps, bits 2 and 4); other shapes stay correct but may
            # keep some conflicts.
            q_h = _interleave_rows(qf.to(tl.float16), 4)
            order_n = _pair_order(BLOCK_N, P)
            acc_rows = _pair_order(D, P)
            if D // P >= 8:
                acc_rows = tl.reshape(_spread_words(tl.reshape(acc_rows, (1, D)), D // P), (D,))
            # Per-row partial sums of p (summed once at the end): no cross-warp reduction of l
            # per block.
            l_rows = tl.zeros((BLOCK_N, BLOCK_H), tl.float32)
            if PREFETCH:
                # The next block's codes are loaded while this one is dequantized and attended.
                kw, ks, kz = _load_keys_t(k_plane, ks_plane, kz_plane, lo, hi, D, BITS, G, BLOCK_N)
                v_tokens = lo + tl.arange(0, BLOCK_N)
                vw, vs, vz = _load_values(v_plane, vs_plane, vz_plane, v_tokens, v_tokens < hi,
                                          D, BITS, GV)
                for start in tl.range(lo, hi, BLOCK_N, num_stages=1):
                    nxt = start + BLOCK_N
                    kw_n, ks_n, kz_n = _load_keys_t(k_plane, ks_plane, kz_plane, nxt, hi,
                                                    D, BITS, G, BLOCK_N)
                    v_tokens = nxt + tl.arange(0, BLOCK_N)
                    vw_n, vs_n, vz_n = _load_values(v_plane, vs_plane, vz_plane, v_tokens,
                                                    v_tokens < hi, D, BITS, GV)
                    tokens = start + order_n
                    keep = rc.kept(bm_plane, tokens, hi, RECALL)
                    m_i, alpha, p, l_rows = _keys_step_half2(
                        kw, ks, kz, keep, q_h, qk_scale, m_i, l_rows, BITS, INTERPRET)
                    if RECALL:
                        rc.store_mass(mass_plane, tokens, keep, p, m_i, lse2, True)
                    acc = _values_step_half2(vw, vs, vz, p, alpha, acc, D, BITS, GV, INTERPRET)
                    kw, ks, kz, vw, vs, vz = kw_n, ks_n, kz_n, vw_n, vs_n, vz_n
            else:
                # Codes staged through shared memory by Triton's software pipelining (cp.async).
                for start in range(lo, hi, BLOCK_N):
                    kw, ks, kz = _load_keys_t(k_plane, ks_plane, kz_plane, start, hi,
                                              D, BITS, G, BLOCK_N)
                    tokens = start + order_n
                    keep = rc.kept(bm_plane, tokens, hi, RECALL)
                    m_i, alpha, p, l_rows = _keys_step_half2(
                        kw, ks, kz, keep, q_h, qk_scale, m_i, l_rows, BITS, INTERPRET)
                    if RECALL:
                        rc.store_mass(mass_plane, tokens, keep, p, m_i, lse2, True)
                    # Values after the softmax: their registers are not live across it.
                    v_tokens = start + tl.arange(0, BLOCK_N)
                    vw, vs, vz = _load_values(v_plane, vs_plane, vz_plane, v_tokens,
                                              v_tokens < hi, D, BITS, GV)
                    acc = _values_step_half2(vw, vs, vz, p, alpha, acc, D, BITS, GV, INTERPRET)
            l_i = tl.sum(l_rows, axis=0)
        else:
            q_d = q_t.to(DOT_DTYPE)
            for start in range(lo, hi, BLOCK_N):
                tokens = start + tl.arange(0, BLOCK_N)
                valid = tokens < hi
                if BITS == 16:
                    k_t = tl.load(k_plane + tokens[None, :] * D + offs_d[:, None],
                                  mask=valid[None, :], other=0.0)
                    v = tl.load(v_plane + tokens[:, None] * D + offs_d[None, :],
                                mask=valid[:, None], other=0.0)
                else:
                    kw, ks, kz = _load_keys_t(k_plane, ks_plane, kz_plane, start, hi,
                                              D, BITS, G, BLOCK_N)
                    vw, vs, vz = _load_values(v_plane, vs_plane, vz_plane, tokens, valid,
                                              D, BITS, GV)
                    k_t = _dequant_last(kw, ks, kz, BITS, 32 // BITS)       # (D, BLOCK_N) fp32
                    v = _dequant_last(vw, vs, vz, BITS, GV)                 # (BLOCK_N, D) fp32
                    k_t = _round_to(k_t, elem_ty, BF16_BY_HAND)
                    v = _round_to(v, elem_ty, BF16_BY_HAND)
                if RECALL:
                    keep = rc.kept(bm_plane, tokens, hi, RECALL)
                    m_i, l_i, acc, p = _attend_block_masked(
                        q_d, k_t, v, keep[:, None], m_i, l_i, acc, qk_scale, elem_ty, DOT_DTYPE,
                        INPUT_PRECISION, BF16_BY_HAND)
                    rc.store_mass(mass_plane, tokens, keep, p, m_i, lse2, True)
                else:
                    m_i, l_i, acc = _attend_block(q_d, k_t, v, valid, m_i, l_i, acc, qk_scale,
                                                  elem_ty, DOT_DTYPE, INPUT_PRECISION,
                                                  BF16_BY_HAND)
    else:
        # -- residual ring: [0, n_ring) in the model dtype (with RECALL, after the recall rows).
        #    Not software-pipelined: it is at most R / BLOCK_N (2) blocks, and a pipelined loop
        #    gets its own multi-buffered shared memory next to the main loop's (sm_90, bits 2,
        #    D 128: 68 KB per program instead of 35 KB).
        q_d = q_t.to(DOT_DTYPE)
        if RECALL:
            # -- first the recall rows: full-precision K/V of quantized positions, every row
            #    sees them; their mass goes to their positions
            for start in tl.range(0, K_REC, BLOCK_N, num_stages=1):
                j = start + tl.arange(0, BLOCK_N)
                pos = tl.load(ridx_ptr + rec_plane + j, mask=j < K_REC, other=-1)
                ok = (pos >= 0) & (pos < n_quant)
                k_t, v = _load_rows(rk_ptr + rec_plane * D, rv_ptr + rec_plane * D, j, ok, D)
                m_i, l_i, acc, p = _attend_block_masked(
                    q_d, k_t, v, ok[:, None], m_i, l_i, acc, qk_scale, elem_ty, DOT_DTYPE,
                    INPUT_PRECISION, BF16_BY_HAND)
                rc.store_mass(mass_plane, pos, ok, p, m_i, lse2, True)
            # -- then the ring, causal across rows: row r sees n_ring - (ROWS - 1 - r) tokens
            seen = tl.minimum(n_ring - (ROWS - 1 - heads // GQA), n_ring)       # (BLOCK_H,)
            for start in tl.range(0, n_ring, BLOCK_N, num_stages=1):
                tokens = start + tl.arange(0, BLOCK_N)
                k_t, v = _load_rows(kr_ptr + plane * R * D, vr_ptr + plane * R * D, tokens,
                                    tokens < n_ring, D)
                m_i, l_i, acc, p = _attend_block_masked(
                    q_d, k_t, v, tokens[:, None] < seen[None, :], m_i, l_i, acc, qk_scale,
                    elem_ty, DOT_DTYPE, INPUT_PRECISION, BF16_BY_HAND)
                # ring token t is quantized position n_quant + t once flushed: the next step
                # holds it when its flush runs, i.e. when row 0's R_FLUSH ring tokens are there
                flushes = n_ring - (ROWS - 1) >= R_FLUSH
                rc.store_mass(mass_plane + n_quant, tokens, tokens < n_ring, p, m_i, lse2,
                            flushes & (tokens < R_FLUSH))
        else:
            for start in tl.range(0, n_ring, BLOCK_N, num_stages=1):
                tokens = start + tl.arange(0, BLOCK_N)
                valid = tokens < n_ring
                k_t, v = _load_rows(kr_ptr + plane * R * D, vr_ptr + plane * R * D, tokens,
                                    valid, D)
                m_i, l_i, acc = _attend_block(q_d, k_t, v, valid, m_i, l_i, acc, qk_scale,
                                              elem_ty, DOT_DTYPE, INPUT_PRECISION, BF16_BY_HAND)

    # -- partials: m, l (B * ROWS, H_q, S) and acc (B * ROWS, H_q, S, D) fp32, S = NUM_SPLITS + 1
    if ROWS == 1:
        rows = (b * (H_KV * GQA) + h * GQA + heads) * (NUM_SPLITS + 1) + split
    else:
        rows = ((((b * ROWS + heads // GQA) * H_KV + h) * GQA + heads % GQA) * (NUM_SPLITS + 1)
                + split)
    tl.store(m_ptr + rows, m_i, mask=head_ok)
    tl.store(l_ptr + rows, l_i, mask=head_ok)
    tl.store(acc_ptr + rows[None, :] * D + acc_rows[:, None], acc, mask=head_ok[None, :])


@triton.jit
def _decode_attention_combine_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr, lse_ref_ptr, lens_ptr, update_ptr,
    H_Q, stride_ob, stride_oh, stride_od, stride_lb, stride_lh, S,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, BF16_BY_HAND: tl.constexpr,
    ROWS: tl.constexpr, RECALL: tl.constexpr, PDL: tl.constexpr,
):
    """Program (row, c), row = b * H_q + query head of ``out`` (B, H_q, D) (a slot's R query
    rows are R rows of B * R here). RECALL, in the programs c == 0 of the slots with
    ``update[slot] >= 0``: the last query row's log-sum-exp (fp32, natural log, of the scaled
    scores) to ``lse_ref[slot, head]``, and the first head's program of row 0 gives back
    ``update[slot]`` ring tokens from ``lens[slot, 1]`` (the split launch has read lens; no
    program here reads it)."""
    # (the next kernel, the o projection, then streams its weights early)
    gdc.launch_dependents_then_wait(PDL)
    # One pass: every split's m, l and acc slice load together (BLOCK_S >= S), so the program
    # waits for memory once.
    row = tl.program_id(0)  # b * H_q + query head
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_s = tl.arange(0, BLOCK_S)
    in_range = offs_s < S
    m = tl.load(m_ptr + row * S + offs_s, mask=in_range, other=float("-inf"))
    l = tl.load(l_ptr + row * S + offs_s, mask=in_range, other=0.0)
    a = tl.load(acc_ptr + (row * S + offs_s)[:, None] * D + offs_d[None, :],
                mask=in_range[:, None], other=0.0)
    m_max = tl.max(m, axis=0)
    # All splits empty only happens on an empty slot (outside the contract): give 0, not NaN.
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)
    l_sum = tl.sum(w * l, axis=0)
    acc = tl.sum(w[:, None] * a, axis=0)
    out = tl.where(l_sum > 0.0, acc / l_sum, 0.0)
    if RECALL:
        slot = row // (ROWS * H_Q)
        r = row // H_Q % ROWS
        head = row % H_Q
        update = tl.load(update_ptr + slot)
        first = (tl.program_id(1) == 0) & (update >= 0)
        tl.store(lse_ref_ptr + slot * stride_lb + head * stride_lh,
                 (m_max + tl.log2(l_sum)) * 0.6931471805599453, mask=first & (r == ROWS - 1))
        if first & (r == 0) & (head == 0):
            tl.store(lens_ptr + 2 * slot + 1, tl.load(lens_ptr + 2 * slot + 1) - update)
    b = row // H_Q
    hq = row % H_Q
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + b * stride_ob + hq * stride_oh + offs_d * stride_od,
             _round_to(out, out_ty, BF16_BY_HAND).to(out_ty))


# ----------------------------------------------------------------------------------------------
# Launcher (callable on CPU tensors under TRITON_INTERPRET=1)
# ----------------------------------------------------------------------------------------------


def _num_splits(batch: int, h_kv: int, capacity: int, block_n: int, sm_count: int) -> int:
    """NUM_SPLITS of the Triton kernel: ~4 programs per SM (about as many as fit at once at 4
    warps and ~128 registers per thread), so one wave covers the GPU even for a single long
    sequence; never a full-capacity region cut into pieces shorter than 4 blocks (each program
    also pays a fixed cost for its q load and partial store); at most 64 so the combine stays
    cheap."""
    want = triton.cdiv(4 * sm_count, batch * h_kv)
    useful = max(1, capacity // (4 * block_n))
    return max(1, min(want, useful, 64))


def _fragments_num_splits(batch: int, h_kv: int, capacity: int, sm_count: int) -> int:
    """NUM_SPLITS of the Gluon kernel, whose one-warp programs fit 9 per SM: at least one wave of
    ~8 per SM; where there is more work, up to ~24 per SM as long as each program keeps >= 8
    blocks; never below 2 blocks per program; at most 128; then as few as cover a full plane
    with the same blocks per split (a split past the end would be an empty program). On the H200
    this is within 4% of the best measured split count at batch 1 x 16k / 128k, 8 x 4k / 16k,
    32 and 64 x 16k."""
    blocks = max(1, capacity // dag.BLOCK_TOKENS)
    planes = batch * h_kv
    fill = triton.cdiv(8 * sm_count, planes)
    deep = min(blocks // 8, triton.cdiv(24 * sm_count, planes))
    splits = max(1, min(max(fill, deep), max(1, blocks // 2), MAX_SPLITS))
    return triton.cdiv(blocks, triton.cdiv(blocks, splits))


def _fragments_supported(device: torch.device, dtype: torch.dtype, bits: int, group_size: int,
                         head_dim: int) -> bool:
    """Whether the Gluon kernel covers a call: CUDA (sm_80+, not the interpreter), bits 2,
    group 16, head dim 128, fp16/bf16."""
    return (compiled_major(device) >= 8 and bits == 2 and group_size == 16 and head_dim == 128
            and dtype in (torch.float16, torch.bfloat16))


def _fragments_pay_off(batch: int, h_kv: int, capacity: int, sm_count: int) -> bool:
    """Whether the Gluon kernel beats the Triton one: on the H200 it does from 32 blocks of 128
    tokens per SM (batch 8 x 16k: 1.23x; batch 1 x 128k: 1.22x; batch 32 x 64k: 1.47x) and loses
    below (batch 8 x 2k / 4k: 0.82x; batch 1 x 16k: 0.85x): its programs are one warp each and
    pay a fixed prologue and pipeline fill."""
    return batch * h_kv * (capacity // dag.BLOCK_TOKENS) >= 32 * sm_count


class _Plan(NamedTuple):
    """One launch of the split kernels. ``kernel``: :data:`SPLIT` or :data:`FRAGMENTS`;
    ``half2``: the Triton kernel's packed fp16x2 dequantization (1/2/4-bit codes, fp16/bf16
    models); ``prefetch``: its "half2" loop loads the next block's codes into registers itself
    (``num_stages`` then does not apply: that loop is not software-pipelined); ``maxnreg``:
    registers per thread (None: no cap). The Gluon kernel uses ``num_splits``, ``num_warps``
    and ``maxnreg`` only."""

    kernel: str
    num_splits: int
    block_n: int
    num_warps: int
    num_stages: int
    maxnreg: Optional[int]
    half2: bool
    prefetch: bool

    def as_tensor(self) -> torch.Tensor:
        """This launch as the ops' ``launch`` argument: ``(8,)`` int64 on the CPU, the fields in
        order (``kernel`` as its index in :data:`KERNELS`, no ``maxnreg`` as 0). A tensor, not
        ints: a compiled step passes it as an input, so one compiled graph serves every bucket
        (ints would be baked into it: one compile per bucket)."""
        return torch.tensor([KERNELS.index(self.kernel), self.num_splits, self.block_n,
                             self.num_warps, self.num_stages, self.maxnreg or 0,
                             int(self.half2), int(self.prefetch)], dtype=torch.int64)

    @classmethod
    def of_tensor(cls, launch: torch.Tensor) -> "_Plan":
        """The launch ``as_tensor`` gave."""
        kernel, splits, block_n, warps, stages, maxnreg, half2, prefetch = launch.tolist()
        if not 0 <= kernel < len(KERNELS):
            raise ValueError(f"launch: expected a kernel index in [0, {len(KERNELS)}), got "
                             f"{kernel}")
        return cls(KERNELS[kernel], splits, block_n, warps, stages, maxnreg or None,
                   bool(half2), bool(prefetch))


def _check_group(rows: int, gqa: int) -> None:
    """The query rows of a KV group, ``rows * gqa``, fit the dots' N axis (``MAX_GQA``)."""
    if rows * gqa <= MAX_GQA:
        return
    if rows == 1:
        raise ValueError(f"q: expected at most {MAX_GQA} query heads per KV head, got {gqa}")
    raise ValueError(f"q: expected at most {MAX_GQA} query rows per KV head (rows x query heads "
                     f"per KV head), got {rows} x {gqa}")


def _plan(device: torch.device, dtype: torch.dtype, bits: int, group_size: int, head_dim: int,
          batch: int, h_q: int, h_kv: int, capacity: int, sm_count: int,
          kernel: Optional[str] = None, *, rows: int = 1, recall: bool = False) -> _Plan:
    """Which kernel and tiles a launch runs: the Gluon kernel where it covers the call and pays
    off (``_fragments_pay_off``), else the Triton kernel. ``kernel`` names one of
    :data:`KERNELS` instead (tests run each kernel on shapes where the other one would be
    picked); ValueError where it does not cover the call. ``rows``, ``recall``: the recall
    launch (query rows per slot, recall on); it always runs the Triton kernel (the Gluon one
    has neither the bitmap mask nor the recall rows), on the same tiles. The ``rows * h_q /
    h_kv`` query rows of a KV group fill the dots' N axis, padded to 8: at most 8 (BLOCK_H 16
    hit an illegal memory access on the H200, perf/NOTES.md).

    Triton kernel tiles: 8192 values (64 tokens at D = 128) on 4 warps = one warpgroup, whole key
    groups per block.
    - bits 16 (bound by memory): 4096-value tiles over 3 stages, 1.16x faster than 8192 x 2 at
      B 8, 16k on the H200 (85% of copy bandwidth).
    - fp32 models: 4096-value tiles (fp32 dots run on the FMA units and spill at 8192), 3 stages.
    - "half2": a 96-register cap at 4 warps and D >= 64 (5 programs per SM instead of 4, so B 8 x
      8 KV heads x 10 splits fit in one wave of 132 SMs; D 16 spills at 96). Bits 2 load the next
      block's codes into registers instead of staging them with cp.async: 1.08-1.10x on the
      H200; bits 4 stage them over 2 stages (their prefetched words spill under the cap: 1.6x
      slower; 3 stages would leave room for 4 programs per SM only).
    """
    _check_group(rows, h_q // h_kv)
    supported = _fragments_supported(device, dtype, bits, group_size, head_dim)
    if kernel is None:
        fast = supported and not recall and _fragments_pay_off(batch, h_kv, capacity, sm_count)
        kernel = FRAGMENTS if fast else SPLIT
    check_choice("kernel", kernel, KERNELS)
    if kernel == FRAGMENTS and recall:
        raise ValueError(f"kernel={FRAGMENTS!r}: expected a launch without recall, got recall")
    if kernel == FRAGMENTS:
        if not supported:
            raise ValueError(f"kernel={FRAGMENTS!r}: expected a CUDA (sm_80+) call with bits=2, "
                             f"group_size=16, head_dim 128 and fp16/bf16; got {device.type}, "
                             f"bits={bits}, group_size={group_size}, head_dim {head_dim}, "
                             f"{dtype}")
        return _Plan(FRAGMENTS, _fragments_num_splits(batch, h_kv, capacity, sm_count),
                     dag.BLOCK_TOKENS, 1, 2, dag.MAXNREG, half2=True, prefetch=True)
    tile = 4096 if dtype == torch.float32 or bits == 16 else 8192
    block_n = max(16, tile // head_dim, group_size if bits != 16 else 16)
    warps = 4 if bits == 16 or block_n * head_dim <= 8192 else 8
    splits = _num_splits(batch, h_kv, capacity, block_n, sm_count)
    if bits == 16 or dtype == torch.float32:
        return _Plan(SPLIT, splits, block_n, warps, 3, None, half2=False, prefetch=False)
    maxnreg = 96 if warps == 4 and head_dim >= 64 else None
    if bits == 2:
        return _Plan(SPLIT, splits, block_n, warps, 1, maxnreg, half2=True, prefetch=True)
    return _Plan(SPLIT, splits, block_n, warps, 2, maxnreg, half2=True, prefetch=False)


def decode_attention_plan(device: torch.device, dtype: torch.dtype, bits: int, group_size: int,
                          head_dim: int, batch: int, h_q: int, h_kv: int, capacity: int, *,
                          rows: int = 1, recall: bool = False) -> _Plan:
    """The launch :func:`decode_attention` (``recall``: :func:`decode_attention_recall` with
    ``rows`` query rows) runs by default for these shapes on ``device`` (``_plan``), for a
    caller that decides its launches ahead and passes them as ``launch``."""
    return _plan(device, dtype, bits, group_size, head_dim, batch, h_q, h_kv, capacity,
                 sm_count_of(device), rows=rows, recall=recall)


def _decode_attention_triton(
    q, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring, lens,
    scale: float, bits: int, group_size: int,
    plan: Union[_Plan, torch.Tensor, None] = None,
) -> torch.Tensor:
    """The CUDA implementation of :func:`decode_attention` (inputs already validated; also
    callable on CPU tensors under TRITON_INTERPRET=1, the Triton kernel only). ``plan``: the
    launch (a ``_Plan``, or the op's ``launch`` tensor), ``_plan``'s by default (tests and the
    kernel benchmark pass others)."""
    out = q.new_empty(q.shape)                                              # (B, H_q, D)
    _launch(q.unsqueeze(1), (k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring,
                             lens), None, out, scale, bits, group_size, plan)
    return out


def _launch(q, bufs, recall, out, scale: float, bits: int, group_size: int,
            plan: Union[_Plan, torch.Tensor, None]) -> None:
    """The launches of both ops. q: (B, R, H_q, D), any strides; bufs: the layer's nine
    buffers; recall: None, or (recall_k, recall_v, recall_idx, lse_ref, mass, layer,
    update) as :func:`decode_attention_recall` takes them; out: (B * R, H_q, D), written."""
    k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring, lens = bufs
    batch, rows, h_q, d = q.shape
    h_kv = k_ring.shape[1]
    ring_cap = k_ring.shape[2]
    capacity = k_cache.shape[2] if bits == 16 else v_cache.shape[2]
    if plan is None:
        plan = _plan(q.device, q.dtype, bits, group_size, d, batch, h_q, h_kv, capacity,
                     sm_count_of(q.device), rows=rows, recall=recall is not None)
    elif isinstance(plan, torch.Tensor):
        plan = _Plan.of_tensor(plan)
    if plan.kernel == FRAGMENTS and (recall is not None or rows != 1 or not _fragments_supported(
            q.device, q.dtype, bits, group_size, d)):
        raise ValueError(f"launch: kernel {FRAGMENTS!r} does not cover this call (recall, "
                         f"rows {rows}, {q.device.type}, bits={bits}, group_size={group_size}, "
                         f"head_dim {d}, {q.dtype}); expected {SPLIT!r}")
    block_n = plan.block_n
    if block_n < 16 or block_n & (block_n - 1) or (bits != 16 and block_n % group_size):
        raise ValueError(f"block_n: expected a power of two >= 16 and a multiple of group_size="
                         f"{group_size}, got {block_n}")
    if not 1 <= plan.num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits: expected 1..{MAX_SPLITS}, got {plan.num_splits}")
    gqa = h_q // h_kv
    n_slots = plan.num_splits + 1  # + the ring's split

    m = torch.empty(batch * rows, h_q, n_slots, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(batch * rows, h_q, n_slots, d, dtype=torch.float32, device=q.device)

    # The interpreter (triton 3.9) mishandles bf16: its tl.dot multiplies the raw uint16 bits and
    # its fp32 -> bf16 cast truncates. There bf16 values are rounded by hand and kept in fp32,
    # and the dots run in fp32 on them: the same products, exact in fp32, as on the GPU.
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    bf16_by_hand = interpret and q.dtype == torch.bfloat16
    # fp32 models keep exact fp32 products (tf32 would be far less precise than the model dtype).
    if q.dtype == torch.float32 or bf16_by_hand:
        dot_dtype, precision = tl.float32, "ieee"
    else:
        dot_dtype, precision = (tl.float16 if q.dtype == torch.float16 else tl.bfloat16), "tf32"

    # Programmatic dependent launch (ops/_gdc.py) for all the kernels.
    pdl = gdc.supported(q.device)
    regs = {"maxnreg": plan.maxnreg} if plan.maxnreg else {}
    if recall is None:
        # never read (RECALL off): stand-ins of one dtype, so the kernel compiles once
        bitmap = recall_k = recall_v = recall_idx = lse_ref = mass = layer = update = lens
        k_rec, t_mass, n_layers, r_flush, stride_lse = 0, 0, 0, 0, (0, 0)
    else:
        recall_k, recall_v, recall_idx, lse_ref, mass, layer, update = recall
        k_rec, n_layers, t_mass = recall_k.shape[2], mass.shape[1], mass.shape[3]
        r_flush, stride_lse = ring_length(ring_cap, bits, group_size), lse_ref.stride()
        # the split programs' scratch: each writes and reads back its own words
        bitmap = torch.empty(batch, h_kv, triton.cdiv(capacity, 32), dtype=torch.int32,
                             device=q.device)
    if plan.kernel == FRAGMENTS:
        q = q[:, 0]                                                         # (B, H_q, D)
        if q.stride(2) != 1:
            q = q.contiguous()
        dag._decode_attention_fragments_kernel[(batch, h_kv, n_slots)](
            q, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring, lens, m, l, acc,
            scale * _LOG2E, q.stride(0), q.stride(1), h_kv, capacity, ring_cap, plan.num_splits,
            GQA=gqa, PDL=pdl, num_warps=plan.num_warps, launch_pdl=pdl, **regs,
        )
    else:
        _decode_attention_split_kernel[(batch, h_kv, n_slots)](
            q, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring, lens,
            m, l, acc,
            bitmap, recall_k, recall_v, recall_idx, lse_ref, mass, layer,
            scale * _LOG2E,
            q.stride(0), q.stride(1) if rows > 1 else 0, q.stride(2), q.stride(3), *stride_lse,
            h_kv, capacity, ring_cap, plan.num_splits, k_rec, t_mass, n_layers, r_flush,
            GQA=gqa, BLOCK_H=MAX_GQA, D=d, ROWS=rows, RECALL=recall is not None,
            BITS=bits, G=group_size, GV=value_group(group_size, d), BLOCK_N=block_n,
            HALF2=plan.half2,
            DOT_DTYPE=dot_dtype, INPUT_PRECISION=precision, BF16_BY_HAND=bf16_by_hand,
            INTERPRET=interpret, PREFETCH=plan.prefetch, PDL=pdl, num_warps=plan.num_warps,
            num_stages=plan.num_stages, launch_pdl=pdl, **regs,
        )
    # One program per (row, 32 channels), all splits loaded at once: one round of memory
    # latency. (One program per row looping over 16 splits at a time took 4.8 us per layer at
    # batch 1: 32 programs, 10 dependent loads each.) At most 256 x 32 fp32 values per program.
    block_d = min(d, 32)
    _decode_attention_combine_kernel[(batch * rows * h_q, d // block_d)](
        m, l, acc, out, m if recall is None else lse_ref, lens, update, h_q, *out.stride(),
        *stride_lse, n_slots, D=d, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(n_slots),
        BF16_BY_HAND=bf16_by_hand, ROWS=rows, RECALL=recall is not None, PDL=pdl, num_warps=4,
        launch_pdl=pdl,
    )


# ----------------------------------------------------------------------------------------------
# Pure-PyTorch reference (same signature and output layout; runs on any device, syncs on lens)
# ----------------------------------------------------------------------------------------------


def _region_keys_ref(k_cache, k_scale, k_zero, b: int, n_quant: int, bits: int,
                     group_size: int) -> torch.Tensor:
    """Slot b's first ``n_quant`` quantized keys in fp32: (H_kv, n_quant, D) (at bits 16 of an
    fp32 cache, a view of it)."""
    if bits == 16:
        return k_cache[b, :, :n_quant].float()
    rows, groups = n_quant // codes_per_word(bits), n_quant // group_size
    return dequantize_keys_ref(k_cache[b:b + 1, :, :rows], k_scale[b:b + 1, :, :groups],
                               k_zero[b:b + 1, :, :groups], bits, group_size, torch.float32)[0]


def _region_ref(k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, b: int, n_quant: int,
                bits: int, group_size: int):
    """Slot b's first ``n_quant`` quantized tokens in fp32: k, v (H_kv, n_quant, D) (at bits 16
    of an fp32 cache, views of it)."""
    k = _region_keys_ref(k_cache, k_scale, k_zero, b, n_quant, bits, group_size)
    if bits == 16:
        return k, v_cache[b, :, :n_quant].float()
    v = dequantize_values_ref(v_cache[b:b + 1, :, :n_quant], v_scale[b:b + 1, :, :n_quant],
                              v_zero[b:b + 1, :, :n_quant], bits,
                              value_group(group_size, k_cache.shape[3]), torch.float32)[0]
    return k, v


def decode_attention_ref(
    q, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring, lens,
    scale: float, bits: int, group_size: int,
) -> torch.Tensor:
    """Reference for :func:`decode_attention`: per slot, dequantize the valid region and append the
    valid ring in fp32, then plain softmax attention in fp32; the output is cast to q's dtype."""
    batch, h_q, d = q.shape
    h_kv = k_ring.shape[1]
    out = q.new_empty(batch, h_q, d)
    for b, (n_quant, n_ring) in enumerate(lens[:batch].tolist()):
        k, v = _region_ref(k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, b, n_quant, bits,
                           group_size)                                 # (H_kv, n_quant, D)
        k = torch.cat([k, k_ring[b, :, :n_ring].float()], dim=1)         # (H_kv, T_b, D)
        v = torch.cat([v, v_ring[b, :, :n_ring].float()], dim=1)
        qb = q[b].float().reshape(h_kv, h_q // h_kv, d)                   # (H_kv, gqa, D)
        probs = torch.softmax(qb @ k.transpose(1, 2) * scale, dim=-1)   # (H_kv, gqa, T_b)
        out[b] = (probs @ v).view(h_q, d).to(q.dtype)
    return out


# ----------------------------------------------------------------------------------------------
# Registered op: the reference by default (CPU), the Triton kernels on CUDA
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("minikv::decode_attention", mutates_args=())
def _decode_attention_op(
    q: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
    v_cache: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor,
    k_ring: torch.Tensor, v_ring: torch.Tensor, lens: torch.Tensor,
    scale: float, bits: int, group_size: int, launch: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    return decode_attention_ref(q, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero,
                                k_ring, v_ring, lens, scale, bits, group_size)


@_decode_attention_op.register_fake
def _(q, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring, lens,
      scale, bits, group_size, launch=None):
    return q.new_empty(q.shape)


_decode_attention_op.register_kernel("cuda")(_decode_attention_triton)


# ----------------------------------------------------------------------------------------------
# Public wrapper
# ----------------------------------------------------------------------------------------------


def check_launch(launch: Optional[torch.Tensor]) -> None:
    """A ``launch`` argument is None or ``_Plan.as_tensor``'s shape: (8,) int64 on the CPU."""
    if launch is not None:
        check_tensor("launch", launch, shape=(len(_Plan._fields),), dtypes=(torch.int64,),
                     device=torch.device("cpu"))


def _check_inputs(q, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring, lens,
                  bits, group_size, rows: bool = False):
    """The layer against the layout contract (``cache_layout.check_layer``; views allowed: this
    op only reads), then what the query must match: head dim, dtype, batch and GQA grouping.
    q: (B, H_q, D), or (B, R, H_q, D) with ``rows``, R in {1, 2}."""
    check_tensor("q", q, ndim=4 if rows else 3, dtypes=FLOAT_DTYPES)
    batch, h_q, d = q.shape[0], q.shape[-2], q.shape[-1]
    check_choice(f"head_dim (q.shape[{q.dim() - 1}])", d, _HEAD_DIMS)
    if rows:
        check_choice("rows (q.shape[1])", q.shape[1], (1, 2))
    check_tensor("k_ring", k_ring, ndim=4, dtypes=(q.dtype,), device=q.device)
    b_max, h_kv, _, _, _ = check_layer((k_cache, k_scale, k_zero, v_cache, v_scale, v_zero,
                                        k_ring, v_ring, lens), bits, group_size, whole=False)
    check_tensor("k_ring", k_ring, shape=(b_max, h_kv, None, d))
    if not 1 <= batch <= b_max:
        raise ValueError(f"q: expected 1 <= batch (q.shape[0]) <= max_batch_size={b_max}, "
                         f"got {batch}")
    if h_q % h_kv:
        raise ValueError(f"q: expected query heads divisible by KV heads {h_kv}, got {h_q}")
    if bits == 16:
        for name, t in (("k_scale", k_scale), ("k_zero", k_zero),
                        ("v_scale", v_scale), ("v_zero", v_zero)):
            if t.numel() != 0:
                raise ValueError(f"{name}: expected an empty tensor when bits=16, "
                                 f"got shape {tuple(t.shape)}")


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
    v_cache: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor,
    k_ring: torch.Tensor, v_ring: torch.Tensor, lens: torch.Tensor,
    scale: float, bits: int = 2, group_size: int = 16, launch: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of one new query token per sequence over one layer's compressed cache.

    One softmax per (slot, query head) over the slot's quantized tokens followed by its ring
    tokens; query head ``i`` uses KV head ``i // (H_q / H_kv)``. Slots ``>= B`` are never read.
    Reads ``lens`` on the device (no host sync); safe to capture in a CUDA graph, and the graph
    may be replayed after ``lens`` changes in place.

    Args:
        q: ``(B, H_q, D)`` fp16/bf16/fp32, any strides; ``B <= Bmax``, ``D`` in {16, 32, 64, 128,
            256}, ``H_q % H_kv == 0``.
        k_cache: bits 1/2/4: ``(Bmax, H_kv, T_cap * bits / 32, D)`` int32, token ``t`` in row
            ``t // (32 / bits)`` at bit offset ``(t % (32 / bits)) * bits``;
            bits 16: ``(Bmax, H_kv, T_cap, D)`` in q's dtype.
        k_scale, k_zero: ``(Bmax, H_kv, T_cap / G, D)`` fp16 (one group = one channel over G
            tokens); empty when bits == 16.
        v_cache: bits 1/2/4: ``(Bmax, H_kv, T_cap, D * bits / 32)`` int32, channel ``c`` in column
            ``c // (32 / bits)`` at bit offset ``(c % (32 / bits)) * bits``;
            bits 16: ``(Bmax, H_kv, T_cap, D)`` in q's dtype.
        v_scale, v_zero: ``(Bmax, H_kv, T_cap, D / G)`` fp16 (one group = G channels of one
            token); empty when bits == 16.
        k_ring, v_ring: ``(Bmax, H_kv, R, D)`` in q's dtype, the fp residual ring.
        lens: ``(Bmax, 2)`` int32 on q's device: ``lens[b, 0]`` quantized tokens of slot b (a
            multiple of G, <= T_cap), ``lens[b, 1]`` ring tokens (<= R). Every active slot must
            hold at least one token. Values outside these ranges are not checked (that would
            sync); the kernel clamps them to the buffers.
        scale: softmax scale, usually ``D ** -0.5``.
        bits: 1, 2 or 4 (quantized) or 16 (no quantization).
        group_size: G in {16, 32, 64, 128}; ``T_cap``, ``R`` and ``D`` are multiples of it
            (ignored when bits == 16).
        launch: the launch decided ahead (a decode step's plan): ``decode_attention_plan(...)
            .as_tensor()``, ``(8,)`` int64 on the CPU; None: ``_plan``'s for these shapes. The
            CPU reference ignores it.
        All cache buffers and ``lens`` are contiguous and on q's device.

    Returns:
        ``(B, H_q, D)`` in q's dtype, contiguous.

    Raises:
        ValueError: a shape, dtype or device inconsistent with the layout above.
    """
    _check_inputs(q, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring, lens,
                  bits, group_size)
    check_launch(launch)
    return torch.ops.minikv.decode_attention(q, k_cache, k_scale, k_zero, v_cache, v_scale,
                                             v_zero, k_ring, v_ring, lens, float(scale), bits,
                                             group_size, launch)
