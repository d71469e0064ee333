"""Tail attention with recall (SpeCache in the tail prefill, issue 47).

A prompt's tail prefilled after a cached, quantized prefix (the question after a document
compressed first) attends to the 2-bit region. Decode's recall cannot repair that afterwards:
the tail's own K/V, computed from hidden states that attended to the 2-bit region, stay in the
ring. So the tail recalls too, per chunk, layer and KV head: the ``K`` quantized positions the
chunk attends to most take their full-precision host rows in its attention (context first,
``preset("accurate")``, SmolLM2-135M, 240 needle prompts on an H100: 72.9 -> 84.2%, question
last 85.0%; ``perf/NOTES.md``, "Recall in the tail prefill"). Three ops, in order:

1. ``minikv::tail_recall_select``: the ranking, from the chunk's queries against the 2-bit keys.
   The mass of position ``t`` for KV head ``h`` is the sum, over the chunk's rows ``r`` and
   the query heads ``i`` of the group, of ``softmax(q[r, i] . K_r^T * scale)[t]``, ``K_r`` the
   dequantized region followed by the ring tokens row ``r`` sees (``tail_attention``'s keys).
   The top ``K`` positions by mass (single positions: the config's ``recall_block`` ranks
   decode's blocks, not the tail's), once a layer and chunk of the tail prefill (never in the
   decode step). On CUDA, with no host sync: the tail kernel's split launch gives each row's
   log-sum-exp (``_tail_partials``, its partials merged in torch), ``_tail_mass_kernel`` each
   position's mass (the region's codes dequantized once for every row block, no score
   materialized; -1 past the slot's tokens), then one ``torch.topk`` over the capacity.
2. ``minikv::recall_gather`` (:mod:`.recall`): the host rows of those positions into the
   device recall buffers, read in place from the pinned store.
3. ``minikv::tail_attention_recall``: ``tail_attention`` over the region in which the recalled
   positions take their host rows (:mod:`.attention_tail`'s kernel under ``RECALL``; a head's
   indices distinct, as the top-k gives them).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_tensor
from .attention_decode import (_LOG2E, _dequant_last, _load_keys_t, _region_keys_ref,
                               _round_to)
from .attention_tail import (_check_tail_inputs, _dot_mode, _tail_attention_triton,
                             _tail_partials, _tail_probs_ref, tail_attention_ref)

# The reference materializes the scores a block of query rows at a time: at most this many
# fp32 elements (256 MiB, twice that with softmax's output), whatever the chunk's length (the
# 8B shape at 32k: 63 rows of a KV group's 4 heads a block).
_SCORE_ELEMENTS = 1 << 26


# ----------------------------------------------------------------------------------------------
# The ranking's kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def _tail_mass_kernel(
    q_ptr, k_ptr, ks_ptr, kz_ptr, lens_ptr, lse2_ptr, mass_ptr,
    qk_scale,
    stride_qb, stride_qt, stride_qh, stride_qd,
    ROWS, H_KV, T_CAP,
    GQA: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
    G: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, BF16_BY_HAND: tl.constexpr,
):
    """Program (b * H_kv + h, j): positions ``j * BLOCK_N ..`` of KV head h of slot b. Their
    keys are dequantized once; then for every block of BLOCK_M of the group's T * GQA (row,
    head) pairs (``m = t * GQA + g``, as the tail kernel's), ``exp2(s - lse2)`` summed over the
    pairs, s the scaled score in the log2 domain and lse2 the pair's log-sum-exp over its whole
    attention (``lse2_ptr (B * T, H_q)``). Writes ``mass (B, H_kv, T_CAP)`` fp32, -1 at the
    positions the slot does not hold."""
    bh = tl.program_id(0)
    b = bh // H_KV
    h = bh % H_KV
    plane = b.to(tl.int64) * H_KV + h
    n_quant = tl.minimum(tl.load(lens_ptr + 2 * b), T_CAP)
    start = tl.program_id(1) * BLOCK_N
    tokens = start + tl.arange(0, BLOCK_N)
    mass = tl.zeros((BLOCK_N,), tl.float32)
    if start < n_quant:
        P: tl.constexpr = 32 // BITS
        kw, ks, kz = _load_keys_t(k_ptr + plane * (T_CAP // P * D),
                                  ks_ptr + plane * (T_CAP // G * D),
                                  kz_ptr + plane * (T_CAP // G * D), start, n_quant, D, BITS, G,
                                  BLOCK_N)
        k_t = _round_to(_dequant_last(kw, ks, kz, BITS, P), q_ptr.dtype.element_ty,
                        BF16_BY_HAND).to(DOT_DTYPE)                       # (D, BLOCK_N)
        offs_d = tl.arange(0, D)
        for m0 in range(0, ROWS * GQA, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            t = offs_m // GQA                                             # chunk row
            head = h * GQA + offs_m % GQA                                 # query head
            row_ok = t < ROWS
            q = tl.load(q_ptr + b * stride_qb + t[:, None] * stride_qt
                        + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                        mask=row_ok[:, None], other=0.0).to(DOT_DTYPE)
            lse2 = tl.load(lse2_ptr + (b * ROWS + t) * (H_KV * GQA) + head, mask=row_ok,
                           other=float("inf"))                          # (BLOCK_M,)
            s = tl.dot(q, k_t, input_precision=INPUT_PRECISION) * qk_scale
            mass += tl.sum(tl.exp2(s - lse2[:, None]), axis=0)
    tl.store(mass_ptr + plane * T_CAP + tokens, tl.where(tokens < n_quant, mass, -1.0),
             mask=tokens < T_CAP)


def _tail_recall_select_triton(q, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring,
                               v_ring, lens, scale: float, bits: int, group_size: int,
                               k: int, plan=None) -> torch.Tensor:
    """The CUDA implementation of ``minikv::tail_recall_select`` (inputs validated; also
    callable on CPU tensors under TRITON_INTERPRET=1). The rows' log-sum-exp from the tail
    kernel's partials (``plan``: its launch, ``_tail_plan``'s by default), the mass kernel over
    the capacity, one top-k; no host sync. Bits 1, 2 or 4 (the mass kernel reads codes)."""
    if bits == 16:
        raise ValueError("bits: expected 1, 2 or 4 (the ranking's kernel reads codes; a 16-bit "
                         "cache has nothing to recall), got 16")
    batch, rows, h_q, d = q.shape
    h_kv, capacity = k_ring.shape[1], v_cache.shape[2]
    m, l, _, _ = _tail_partials(q, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring,
                                v_ring, lens, scale, bits, group_size, plan)
    top = m.amax(-1, keepdim=True)                                         # (B * T, H_q, 1)
    lse2 = (top.squeeze(-1) + torch.log2((l * torch.exp2(m - top)).sum(-1))).contiguous()
    mass = torch.empty(batch, h_kv, capacity, dtype=torch.float32, device=q.device)
    dot_dtype, precision, bf16_by_hand = _dot_mode(q.dtype)
    # tiles: a whole number of key groups; (D, BLOCK_N) keys dequantized once a program, 8
    # warps where they are 16k values or more (not tuned: not measured yet)
    block_n = max(32 if q.dtype == torch.float32 else 64, group_size)
    block_m = 32 if q.dtype == torch.float32 else 64
    warps = 8 if block_n * d >= 16384 else 4
    _tail_mass_kernel[(batch * h_kv, triton.cdiv(capacity, block_n))](
        q, k_cache, k_scale, k_zero, lens, lse2, mass, scale * _LOG2E, *q.stride(),
        rows, h_kv, capacity,
        GQA=h_q // h_kv, BLOCK_M=block_m, D=d, BITS=bits, G=group_size, BLOCK_N=block_n,
        DOT_DTYPE=dot_dtype, INPUT_PRECISION=precision, BF16_BY_HAND=bf16_by_hand,
        num_warps=warps)
    top = torch.topk(mass, min(k, capacity), dim=-1)
    idx = torch.where(top.values >= 0, top.indices, -1).to(torch.int32)    # (B, H_kv, <= k)
    if idx.shape[-1] < k:
        idx = torch.cat([idx, idx.new_full((batch, h_kv, k - idx.shape[-1]), -1)], dim=-1)
    return idx


# ----------------------------------------------------------------------------------------------
# The ranking's reference and op
# ----------------------------------------------------------------------------------------------


def tail_recall_select_ref(q, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring,
                           v_ring, lens, scale: float, bits: int, group_size: int,
                           k: int) -> torch.Tensor:
    """Reference for the ranking (the op's arguments; syncs on ``lens``, free on the CPU):
    ``(B, H_kv, k)`` int32 positions by decreasing mass, -1 where the slot holds fewer than
    ``k``."""
    batch, rows, h_q, d = q.shape
    h_kv = k_ring.shape[1]
    gqa = h_q // h_kv
    out = torch.full((batch, h_kv, k), -1, dtype=torch.int32, device=q.device)
    for b, (n_quant, n_ring) in enumerate(lens[:batch].tolist()):
        if n_quant == 0:
            continue
        keys = _region_keys_ref(k_cache, k_scale, k_zero, b, n_quant, bits,
                                group_size)                               # (H_kv, n_quant, D)
        keys = torch.cat([keys, k_ring[b, :, :n_ring + rows - 1].float()], dim=1)
        qb = q[b].float().reshape(rows, h_kv, gqa, d).transpose(0, 1)      # (H_kv, T, gqa, D)
        mass = torch.zeros(h_kv, n_quant, dtype=torch.float32, device=q.device)
        step = max(1, _SCORE_ELEMENTS // (h_kv * gqa * keys.shape[1]))
        for r0 in range(0, rows, step):
            probs = _tail_probs_ref(qb[:, r0:r0 + step].reshape(h_kv, -1, d), keys, r0,
                                    n_quant + n_ring, gqa, scale)
            mass += probs[:, :, :n_quant].sum(1)
        top = torch.topk(mass, min(k, n_quant), dim=-1).indices
        out[b, :, :top.shape[1]] = top.to(torch.int32)
    return out


@torch.library.custom_op("minikv::tail_recall_select", mutates_args=())
def _tail_recall_select_op(
    q: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
    v_cache: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor,
    k_ring: torch.Tensor, v_ring: torch.Tensor, lens: torch.Tensor,
    scale: float, bits: int, group_size: int, k: int,
) -> torch.Tensor:
    return tail_recall_select_ref(q, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring,
                                  v_ring, lens, scale, bits, group_size, k)


@_tail_recall_select_op.register_fake
def _(q, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring, lens, scale, bits,
      group_size, k):
    return q.new_empty((q.shape[0], k_ring.shape[1], k), dtype=torch.int32)


_tail_recall_select_op.register_kernel("cuda")(_tail_recall_select_triton)


@torch.library.custom_op("minikv::tail_attention_recall", mutates_args=())
def _tail_attention_recall_op(
    q: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
    v_cache: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor,
    k_ring: torch.Tensor, v_ring: torch.Tensor, lens: torch.Tensor,
    recall_k: torch.Tensor, recall_v: torch.Tensor, recall_idx: torch.Tensor,
    scale: float, bits: int, group_size: int,
) -> torch.Tensor:
    return tail_attention_ref(q, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring,
                              v_ring, lens, scale, bits, group_size,
                              recall=(recall_k, recall_v, recall_idx))


@_tail_attention_recall_op.register_fake
def _(q, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring, lens, recall_k,
      recall_v, recall_idx, scale, bits, group_size):
    return q.new_empty(q.shape)


@_tail_attention_recall_op.register_kernel("cuda")
def _(q, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring, lens, recall_k,
      recall_v, recall_idx, scale, bits, group_size):
    return _tail_attention_triton(q, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring,
                                  v_ring, lens, scale, bits, group_size,
                                  recall=(recall_k, recall_v, recall_idx))


def tail_attention_recall(
    q: torch.Tensor,
    k_cache: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
    v_cache: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor,
    k_ring: torch.Tensor, v_ring: torch.Tensor, lens: torch.Tensor,
    host_k: torch.Tensor, host_v: torch.Tensor, recall_k: torch.Tensor, recall_v: torch.Tensor,
    scale: float, bits: int = 2, group_size: int = 16,
) -> torch.Tensor:
    """:func:`.attention_tail.tail_attention` with recall: per slot ``b < B`` and KV head, the
    ``K`` quantized positions with the most attention mass from the T rows (the module's rule)
    are read from host memory into ``recall_k``/``recall_v`` and take those full-precision K/V
    in the attention. No host sync on CUDA (the reference's ranking reads ``lens`` on the
    CPU).

    Args:
        q ... lens: as :func:`.attention_tail.tail_attention` (bits 1, 2 or 4: a 16-bit cache
            has nothing to recall).
        host_k, host_v: ``(B', H_kv, T_cap, D)`` in q's dtype, CPU, contiguous, ``B' >= B``:
            the host rows of slots ``0 .. B - 1`` (row ``t`` = quantized position ``t``), e.g.
            views ``store.k[s:s + 1]`` of a :class:`.recall.HostStore` for slot ``s``; pinned
            when q is on CUDA (the gather reads them in place; not checked here, which a traced
            call cannot do: a pageable tensor fails in the gather's launch).
        recall_k, recall_v: ``(B', H_kv, K, D)`` in q's dtype on q's device, contiguous,
            ``K >= 1``: overwritten with the recalled rows.

    Returns:
        ``(B, T, H_q, D)`` in q's dtype, contiguous.

    Raises:
        ValueError: a shape, dtype or device inconsistent with the above.
    """
    if bits == 16:
        raise ValueError("bits: expected 1, 2 or 4 (a 16-bit cache has nothing to recall), "
                         "got 16")
    _check_tail_inputs(q, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring,
                       lens, bits, group_size)
    batch, _, _, d = q.shape
    h_kv, capacity = k_ring.shape[1], v_cache.shape[2]
    check_tensor("host_k", host_k, shape=(None, h_kv, capacity, d), dtypes=(q.dtype,),
                 device="cpu", contiguous=True)
    check_tensor("host_v", host_v, shape=tuple(host_k.shape), dtypes=(q.dtype,), device="cpu",
                 contiguous=True)
    check_tensor("recall_k", recall_k, shape=(host_k.shape[0], h_kv, None, d),
                 dtypes=(q.dtype,), device=q.device, contiguous=True)
    check_tensor("recall_v", recall_v, shape=tuple(recall_k.shape), dtypes=(q.dtype,),
                 device=q.device, contiguous=True)
    if recall_k.shape[2] < 1:
        raise ValueError(f"recall_k: expected K >= 1 rows (recall_k.shape[2]), got shape "
                         f"{tuple(recall_k.shape)}")
    if host_k.shape[0] < batch:
        raise ValueError(f"host_k: expected at least B={batch} slots (q.shape[0]), got shape "
                         f"{tuple(host_k.shape)}")
    idx = torch.ops.minikv.tail_recall_select(q, k_cache, k_scale, k_zero, v_cache, v_scale,
                                              v_zero, k_ring, v_ring, lens, float(scale), bits,
                                              group_size, recall_k.shape[2])  # (B, H_kv, K)
    torch.ops.minikv.recall_gather(host_k, host_v, idx, recall_k, recall_v)
    return torch.ops.minikv.tail_attention_recall(q, k_cache, k_scale, k_zero, v_cache, v_scale,
                                                  v_zero, k_ring, v_ring, lens, recall_k,
                                                  recall_v, idx, float(scale), bits, group_size)
