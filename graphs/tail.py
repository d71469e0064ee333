"""Eager prefill of a prompt's tail into a slot that already holds its prefix (a restored
``SlotSnapshot``): the tail's tokens join the cache the way generated tokens do.

Chunks of T tokens, each one pass of the model's layers: ``minikv::cache_begin_step`` of the
slot alone (every layer: a full ring is flushed into the region, the counters take row 0's
token), then per layer the chunk's q/k/v at its logical positions, its K/V written into ring
rows ``lens[1] - 1 .. lens[1] - 2 + T`` (and the host copy with recall), ``minikv::tail_attention``
(each row over the compressed cache, the ring and the rows before it), o_proj and MLP; after
the last layer every layer's ring counter takes the other T - 1 tokens. T is the room left in
the fullest ring (layers keep different counts under a pyramid budget), so a chunk never
crosses a flush: the ring is flushed between chunks, as a decode step flushes between tokens.
Nothing is selected or evicted: the tail is kept whole, like generated tokens.
"""
from __future__ import annotations

from typing import Generator

import torch

from minikv_compile import ops
from minikv_compile.ops.cache_layout import ring_length

from .cache import StaticKVCache


def prefill_tail(adapter, cache: StaticKVCache, slot: int, ids: torch.Tensor, start: int
                 ) -> Generator[None, None, torch.Tensor]:
    """Prefill ``ids (T,)`` int64 (on the device) at logical positions ``start ..`` into slot
    ``slot``, a generator that yields after every chunk but the last and returns the logits of
    the last token, ``(1, V)`` fp32. The slot must have room for the tokens (the runtime checks
    a snapshot's capacity before restoring it). One host sync per chunk (the counters)."""
    n, dev = ids.shape[0], ids.device
    R = ring_length(cache.layers[0].k_ring.shape[2], cache.bits, cache.group_size)
    live = torch.zeros(slot + 1, dtype=torch.bool, device=dev)
    live[slot] = True
    done = 0
    while True:
        # where each layer's chunk starts after the flush cache_begin_step is about to do
        counts = torch.stack([layer.lens[slot] for layer in cache.layers]).tolist()
        starts = []
        for layer, (n_quant, n_ring) in zip(cache.layers, counts):
            if n_ring == R:
                if n_quant + R > layer.capacity:
                    raise RuntimeError(f"slot {slot}: its ring is full and its region has no "
                                       f"room ({n_quant} + {R} > {layer.capacity})")
                n_quant, n_ring = n_quant + R, 0
            starts.append((n_quant, n_ring))
        T = min(n - done, min(R - n_ring for _, n_ring in starts))
        ops.cache_begin_step(cache.layout, slot + 1, live)  # flushes, row 0 counted
        chunk = ids[None, done: done + T]                                   # (1, T)
        h = adapter.embed(chunk)                                            # (1, T, hidden)
        positions = torch.arange(start + done, start + done + T, device=dev)[None]
        cos, sin = adapter.rope(h, positions)                               # (1, T, D)
        for i, (layer, (n_quant, first)) in enumerate(zip(cache.layers, starts)):
            q, k, v = adapter.qkv(i, h, cos, sin)  # q (1, H_q, T, D), k/v (1, H_kv, T, D)
            layer.k_ring[slot, :, first: first + T].copy_(k[0])
            layer.v_ring[slot, :, first: first + T].copy_(v[0])
            if cache.recall is not None:  # host row = the token's quantized position
                store = cache.recall.stores[i]
                rows = slice(n_quant + first, n_quant + first + T)
                store.k[slot, :, rows].copy_(k[0], non_blocking=True)
                store.v[slot, :, rows].copy_(v[0], non_blocking=True)
            # the slot's own rows of the layer's buffers (views: the op only reads them)
            bufs = [t[slot: slot + 1] if t.numel() else t for t in layer]
            o = ops.tail_attention(q.transpose(1, 2), *bufs, adapter.scale, cache.bits,
                                   cache.group_size)                        # (1, T, H_q, D)
            h = adapter.finish_layer(i, h, o.reshape(1, T, -1))
        for layer in cache.layers:
            layer.lens[slot, 1].add_(T - 1)
        done += T
        if done == n:
            return adapter.logits(h[0, -1:])                                # (1, V)
        yield
