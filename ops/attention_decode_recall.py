"""Decode attention with recall (SpeCache, issue 25): ``minikv::decode_attention_recall``.

It runs the two launches of :func:`.attention_decode.decode_attention` under the split kernel's
constexpr ``RECALL`` (off for ``minikv::decode_attention``, whose compiled kernels it leaves as
they are; the recall parts of that kernel are device functions of :mod:`.recall`):

1. the split launch: each quantized split first turns the plane's ``recall_idx`` into one bit
   per position of its range (``recall.mark_recalled``, into a ``(B, H_kv, ceil(T_cap / 32))`` int32
   scratch), then its blocks skip a recalled position by its bit (8 bytes per 64-token block,
   against the 8 KB of codes, scales and zeros the block reads at bits 2, D 128); the ring's
   program first attends the recall rows (``recall_k``/``recall_v``, full precision, seen by
   every query row) and then the ring, so the partials and the combine keep their shapes (the
   recall rows are model-dtype tokens like the ring's, and the ring's program is the shortest
   of the launch). Query rows: ``q (B, R, H_q, D)``, R in {1, 2}; the R rows of a KV group
   share the dots' N axis (``R * GQA <= 8``), so K/V are read once for all of them; row ``r``
   sees the ring up to ``lens[b, 1] + r`` (``lens`` counts row 0's token; each row sees
   itself, not the rows after it). The programs of the last row's heads also write, into the
   layer's plane of the ``(Bmax, L, H_kv, T)`` mass buffer, the attention mass of every
   position the next step holds quantized (the recall split at the recalled positions, from
   their full-precision scores; one byte a position, a code of its logarithm, 0 for ring
   tokens the next step does not flush), so that one top-k ranks every layer's plane at the
   step's end.
2. the combine, which also writes the last row's log-sum-exp to ``lse_ref`` (the next step's
   reference) and gives back the ring tokens the caller asks (``update``).

The kernels, their plan (``_plan``) and the launcher are :mod:`.attention_decode`'s; this module
is the op: its checks, its CUDA entry, its fp32 reference and its registration.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from ._checks import check_tensor
from .attention_decode import (_check_group, _check_inputs, _launch, _Plan, _region_ref,
                               check_launch)
from .cache_layout import check_base, ring_length
from .recall import mass_codes


def _decode_attention_recall_triton(
    q, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring, lens,
    recall_k, recall_v, recall_idx, lse_ref, mass, layer, update,
    scale: float, bits: int, group_size: int, plan: Union[_Plan, torch.Tensor, None] = None,
) -> torch.Tensor:
    """The CUDA implementation of :func:`decode_attention_recall` (same conditions as
    :func:`.attention_decode._decode_attention_triton`)."""
    batch, rows, h_q, d = q.shape
    out = q.new_empty(q.shape)                                              # (B, R, H_q, D)
    _launch(q, (k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring, lens),
            (recall_k, recall_v, recall_idx, lse_ref, mass, layer, update),
            out.view(batch * rows, h_q, d), scale, bits, group_size, plan)
    return out


# ----------------------------------------------------------------------------------------------
# Pure-PyTorch reference (same arguments; runs on any device, syncs on lens)
# ----------------------------------------------------------------------------------------------


def decode_attention_recall_ref(
    q, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring, lens,
    recall_k, recall_v, recall_idx, lse_ref, mass, layer, update, scale: float, bits: int,
    group_size: int,
) -> torch.Tensor:
    """Reference for :func:`decode_attention_recall`, in fp32 (same arguments; mutates ``mass``,
    ``lse_ref`` and ``lens``).

    Per slot ``b < B``: the quantized region is dequantized to fp32, every recall row ``j`` with
    ``0 <= recall_idx[b, h, j] < lens[b, 0]`` replaces position ``recall_idx[b, h, j]`` of head
    ``h`` by ``recall_k[b, h, j]`` / ``recall_v[b, h, j]``, and query row ``r`` attends to it
    followed by the first ``lens[b, 1] + r`` ring tokens. The last row's scores give
    ``mass[b, layer, h, t] = sum_i exp(s[b, i, t] - lse_ref[b, i])`` over the query heads ``i``
    of KV group ``h`` (stored as :func:`.recall.mass_codes`), for ``t < lens[b, 0]`` and for the
    ring's first R tokens (ring token j at ``lens[b, 0] + j``) when row 0 sees R of them (R: the
    ring's length, ``ring_length``); code 0 for its other ring tokens; the rest of ``mass`` is
    left as it is. Then ``lse_ref[b]`` = the
    last row's log-sum-exp and ``lens[b, 1] -= update[b]``, for the slots with ``update[b] >=
    0``.

    Returns ``out (B, R, H_q, D)`` in q's dtype.
    """
    batch, rows, h_q, d = q.shape
    h_kv = k_ring.shape[1]
    gqa = h_q // h_kv
    ring = ring_length(k_ring.shape[2], bits, group_size)
    out = q.new_empty(q.shape)
    for b, (n_quant, n_ring) in enumerate(lens[:batch].tolist()):
        n_ring += rows - 1  # the later rows' tokens follow row 0's, uncounted
        k, v = _region_ref(k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, b, n_quant, bits,
                           group_size)                                 # (H_kv, n_quant, D)
        pos = recall_idx[b].long()                                       # (H_kv, K)
        h, j = ((pos >= 0) & (pos < n_quant)).nonzero(as_tuple=True)
        # out of place: with bits 16 in fp32, k and v are the cache itself
        k = k.index_put((h, pos[h, j]), recall_k[b, h, j].float())
        v = v.index_put((h, pos[h, j]), recall_v[b, h, j].float())
        for r in range(rows):
            seen = max(n_ring - (rows - 1 - r), 0)
            kr = torch.cat([k, k_ring[b, :, :seen].float()], dim=1)       # (H_kv, T_br, D)
            vr = torch.cat([v, v_ring[b, :, :seen].float()], dim=1)
            qr = q[b, r].float().reshape(h_kv, gqa, d)                    # (H_kv, gqa, D)
            scores = qr @ kr.transpose(1, 2) * scale                      # (H_kv, gqa, T_br)
            out[b, r] = (torch.softmax(scores, dim=-1) @ vr).view(h_q, d).to(q.dtype)
        ref = lse_ref[b].float().view(h_kv, gqa, 1)
        got = torch.exp(scores - ref).sum(1)        # (H_kv, T_b): the last row sees every token
        flush = ring if n_ring - (rows - 1) >= ring else 0     # ring tokens the next step holds
        got[:, n_quant + flush:] = float("-inf")
        mass[b, int(layer[0]), :, :got.shape[1]] = mass_codes(got)
        if update[b] >= 0:
            lse_ref[b] = torch.logsumexp(scores, dim=-1).view(h_q)
            lens[b, 1] -= update[b]
    return out


# ----------------------------------------------------------------------------------------------
# Registered op: the reference by default (CPU), the Triton kernels on CUDA
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("minikv::decode_attention_recall",
                         mutates_args=("lens", "lse_ref", "mass"))
def _decode_attention_recall_op(
    q: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
    v_cache: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor,
    k_ring: torch.Tensor, v_ring: torch.Tensor, lens: torch.Tensor,
    recall_k: torch.Tensor, recall_v: torch.Tensor, recall_idx: torch.Tensor,
    lse_ref: torch.Tensor, mass: torch.Tensor, layer: torch.Tensor, update: torch.Tensor,
    scale: float, bits: int, group_size: int, launch: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    return decode_attention_recall_ref(q, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero,
                                       k_ring, v_ring, lens, recall_k, recall_v, recall_idx,
                                       lse_ref, mass, layer, update, scale, bits, group_size)


@_decode_attention_recall_op.register_fake
def _(q, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring, lens,
      recall_k, recall_v, recall_idx, lse_ref, mass, layer, update, scale, bits, group_size,
      launch=None):
    return q.new_empty(q.shape)


_decode_attention_recall_op.register_kernel("cuda")(_decode_attention_recall_triton)


# ----------------------------------------------------------------------------------------------
# Public wrapper
# ----------------------------------------------------------------------------------------------


def decode_attention_recall(
    q: torch.Tensor,
    k_cache: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
    v_cache: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor,
    k_ring: torch.Tensor, v_ring: torch.Tensor, lens: torch.Tensor,
    recall_k: torch.Tensor, recall_v: torch.Tensor, recall_idx: torch.Tensor,
    lse_ref: torch.Tensor, mass: torch.Tensor, layer: torch.Tensor, update: torch.Tensor,
    scale: float, bits: int = 2, group_size: int = 16, launch: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Decode attention with recall (SpeCache): R query rows per sequence over one layer's
    compressed cache in which the recalled positions take their full-precision K/V; also the
    statistic that chooses the next step's recall, and the step's bookkeeping after it.

    For slot ``b < B``, query row ``r`` and query head ``i`` (KV head ``h = i // (H_q /
    H_kv)``): one softmax over the slot's quantized tokens, where every position ``t =
    recall_idx[b, h, j]`` with ``0 <= t < lens[b, 0]`` has ``recall_k[b, h, j]`` /
    ``recall_v[b, h, j]`` in place of its dequantized key / value, followed by the first
    ``lens[b, 1] + r`` ring tokens: ``lens`` counts row 0's token (the ring row
    :func:`.cache_update.cache_begin_step` gave it), and the later rows' tokens sit in the ring
    rows after it, uncounted (:func:`.cache_update.cache_write_ring` with R tokens a slot); each
    row sees itself, not the rows after it. K/V are read once for the R rows. With no valid
    recall row and R = 1 it is :func:`.attention_decode.decode_attention`.

    The last row also writes, into this layer's plane ``mass[b, layer]``, for every position
    ``t`` the next step holds quantized, the attention its KV group pays it: ``mass[b, layer, h,
    t] = sum_i exp(s[b, i, t] - lse_ref[b, i])`` over the group's query heads ``i``, ``s`` the
    scaled score (from the recalled key where ``t`` is recalled). The next step holds every
    ``t < lens[b, 0]`` and, when the ring is full (row 0 sees its R tokens, R its length), the
    ring's tokens, which its flush moves to ``t = lens[b, 0] + j`` (ring row j); the ring's
    tokens it does not hold get code 0 (the speculative row's, and all while the ring fills),
    so that :func:`.recall.recall_topk` ranks the buffer as it is, every layer at once.
    ``lse_ref`` stands in for this row's own log-sum-exp, which would take a second pass: the
    previous step's scales the masses of a head by one factor, so the ranking by one head is
    exact and only the weights of a group's heads in the sum that :func:`.recall.recall_topk`
    ranks are off. ``mass`` holds one byte per position, the code of ``log2`` of the mass in
    steps of 1/8 (:func:`.recall.mass_codes`: masses within 9% may tie): 0.4% of a bf16
    cache's bytes at D 64, where fp32 would be 1.6%. Positions ``>= lens[b, 0] + lens[b, 1]``,
    other layers and slots ``>= B`` keep what they held (code 0 for an emptied slot: the
    caller's reset). A mass above 2^8 (a reference far below this step's scores) saturates at
    code 255.

    After the attention, for every slot ``b < B`` with ``update[b] >= 0``: ``lse_ref[b]``
    becomes the last row's own log-sum-exp (the next step's reference), and ``lens[b, 1] -=
    update[b]`` (SpeCache's pre-decoding gives its token back: it feeds it again next step). A
    token given back from a full ring leaves that ring's positions ranked one step early; the
    next attention ignores them (they are not below its ``lens[b, 0]``), they only take recall
    rows of that step. Both updates ride on the combine launch, not on launches of their own
    (with the ring write of both rows in one launch: H200, 8B shape, KIVI-2 + K 64, 8 x 4k
    6.41 -> 6.05 ms a step).

    Reads ``lens`` and ``recall_idx`` on the device (no host sync); safe to capture in a CUDA
    graph and replay after ``lens``, ``recall_idx``, the recall rows and ``lse_ref`` change in
    place. On CUDA two launches (splits, combine), the Triton kernel always.

    Args:
        q: ``(B, R, H_q, D)``, R in {1, 2}, any strides; the rest as
            :func:`.attention_decode.decode_attention`, and ``R * H_q / H_kv <= 8``.
        k_cache ... v_ring: the layer's buffers, as :func:`.attention_decode.decode_attention`.
        lens: the layer's ``(Bmax, 2)`` counters (the buffer itself, not a view); mutated.
        recall_k, recall_v: ``(Bmax, H_kv, K, D)`` in q's dtype, contiguous, K >= 1.
        recall_idx: ``(B', H_kv, K)`` int32, contiguous, ``B <= B' <= Bmax`` (a leading slice of
            the index buffer is fine): the quantized position of each recall row; -1 (or any
            value outside ``[0, lens[b, 0])``) = unused row. The valid positions of one (slot,
            KV head) must be distinct (not checked: that would sync); top-k positions are.
        lse_ref: ``(Bmax, H_q)`` fp32, contiguous, the buffer itself: the reference log-sum-exp
            of the last row's heads (natural log, of the scaled scores); rows ``b < B`` are
            overwritten with this step's.
        mass: ``(Bmax, L, H_kv, T_mass)`` uint8, ``T_mass >= T_cap + ring rows``, contiguous,
            the whole buffer (one plane per layer and slot, the largest capacity's length);
            mutated.
        layer: ``(1,)`` int32 on q's device: which of the L planes (a tensor, so that one
            compiled step serves every layer; read on the device, clamped to ``[0, L)``).
        update: ``(B,)`` int32, contiguous: per slot, -1 leaves its ``lse_ref`` and ``lens`` as
            they are (a slot the step does not advance); ``n >= 0`` updates ``lse_ref`` and
            gives back ``n`` ring tokens (0, or 1 when it pre-decodes; not checked).
        scale, bits, group_size, launch: as :func:`.attention_decode.decode_attention`
            (``launch``: the Triton kernel's, ``decode_attention_plan(..., recall=True)``).
        All on q's device.

    Returns:
        ``(B, R, H_q, D)`` in q's dtype, contiguous.

    Raises:
        ValueError: a shape, dtype or device inconsistent with the above.
    """
    _check_inputs(q, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring, lens,
                  bits, group_size, rows=True)
    check_base("lens", lens)
    batch, rows, h_q, d = q.shape
    b_max, h_kv = k_ring.shape[:2]
    _check_group(rows, h_q // h_kv)
    check_tensor("recall_k", recall_k, shape=(b_max, h_kv, None, d), dtypes=(q.dtype,),
                 device=q.device, contiguous=True)
    k = recall_k.shape[2]
    if k < 1:
        raise ValueError(f"recall_k: expected K >= 1 recall rows (dim 2), got shape "
                         f"{tuple(recall_k.shape)}")
    check_tensor("recall_v", recall_v, shape=(b_max, h_kv, k, d), dtypes=(q.dtype,),
                 device=q.device, contiguous=True)
    check_tensor("recall_idx", recall_idx, shape=(None, h_kv, k), dtypes=(torch.int32,),
                 device=q.device, contiguous=True)
    if not batch <= recall_idx.shape[0] <= b_max:
        raise ValueError(f"recall_idx: expected B={batch} <= recall_idx.shape[0] <= "
                         f"max_batch_size={b_max}, got shape {tuple(recall_idx.shape)}")
    check_tensor("lse_ref", lse_ref, shape=(b_max, h_q), dtypes=(torch.float32,),
                 device=q.device, contiguous=True)
    check_base("lse_ref", lse_ref)
    capacity = k_cache.shape[2] if bits == 16 else v_cache.shape[2]
    check_tensor("mass", mass, shape=(b_max, None, h_kv, None), dtypes=(torch.uint8,),
                 device=q.device, contiguous=True)
    if mass.shape[3] < capacity + k_ring.shape[2]:
        raise ValueError(f"mass: expected at least T_cap + ring rows = "
                         f"{capacity + k_ring.shape[2]} positions (dim 3), got shape "
                         f"{tuple(mass.shape)}")
    check_base("mass", mass)
    check_tensor("layer", layer, shape=(1,), dtypes=(torch.int32,), device=q.device)
    check_tensor("update", update, shape=(batch,), dtypes=(torch.int32,), device=q.device,
                 contiguous=True)
    check_launch(launch)
    return torch.ops.minikv.decode_attention_recall(
        q, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring, lens,
        recall_k, recall_v, recall_idx, lse_ref, mass, layer, update, float(scale), bits,
        group_size, launch)
