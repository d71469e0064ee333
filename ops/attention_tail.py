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
:func:`.attention_decode.decode_attention_recall`'s, for any ``T <= R``.
"""
from __future__ import annotations

import torch

from ._checks import FLOAT_DTYPES, check_choice, check_tensor
from .attention_decode import _HEAD_DIMS, _check_inputs, _region_ref
from .cache_layout import ring_length


# ----------------------------------------------------------------------------------------------
# Pure-PyTorch reference (same signature and output layout; runs on any device, syncs on lens)
# ----------------------------------------------------------------------------------------------


def tail_attention_ref(
    q, k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring, lens,
    scale: float, bits: int, group_size: int,
) -> torch.Tensor:
    """Reference for :func:`tail_attention`: per slot, the valid quantized region dequantized and
    the ring up to the last row's token in fp32, one fp32 softmax per (row, head) with the ring
    tokens after a row's own masked out; the output is cast to q's dtype."""
    batch, rows, h_q, d = q.shape
    h_kv = k_ring.shape[1]
    gqa = h_q // h_kv
    out = q.new_empty(q.shape)
    for b, (n_quant, n_ring) in enumerate(lens[:batch].tolist()):
        k, v = _region_ref(k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, b, n_quant, bits,
                           group_size)                                   # (H_kv, n_quant, D)
        seen = n_ring + rows - 1                                           # the last row's ring
        k = torch.cat([k, k_ring[b, :, :seen].float()], dim=1)             # (H_kv, T_b, D)
        v = torch.cat([v, v_ring[b, :, :seen].float()], dim=1)
        # (T, H_q, D) -> (H_kv, T * gqa, D): row r, head h * gqa + g at r * gqa + g
        qb = q[b].float().reshape(rows, h_kv, gqa, d).transpose(0, 1).reshape(h_kv, rows * gqa, d)
        scores = qb @ k.transpose(1, 2) * scale                            # (H_kv, T * gqa, T_b)
        # row r sees the first n_quant + n_ring + r tokens
        last = n_quant + n_ring + torch.arange(rows, device=q.device).repeat_interleave(gqa)
        hidden = torch.arange(k.shape[1], device=q.device)[None, :] >= last[:, None]
        probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
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
