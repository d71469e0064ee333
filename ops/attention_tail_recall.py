"""Tail attention with recall (SpeCache in the tail prefill, issue 47).

A prompt's tail prefilled after a cached, quantized prefix (the question after a document
compressed first) attends to the 2-bit region. Decode's recall cannot repair that afterwards:
the tail's own K/V, computed from hidden states that attended to the 2-bit region, stay in the
ring. So the tail recalls too, per chunk, layer and KV head: the ``K`` quantized positions the
chunk attends to most take their full-precision host rows in its attention (context first,
SmolLM2-135M fp32, 10 needles at 4096 tokens: 60 -> 100% with decode's K = 64;
``perf/NOTES.md``, "Recall in the tail prefill"). Three ops, in order:

1. ``minikv::tail_recall_select``: the ranking, from the chunk's queries against the 2-bit keys.
   The mass of position ``t`` for KV head ``h`` is the sum, over the chunk's rows ``r`` and
   the query heads ``i`` of the group, of ``softmax(q[r, i] . K_r^T * scale)[t]``, ``K_r`` the
   dequantized region followed by the ring tokens row ``r`` sees (``tail_attention``'s keys).
   The top ``K`` positions by mass (single positions: the config's ``recall_block`` ranks
   decode's blocks, not the tail's), in plain torch ops over the dequantized keys, once a layer
   and chunk of the tail prefill (never in the decode step). The counts come from the host's
   copy of ``lens`` (the caller knows them): no sync with the device.
2. ``minikv::recall_gather`` (:mod:`.recall`): the host rows of those positions into the
   device recall buffers, read in place from the pinned store.
3. ``minikv::tail_attention_recall``: ``tail_attention`` over the region in which the recalled
   positions take their host rows (:mod:`.attention_tail`'s kernel under ``RECALL``; a head's
   indices distinct, as the top-k gives them).
"""
from __future__ import annotations

import torch

from ._checks import check_tensor
from .attention_decode import _region_keys_ref
from .attention_tail import _check_tail_inputs, _tail_attention_triton, tail_attention_ref

# The ranking's scores are materialized a block of query rows at a time: at most this many
# fp32 elements (256 MiB, twice that with softmax's output), whatever the chunk's length (the
# 8B shape at 32k: 63 rows of a KV group's 4 heads a block).
_SCORE_ELEMENTS = 1 << 26


def tail_recall_select_ref(q, k_cache, k_scale, k_zero, k_ring, lens_host, scale: float,
                           bits: int, group_size: int, k: int) -> torch.Tensor:
    """:func:`tail_attention_recall`'s ranking (the op's arguments; ``lens_host`` is read on the
    host, no sync): ``(B, H_kv, k)`` int32 positions by decreasing mass, -1 where the slot holds
    fewer than ``k``."""
    batch, rows, h_q, d = q.shape
    h_kv = k_ring.shape[1]
    gqa = h_q // h_kv
    out = torch.full((batch, h_kv, k), -1, dtype=torch.int32, device=q.device)
    for b, (n_quant, n_ring) in enumerate(lens_host[:batch].tolist()):
        if n_quant == 0:
            continue
        keys = _region_keys_ref(k_cache, k_scale, k_zero, b, n_quant, bits,
                                group_size)                               # (H_kv, n_quant, D)
        keys = torch.cat([keys, k_ring[b, :, :n_ring + rows - 1].float()], dim=1)
        qb = q[b].float().reshape(rows, h_kv, gqa, d).transpose(0, 1)      # (H_kv, T, gqa, D)
        mass = torch.zeros(h_kv, n_quant, dtype=torch.float32, device=q.device)
        step = max(1, _SCORE_ELEMENTS // (h_kv * gqa * keys.shape[1]))
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            scores = qb[:, r0:r1].reshape(h_kv, -1, d) @ keys.transpose(1, 2) * scale
            # row r sees the region and its first n_ring + r ring tokens
            last = n_quant + n_ring + torch.arange(r0, r1, device=q.device).repeat_interleave(gqa)
            hidden = torch.arange(keys.shape[1], device=q.device)[None, :] >= last[:, None]
            probs = torch.softmax(scores.masked_fill_(hidden, float("-inf")), dim=-1)
            mass += probs[:, :, :n_quant].sum(1)
        top = torch.topk(mass, min(k, n_quant), dim=-1).indices
        out[b, :, :top.shape[1]] = top.to(torch.int32)
    return out


@torch.library.custom_op("minikv::tail_recall_select", mutates_args=())
def _tail_recall_select_op(q: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor,
                           k_zero: torch.Tensor, k_ring: torch.Tensor, lens_host: torch.Tensor,
                           scale: float, bits: int, group_size: int, k: int) -> torch.Tensor:
    return tail_recall_select_ref(q, k_cache, k_scale, k_zero, k_ring, lens_host, scale, bits,
                                  group_size, k)


@_tail_recall_select_op.register_fake
def _(q, k_cache, k_scale, k_zero, k_ring, lens_host, scale, bits, group_size, k):
    return q.new_empty((q.shape[0], k_ring.shape[1], k), dtype=torch.int32)


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
    k_ring: torch.Tensor, v_ring: torch.Tensor, lens: torch.Tensor, lens_host: torch.Tensor,
    host_k: torch.Tensor, host_v: torch.Tensor, recall_k: torch.Tensor, recall_v: torch.Tensor,
    scale: float, bits: int = 2, group_size: int = 16,
) -> torch.Tensor:
    """:func:`.attention_tail.tail_attention` with recall: per slot ``b < B`` and KV head, the
    ``K`` quantized positions with the most attention mass from the T rows (the module's rule)
    are read from host memory into ``recall_k``/``recall_v`` and take those full-precision K/V
    in the attention. No host sync; the ranking's shapes follow ``lens_host``, so not for a
    captured graph.

    Args:
        q ... lens: as :func:`.attention_tail.tail_attention` (bits 1, 2 or 4: a 16-bit cache
            has nothing to recall).
        lens_host: ``(B', 2)`` int32 CPU, ``B' >= B``: ``lens[:B]`` as the host knows them
            (the ranking reads these, the attention ``lens``; not compared: that would sync).
        host_k, host_v: ``(B', H_kv, T_cap, D)`` in q's dtype, CPU, contiguous: the host rows
            of slots ``0 .. B - 1`` (row ``t`` = quantized position ``t``), e.g. views
            ``store.k[s:s + 1]`` of a :class:`.recall.HostStore` for slot ``s``; pinned when q
            is on CUDA (the gather reads them in place; not checked here, which a traced call
            cannot do: a pageable tensor fails in the gather's launch).
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
    check_tensor("lens_host", lens_host, shape=(None, 2), dtypes=(torch.int32,), device="cpu")
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
    for name, t in (("lens_host", lens_host), ("host_k", host_k)):
        if t.shape[0] < batch:
            raise ValueError(f"{name}: expected at least B={batch} slots (q.shape[0]), got shape "
                             f"{tuple(t.shape)}")
    idx = torch.ops.minikv.tail_recall_select(q, k_cache, k_scale, k_zero, k_ring, lens_host,
                                              float(scale), bits, group_size,
                                              recall_k.shape[2])          # (B, H_kv, K)
    torch.ops.minikv.recall_gather(host_k, host_v, idx, recall_k, recall_v)
    return torch.ops.minikv.tail_attention_recall(q, k_cache, k_scale, k_zero, v_cache, v_scale,
                                                  v_zero, k_ring, v_ring, lens, recall_k,
                                                  recall_v, idx, float(scale), bits, group_size)
