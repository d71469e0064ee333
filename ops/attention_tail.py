"""Tail attention over the compressed KV cache: T query rows per sequence, causal among themselves.

The prefill of a prompt's tail after a cached (compressed) prefix: the tail's T tokens attend to
the slot's whole compressed cache and, causally, to each other. For every slot ``b < B``, query
row ``r < T`` and query head ``i`` (KV head ``i // (H_q / H_kv)``)::

    K_br = [dequant(k_cache[b, :, :lens[b, 0]]) ; k_ring[b, :, :lens[b, 1] + r]]
    V_br = [dequant(v_cache[b, :, :lens[b, 0]]) ; v_ring[b, :, :lens[b, 1] + r]]
    out[b, r, i] = softmax(q[b, r, i] . K_br^T * scale) . V_br

``lens[b, 1]`` counts row 0's own token, and the chunk's T tokens sit in ring rows ``lens[b, 1]
- 1 .. lens[b, 1] - 2 + T`` (the caller writes them first): each row sees itself, not the rows
after it. With T = 1 this is :func:`.attention_decode.decode_attention`; the row convention is
``decode_attention_recall``'s (R in {1, 2} there), for any ``T <= R``.

On CUDA, two launches, like decode attention's (whose combine kernel and block loaders this
module reuses):

1. ``_tail_attention_split_kernel``, grid ``(B * H_kv, ceil(T * GQA / BLOCK_M), NUM_SPLITS +
   1)``: a flash-attention forward whose M axis holds the chunk's rows times the KV group's
   query heads (``m = t * GQA + g``), so each block of BLOCK_N cached tokens is loaded and
   dequantized once for BLOCK_M (query row, head) pairs, in registers, with decode attention's
   fp32 unpacking (``_dequant_last``), rounded to the model dtype and fed to fp16/bf16 dots
   (fp32 dots for fp32 models). Programs ``s < NUM_SPLITS`` cover an equal, block-aligned
   share of the slot's valid quantized tokens (no mask: every row sees all of them); program
   ``s == NUM_SPLITS`` covers the ring with the causal mask. Each writes its rows' partial
   ``(m, l, acc)``.
2. ``_decode_attention_combine_kernel`` over the ``B * T`` rows merges them into ``out``.

``NUM_SPLITS`` depends only on shapes and the GPU's SM count (never on ``lens``): fixed shapes,
no host sync, capturable in a CUDA graph.
"""
from __future__ import annotations

import functools
import os
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from . import _gdc as gdc
from ._checks import FLOAT_DTYPES, check_choice, check_tensor, sm_count as sm_count_of
from .attention_decode import (_HEAD_DIMS, _LOG2E, MAX_SPLITS, _check_inputs,
                               _decode_attention_combine_kernel, _dequant_last, _load_keys_t,
                               _load_rows, _load_values, _region_ref, _round_to)
from .cache_layout import ring_length, value_group
from . import recall as rc


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def _attend_rows(q, k_t, v, valid, m_i, l_i, acc, qk_scale, ELEM: tl.constexpr,
                 DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                 BF16_BY_HAND: tl.constexpr):
    """One online-softmax step of BLOCK_M query rows over a block of BLOCK_N tokens.

    q: (BLOCK_M, D) in DOT_DTYPE; k_t: (D, BLOCK_N) and v: (BLOCK_N, D) holding model-dtype
    (ELEM) values; valid: (BLOCK_M, BLOCK_N) or (1, BLOCK_N) bool. m_i, l_i: (BLOCK_M,) fp32
    running max (log2 domain, a finite floor: a row may see no token of a ring block) and
    denominator; acc: (BLOCK_M, D) fp32.
    """
    s = tl.dot(q, k_t.to(DOT_DTYPE), input_precision=INPUT_PRECISION) * qk_scale
    s = tl.where(valid, s, float("-inf"))                                # (BLOCK_M, BLOCK_N)
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    # p is rounded to the model dtype like in any fp16/bf16 flash attention.
    p_lo = _round_to(p, ELEM, BF16_BY_HAND).to(DOT_DTYPE)
    pv = tl.dot(p_lo, v.to(DOT_DTYPE), input_precision=INPUT_PRECISION)    # (BLOCK_M, D)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _tail_attention_split_kernel(
    q_ptr, k_ptr, ks_ptr, kz_ptr, v_ptr, vs_ptr, vz_ptr, kr_ptr, vr_ptr, lens_ptr,
    bm_ptr, rk_ptr, rv_ptr, ridx_ptr,
    m_ptr, l_ptr, acc_ptr,
    qk_scale,
    stride_qb, stride_qt, stride_qh, stride_qd,
    ROWS, H_KV, T_CAP, RING_ROWS, NUM_SPLITS, K_REC,
    GQA: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr,
    BITS: tl.constexpr, G: tl.constexpr, GV: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, BF16_BY_HAND: tl.constexpr,
    RECALL: tl.constexpr, PDL: tl.constexpr,
):
    """Program (b * H_kv + h, mb, s): query rows ``m = mb * BLOCK_M + arange(BLOCK_M)`` of KV
    group h of slot b, ``m = t * GQA + g`` for chunk row t and query head h * GQA + g (the
    dots' M axis), against split s: splits ``s < NUM_SPLITS`` cover an equal, block-aligned
    share of the slot's valid quantized tokens (seen by every row), split ``NUM_SPLITS`` the
    ring (row t sees its first ``lens[b, 1] + t`` tokens). Writes the partials ``(m, l, acc)``
    of its rows to ``(B * ROWS, H_q, S)`` / ``(B * ROWS, H_q, S, D)`` fp32, S = NUM_SPLITS + 1,
    which ``_decode_attention_combine_kernel`` merges. RECALL (``minikv::tail_attention_recall``):
    the quantized splits skip the positions that ``ridx`` names (a bitmap of the plane's
    positions, built by each split for its range, as decode attention's recall does) and the
    ring's program first attends the recall rows ``rk``/``rv`` (``(B, H_kv, K_REC, D)``, full
    precision, seen by every row)."""
    gdc.launch_dependents_then_wait(PDL)  # nothing is read or written before this
    bh = tl.program_id(0)
    b = bh // H_KV
    h = bh % H_KV
    split = tl.program_id(2)
    # int64: Bmax * H_kv * T_cap * D exceeds 2^31 for large caches; offsets inside one plane fit.
    plane = b.to(tl.int64) * H_KV + h
    # Clamping keeps a corrupt length from reading outside the buffers.
    n_quant = tl.minimum(tl.load(lens_ptr + 2 * b), T_CAP)
    n_ring = tl.load(lens_ptr + 2 * b + 1)

    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    t = offs_m // GQA                                                     # chunk row
    head = h * GQA + offs_m % GQA                                         # query head
    row_ok = t < ROWS  # rows >= ROWS are padding: q = 0, never stored
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + b * stride_qb + t[:, None] * stride_qt + head[:, None] * stride_qh
                + offs_d[None, :] * stride_qd, mask=row_ok[:, None], other=0.0).to(DOT_DTYPE)

    m_i = tl.full((BLOCK_M,), -1.0e30, tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    elem_ty = kr_ptr.dtype.element_ty
    # (read only with RECALL) the plane's recall bitmap scratch and its K_REC recall indices
    bm_plane = bm_ptr + plane * tl.cdiv(T_CAP, 32)
    rec_plane = plane * K_REC

    if split < NUM_SPLITS:
        # -- quantized region: this split's block-aligned share of [0, n_quant), every row
        split_len = tl.cdiv(tl.cdiv(n_quant, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = split * split_len
        hi = tl.minimum(lo + split_len, n_quant)
        if RECALL:
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
        for start in range(lo, hi, BLOCK_N):
            tokens = start + tl.arange(0, BLOCK_N)
            valid = rc.kept(bm_plane, tokens, hi, RECALL)  # tokens < hi, less the recalled
            if BITS == 16:
                k_t, v = _load_rows(k_plane, v_plane, tokens, valid, D)
            else:
                # codes dequantized in registers, once per block for all BLOCK_M rows
                kw, ks, kz = _load_keys_t(k_plane, ks_plane, kz_plane, start, hi,
                                          D, BITS, G, BLOCK_N)
                vw, vs, vz = _load_values(v_plane, vs_plane, vz_plane, tokens, valid,
                                          D, BITS, GV)
                k_t = _round_to(_dequant_last(kw, ks, kz, BITS, 32 // BITS), elem_ty,
                                BF16_BY_HAND)                             # (D, BLOCK_N)
                v = _round_to(_dequant_last(vw, vs, vz, BITS, GV), elem_ty,
                              BF16_BY_HAND)                               # (BLOCK_N, D)
            m_i, l_i, acc = _attend_rows(q, k_t, v, valid[None, :], m_i, l_i, acc, qk_scale,
                                         elem_ty, DOT_DTYPE, INPUT_PRECISION, BF16_BY_HAND)
    else:
        if RECALL:
            # -- first the recall rows: full-precision K/V of quantized positions, every row
            for start in range(0, K_REC, BLOCK_N):
                j = start + tl.arange(0, BLOCK_N)
                pos = tl.load(ridx_ptr + rec_plane + j, mask=j < K_REC, other=-1)
                ok = (pos >= 0) & (pos < n_quant)
                k_t, v = _load_rows(rk_ptr + rec_plane * D, rv_ptr + rec_plane * D, j, ok, D)
                m_i, l_i, acc = _attend_rows(q, k_t, v, ok[None, :], m_i, l_i, acc, qk_scale,
                                             elem_ty, DOT_DTYPE, INPUT_PRECISION, BF16_BY_HAND)
        # -- residual ring, causal: row t sees ring tokens [0, n_ring + t)
        seen = tl.minimum(n_ring + t, RING_ROWS)                           # (BLOCK_M,)
        hi = tl.minimum(n_ring + tl.minimum(tl.program_id(1) * BLOCK_M + BLOCK_M - 1,
                                            ROWS * GQA - 1) // GQA, RING_ROWS)
        ring_plane = plane * RING_ROWS * D
        for start in range(0, hi, BLOCK_N):
            tokens = start + tl.arange(0, BLOCK_N)
            k_t, v = _load_rows(kr_ptr + ring_plane, vr_ptr + ring_plane, tokens, tokens < hi,
                                D)
            m_i, l_i, acc = _attend_rows(q, k_t, v, tokens[None, :] < seen[:, None], m_i, l_i,
                                         acc, qk_scale, elem_ty, DOT_DTYPE, INPUT_PRECISION,
                                         BF16_BY_HAND)

    # -- partials of this program's rows: row (b * ROWS + t) * H_q + head, slot `split`
    rows = ((b * ROWS + t) * (H_KV * GQA) + head) * (NUM_SPLITS + 1) + split
    tl.store(m_ptr + rows, m_i, mask=row_ok)
    tl.store(l_ptr + rows, l_i, mask=row_ok)
    tl.store(acc_ptr + rows[:, None] * D + offs_d[None, :], acc, mask=row_ok[:, None])


# ----------------------------------------------------------------------------------------------
# Launcher (callable on CPU tensors under TRITON_INTERPRET=1)
# ----------------------------------------------------------------------------------------------


class _TailPlan(NamedTuple):
    """One launch of the split kernel: splits of the quantized region, the tiles (BLOCK_M query
    rows x BLOCK_N tokens), warps and pipeline stages."""

    num_splits: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@functools.lru_cache(maxsize=256)  # asked at every launch (each layer of a tail chunk)
def _tail_plan(dtype: torch.dtype, bits: int, group_size: int, head_dim: int, batch: int,
               rows: int, h_q: int, h_kv: int, capacity: int, sm_count: int) -> _TailPlan:
    """Tiles as a flash-attention forward's, sized so that ptxas (sm_90) spills nothing on the
    usual shapes: fp16/bf16 models BLOCK_M 128 query rows (a KV group's chunk rows x heads) x
    BLOCK_N 64 tokens at D 128 on 8 warps (bits 2: 236 registers a thread, so one program per
    SM), fewer rows for D 256 or longer key groups (blocks hold whole groups); fp32 models
    (dots on the FMA units, which spilled kilobytes a thread at 64 x 32) 32 x 16 on 8 warps
    (108 registers). Splits: as many as keep the quantized programs within 2 per SM (whole
    waves of equal programs; the partials are then at most ``2 * SMs * BLOCK_M * D`` fp32
    whatever B and T), never a full-capacity region cut into pieces shorter than 4 blocks, at
    most 64."""
    group = group_size if bits != 16 else 16
    if dtype == torch.float32:
        block_n = max(16, group)
        block_m = max(16, min(32, 65536 // (block_n * head_dim)))
    else:
        block_n = max(64 if head_dim <= 128 else 32, group)
        block_m = min(128, 16384 // head_dim, 8192 // block_n)
    block_m = min(block_m, max(16, triton.next_power_of_2(rows * (h_q // h_kv))))
    warps = 8 if dtype == torch.float32 or block_m * head_dim >= 8192 else 4
    programs = batch * h_kv * triton.cdiv(rows * (h_q // h_kv), block_m)
    want = 2 * sm_count // programs
    useful = max(1, capacity // (4 * block_n))
    return _TailPlan(max(1, min(want, useful, 64)), block_m, block_n, warps, 2)


def _dot_mode(dtype: torch.dtype) -> tuple:
    """(DOT_DTYPE, INPUT_PRECISION, BF16_BY_HAND) of the tail's kernels for a model dtype. As
    decode attention's launcher: the interpreter (triton 3.9) mishandles bf16 (its tl.dot
    multiplies the raw bits, its casts truncate), so there bf16 values are rounded by hand and
    kept in fp32; fp32 models keep exact fp32 products."""
    bf16_by_hand = os.environ.get("TRITON_INTERPRET") == "1" and dtype == torch.bfloat16
    if dtype == torch.float32 or bf16_by_hand:
        return tl.float32, "ieee", bf16_by_hand
    return (tl.float16 if dtype == torch.float16 else tl.bfloat16), "tf32", False


def _tail_partials(
    q, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring, lens,
    scale: float, bits: int, group_size: int, plan: Optional[_TailPlan] = None,
    recall: Optional[tuple] = None,
) -> tuple:
    """The split launch, grid ``(B * H_kv, ceil(T * GQA / BLOCK_M), NUM_SPLITS + 1)``: each
    row's partials ``m, l (B * T, H_q, S)`` (log2 domain) and ``acc (B * T, H_q, S, D)`` fp32,
    S = NUM_SPLITS + 1, and the plan (``_tail_plan``'s by default)."""
    batch, rows, h_q, d = q.shape
    h_kv, ring_rows = k_ring.shape[1], k_ring.shape[2]
    gqa = h_q // h_kv
    capacity = k_cache.shape[2] if bits == 16 else v_cache.shape[2]
    if plan is None:
        plan = _tail_plan(q.dtype, bits, group_size, d, batch, rows, h_q, h_kv, capacity,
                          sm_count_of(q.device))
    for name, n, low in (("block_m", plan.block_m, 16), ("block_n", plan.block_n, 16)):
        if n < low or n & (n - 1):
            raise ValueError(f"{name}: expected a power of two >= {low}, got {n}")
    if bits != 16 and plan.block_n % group_size:
        raise ValueError(f"block_n: expected a multiple of group_size={group_size}, "
                         f"got {plan.block_n}")
    if not 1 <= plan.num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits: expected 1..{MAX_SPLITS}, got {plan.num_splits}")
    n_slots = plan.num_splits + 1  # + the ring's split

    m = torch.empty(batch * rows, h_q, n_slots, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(batch * rows, h_q, n_slots, d, dtype=torch.float32, device=q.device)
    dot_dtype, precision, bf16_by_hand = _dot_mode(q.dtype)
    pdl = gdc.supported(q.device)
    if recall is None:  # never read (RECALL off): stand-ins
        bitmap, recall_k, recall_v, recall_idx = lens, k_ring, v_ring, lens
    else:
        recall_k, recall_v, recall_idx = recall
        bitmap = torch.empty(batch * h_kv * triton.cdiv(capacity, 32), dtype=torch.int32,
                             device=q.device)
    grid = (batch * h_kv, triton.cdiv(rows * gqa, plan.block_m), n_slots)
    _tail_attention_split_kernel[grid](
        q, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring, lens,
        bitmap, recall_k, recall_v, recall_idx,
        m, l, acc,
        scale * _LOG2E, *q.stride(),
        rows, h_kv, capacity, ring_rows, plan.num_splits,
        0 if recall is None else recall_idx.shape[2],
        GQA=gqa, BLOCK_M=plan.block_m, D=d,
        BITS=bits, G=group_size, GV=value_group(group_size, d), BLOCK_N=plan.block_n,
        DOT_DTYPE=dot_dtype, INPUT_PRECISION=precision, BF16_BY_HAND=bf16_by_hand,
        RECALL=recall is not None, PDL=pdl,
        num_warps=plan.num_warps, num_stages=plan.num_stages, launch_pdl=pdl,
    )
    return m, l, acc, plan


def _tail_attention_triton(
    q, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring, lens,
    scale: float, bits: int, group_size: int, plan: Optional[_TailPlan] = None,
    recall: Optional[tuple] = None,
) -> torch.Tensor:
    """The CUDA implementation of :func:`tail_attention` (inputs already validated; also
    callable on CPU tensors under TRITON_INTERPRET=1), and with ``recall = (recall_k, recall_v,
    recall_idx)`` of :func:`.attention_tail_recall.tail_attention_recall`'s attention. Two
    launches: the split kernel (``_tail_partials``), then decode attention's combine over the
    ``B * T`` rows. ``plan``: ``_tail_plan``'s by default (tests and the benchmark pass
    others)."""
    batch, rows, h_q, d = q.shape
    m, l, acc, plan = _tail_partials(q, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero,
                                     k_ring, v_ring, lens, scale, bits, group_size, plan, recall)
    n_slots = plan.num_splits + 1
    out = q.new_empty(q.shape)                                            # (B, T, H_q, D)
    pdl = gdc.supported(q.device)
    # (the combine's lse_ref, update and their strides belong to its RECALL mode: never read)
    block_d = min(d, 32)
    out_rows = out.view(batch * rows, h_q, d)
    _decode_attention_combine_kernel[(batch * rows * h_q, d // block_d)](
        m, l, acc, out_rows, m, lens, lens, h_q, *out_rows.stride(), 0, 0, n_slots,
        D=d, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(n_slots),
        BF16_BY_HAND=_dot_mode(q.dtype)[2], ROWS=1, RECALL=False, PDL=pdl, num_warps=4,
        launch_pdl=pdl,
    )
    return out


# ----------------------------------------------------------------------------------------------
# Pure-PyTorch reference (same signature and output layout; runs on any device, syncs on lens)
# ----------------------------------------------------------------------------------------------


def _tail_probs_ref(qb: torch.Tensor, keys: torch.Tensor, first_row: int, seen0: int, gqa: int,
                    scale: float) -> torch.Tensor:
    """fp32 softmax probabilities of chunk rows ``first_row ..`` over ``keys (H_kv, T_b, D)``
    (the region, then the ring): ``qb (H_kv, rows * gqa, D)``, row r's head g at ``r * gqa +
    g``; chunk row r sees the first ``seen0 + r`` keys (``seen0``: row 0's, ``lens[b, 0] +
    lens[b, 1]``). Returns ``(H_kv, rows * gqa, T_b)``."""
    rows = qb.shape[1] // gqa
    scores = qb @ keys.transpose(1, 2) * scale
    last = seen0 + torch.arange(first_row, first_row + rows,
                                device=qb.device).repeat_interleave(gqa)
    hidden = torch.arange(keys.shape[1], device=qb.device)[None, :] >= last[:, None]
    return torch.softmax(scores.masked_fill_(hidden, float("-inf")), dim=-1)


def tail_attention_ref(
    q, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring, lens,
    scale: float, bits: int, group_size: int, recall: Optional[tuple] = None,
) -> torch.Tensor:
    """Reference for :func:`tail_attention`: per slot, the valid quantized region dequantized and
    the ring up to the last row's token in fp32, one fp32 softmax per (row, head) with the ring
    tokens after a row's own masked out; the output is cast to q's dtype. With ``recall =
    (recall_k, recall_v, recall_idx)`` (``tail_attention_recall``'s attention; a head's indices
    distinct, as a top-k gives them: the kernel would attend a repeated index's row twice),
    every position ``0 <= recall_idx[b, h, j] < lens[b, 0]`` of the region takes ``recall_k[b,
    h, j]`` / ``recall_v[b, h, j]`` first."""
    batch, rows, h_q, d = q.shape
    h_kv = k_ring.shape[1]
    gqa = h_q // h_kv
    out = q.new_empty(q.shape)
    for b, (n_quant, n_ring) in enumerate(lens[:batch].tolist()):
        k, v = _region_ref(k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, b, n_quant, bits,
                           group_size)                                   # (H_kv, n_quant, D)
        if recall is not None:
            recall_k, recall_v, recall_idx = recall
            k, v = k.clone(), v.clone()  # (views of an fp32 cache at bits 16)
            for h, j in ((recall_idx[b] >= 0) & (recall_idx[b] < n_quant)).nonzero().tolist():
                t = int(recall_idx[b, h, j])
                k[h, t], v[h, t] = recall_k[b, h, j].float(), recall_v[b, h, j].float()
        seen = n_ring + rows - 1                                           # the last row's ring
        k = torch.cat([k, k_ring[b, :, :seen].float()], dim=1)             # (H_kv, T_b, D)
        v = torch.cat([v, v_ring[b, :, :seen].float()], dim=1)
        # (T, H_q, D) -> (H_kv, T * gqa, D): row r, head h * gqa + g at r * gqa + g
        qb = q[b].float().reshape(rows, h_kv, gqa, d).transpose(0, 1).reshape(h_kv, rows * gqa, d)
        probs = _tail_probs_ref(qb, k, 0, n_quant + n_ring, gqa, scale)  # (H_kv, T * gqa, T_b)
        ob = (probs @ v).view(h_kv, rows, gqa, d).transpose(0, 1)          # (T, H_kv, gqa, D)
        out[b] = ob.reshape(rows, h_q, d).to(q.dtype)
    return out


# ----------------------------------------------------------------------------------------------
# Registered op: the reference by default (CPU), the Triton kernel on CUDA
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("minikv::tail_attention", mutates_args=())
def _tail_attention_op(
    q: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
    v_cache: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor,
    k_ring: torch.Tensor, v_ring: torch.Tensor, lens: torch.Tensor,
    scale: float, bits: int, group_size: int,
) -> torch.Tensor:
    return tail_attention_ref(q, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring,
                              v_ring, lens, scale, bits, group_size)


@_tail_attention_op.register_fake
def _(q, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring, lens,
      scale, bits, group_size):
    return q.new_empty(q.shape)


_tail_attention_op.register_kernel("cuda")(_tail_attention_triton)


# ----------------------------------------------------------------------------------------------
# Public wrapper
# ----------------------------------------------------------------------------------------------


def _check_tail_inputs(q, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring,
                       lens, bits, group_size):
    """q (B, T, H_q, D) itself, then the layer and the rest against decode attention's checks
    (on row 0), then T against the ring's length."""
    check_tensor("q", q, ndim=4, dtypes=FLOAT_DTYPES)
    check_choice("head_dim (q.shape[3])", q.shape[3], _HEAD_DIMS)
    if q.shape[1] < 1:
        raise ValueError(f"q: expected at least one query row (q.shape[1]), got shape "
                         f"{tuple(q.shape)}")
    _check_inputs(q[:, 0], k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring,
                  lens, bits, group_size)
    ring = ring_length(k_ring.shape[2], bits, group_size)
    if q.shape[1] > ring:
        raise ValueError(f"q: expected query rows T (q.shape[1]) <= the ring's length "
                         f"R={ring}, got shape {tuple(q.shape)}")


def tail_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
    v_cache: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor,
    k_ring: torch.Tensor, v_ring: torch.Tensor, lens: torch.Tensor,
    scale: float, bits: int = 2, group_size: int = 16,
) -> torch.Tensor:
    """Attention of T consecutive new tokens per sequence over one layer's compressed cache and
    each other (the prefill of a prompt's tail after a cached prefix).

    For slot ``b < B``, query row ``r`` and query head ``i`` (KV head ``i // (H_q / H_kv)``):
    one softmax over the slot's ``lens[b, 0]`` quantized tokens followed by its first
    ``lens[b, 1] + r`` ring tokens. ``lens[b, 1]`` counts row 0's token; the T rows' K/V sit in
    ring rows ``lens[b, 1] - 1 .. lens[b, 1] - 2 + T``, written by the caller before the call
    (rows past the first are not counted in ``lens``): each row sees itself, not the rows after
    it. With T = 1 this is :func:`.attention_decode.decode_attention`. Slots ``>= B`` are never
    read. Reads ``lens`` on the device (no host sync on CUDA); safe to capture in a CUDA graph.

    Args:
        q: ``(B, T, H_q, D)`` fp16/bf16/fp32, any strides: the T tokens' queries in order;
            ``B <= Bmax``, ``1 <= T <= R`` (the ring's length), ``D`` in {16, 32, 64, 128, 256},
            ``H_q % H_kv == 0``.
        k_cache ... v_ring: one layer's buffers, as :func:`.attention_decode.decode_attention`
            (bits 1/2/4 packed codes with fp16 scales and zeros, or bits 16 unquantized).
        lens: ``(Bmax, 2)`` int32 on q's device: ``lens[b, 0]`` quantized tokens (a multiple of
            G, <= T_cap), ``lens[b, 1] >= 1`` ring tokens counting row 0's, with ``lens[b, 1] - 1
            + T`` at most the ring's rows. Not checked against the buffers (that would sync);
            the kernel clamps them to the buffers.
        scale: softmax scale, usually ``D ** -0.5``.
        bits: 1, 2 or 4 (quantized) or 16 (no quantization).
        group_size: G in {16, 32, 64, 128} (ignored when bits == 16).

    Returns:
        ``(B, T, H_q, D)`` in q's dtype, contiguous.

    Raises:
        ValueError: a shape, dtype or device inconsistent with the above.
    """
    _check_tail_inputs(q, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring,
                       lens, bits, group_size)
    return torch.ops.minikv.tail_attention(q, k_cache, k_scale, k_zero, v_cache, v_scale,
                                           v_zero, k_ring, v_ring, lens, float(scale), bits,
                                           group_size)
