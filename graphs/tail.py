"""Prefill of a prompt's tail into a slot that already holds its prefix (a restored
``SlotSnapshot``): the tail's tokens join the cache the way generated tokens do.

Chunks of T tokens, each one pass of the model's layers: ``minikv::cache_begin_step`` of the
slot alone (every layer: a full ring is flushed into the region, the counters take row 0's
token), then per layer the chunk's q/k/v at its logical positions, its K/V written into ring
rows ``lens[1] - 1 .. lens[1] - 2 + T`` (and the host copy with recall), ``minikv::tail_attention``
(each row over the compressed cache, the ring and the rows before it; with recall,
``ops.tail_attention_recall``: the K quantized positions the chunk attends to most, per KV head,
read from the host copy first), o_proj and MLP; after
the last layer every layer's ring counter takes the other T - 1 tokens. T is the room left in
the fullest ring (layers keep different counts under a pyramid budget), so a chunk never
crosses a flush: the ring is flushed between chunks, as a decode step flushes between tokens.
(So a chunk is never longer than the ring's room, and the last one never merges into the one
before: that would quantize a ring that is not full, which decode never does.)
Nothing is selected or evicted: the tail is kept whole, like generated tokens.

The layer (``TailPrefill.layer``) is one function for every layer, its weights and buffers
passed as arguments, compiled with ``torch.compile(fullgraph=True)`` where the engine compiles
(CUDA by default) with T dynamic, so one compiled graph serves every layer and every chunk
length T >= 2 (T = 1 is specialized by the compiler: a second graph). Eager, the layer cost
~1.25 ms of CPU a layer and chunk on the 8B shape (~120 kernel launches; the GPU idle, ~41 ms a
128-token chunk on an H200), ``perf/experiments/ttft_profile.py``.
"""
from __future__ import annotations

import contextlib
from typing import Generator, List, Optional, Tuple

import torch

from minikv_compile import ops
from minikv_compile.ops.cache_layout import LayerBuffers, ring_length

from .cache import StaticKVCache


class TailPrefill:
    """The tail prefill of one engine's slots (``__call__``), its layer compiled if ``compile``.

    compiles: graphs compiled for the layer so far (a test proves tails of new lengths add
    none). chunk_lengths: the chunk lengths T run so far; the Triton kernels of a chunk are
    compiled on the first launch of each of their variants (T's block of query rows, T == 1,
    T a multiple of 16), so the server's warm-up runs every length (``Scheduler.warm_up``)."""

    def __init__(self, adapter, cache: StaticKVCache, compile: bool):
        self.adapter, self.cache = adapter, cache
        # next_norm is never read here: without it the last layer is the same kind of call
        self.weights = [adapter.layer_weights(i)._replace(next_norm=None)
                        for i in range(adapter.num_layers)]
        self.compiles = 0
        self._compiled = compile
        self.chunk_lengths: set = set()
        self._kinds: set = set()  # chunk kinds run so far (T == 1 or not), see ``_limits``
        self._views: dict = {}  # per slot, see ``_slot_views``
        # with recall: the chunk's recalled rows (1, H_kv, K, D), one pair for every layer
        ring = cache.layers[0].k_ring
        self._recall_rows = None if cache.recall is None else tuple(
            torch.zeros(1, ring.shape[1], cache.recall.top_k, ring.shape[3], dtype=ring.dtype,
                        device=ring.device) for _ in range(2))
        self._layer = (torch.compile(self.layer, fullgraph=True, backend=self._backend)
                       if compile else self.layer)

    @property
    def longest_chunk(self) -> int:
        """R, a chunk's most tokens: the ring's length (a full ring is flushed between chunks)."""
        cache = self.cache
        return ring_length(cache.layers[0].k_ring.shape[2], cache.bits, cache.group_size)

    def _backend(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx  # (inductor: on first use)

        self.compiles += 1
        return compile_fx(gm, example_inputs)

    def __call__(self, slot: int, ids: torch.Tensor, start: int
                 ) -> Generator[None, None, torch.Tensor]:
        """Prefill ``ids (T,)`` int64 (on the device) at logical positions ``start ..`` into
        slot ``slot``, a generator that yields after every chunk but the last and returns the
        logits of the last token, ``(1, V)`` fp32. The slot must have room for the tokens (the
        runtime checks a snapshot's capacity before restoring it). One host sync per call (the
        counters, read at the start; each chunk's are then known on the host, so the CPU
        launches chunk ``j + 1`` while the GPU runs chunk ``j``) and one host-to-device copy
        per chunk (each layer's first ring row). With recall, each layer's chunk K/V go to its
        host rows by a kernel on the stream."""
        adapter, cache = self.adapter, self.cache
        n, dev = ids.shape[0], ids.device
        R = self.longest_chunk
        live, views, slot_lens, ring_counts, hosts = self._slot_views(slot)
        # per layer (quantized tokens, ring tokens) of the slot: read once, then kept here
        counts = torch.stack(slot_lens).tolist()
        done = 0
        while True:
            starts = self._starts(slot, R, counts)
            T = min(n - done, min(R - n_ring for _, n_ring in starts))
            self.chunk_lengths.add(T)
            ops.cache_begin_step(cache.layout, slot + 1, live)  # flushes, row 0 counted
            h = adapter.embed(ids[None, done: done + T])                        # (1, T, hidden)
            positions = torch.arange(start + done, start + done + T, device=dev)[None]
            cos, sin = adapter.rope(h, positions)                               # (1, T, D)
            firsts = torch.tensor([first for _, first in starts], dtype=torch.int64
                                  ).to(dev, non_blocking=True).unbind(0)
            if self._compiled and T > 1:  # one graph for every T >= 2
                for t in (h, cos, sin):
                    torch._dynamo.maybe_mark_dynamic(t, 1)
            with self._limits(T):
                for i, (weights, kv, first) in enumerate(zip(self.weights, views, firsts)):
                    h, k, v = self._layer(weights, kv, first, h, cos, sin, hosts[i])
                    if cache.recall is not None:  # host row = the token's quantized position
                        (host_k, host_v, *_), (n_quant, ring_row) = hosts[i], starts[i]
                        ops.recall_store_rows(host_k[0], host_v[0], k[0], v[0],
                                              n_quant + ring_row)
            torch._foreach_add_(ring_counts, T - 1)  # the chunk's other T - 1 tokens
            # the device's counters now: what cache_begin_step flushed to, plus the chunk
            counts = [(n_quant, n_ring + T) for n_quant, n_ring in starts]
            done += T
            if done == n:
                return adapter.logits(h[0, -1:])                                # (1, V)
            yield

    def _slot_views(self, slot: int) -> tuple:
        """Slot ``slot``'s live mask ``(slot + 1,)`` bool, its rows of every layer's buffers
        (``(1, ...)`` views, written in place), of every layer's ``lens`` (``(2,)``) and ring
        counter (``()``), and per layer the recall's arguments (its host rows ``(1, H_kv, T_cap,
        D)``, views of the pinned store, and the recall rows) or None without recall; made on
        the slot's first tail and kept (~300 views, ~1 ms of CPU a call; the buffers are
        allocated once, ``CacheLayout.table`` holds their pointers)."""
        if slot not in self._views:
            layers = self.cache.layers
            live = torch.zeros(slot + 1, dtype=torch.bool, device=layers[0].lens.device)
            live[slot] = True
            self._views[slot] = (
                live,
                [LayerBuffers(*(t[slot: slot + 1] if t.numel() else t for t in layer))
                 for layer in layers],
                [layer.lens[slot] for layer in layers],
                [layer.lens[slot, 1] for layer in layers],
                [None] * len(layers) if self.cache.recall is None else
                [(store.k[slot: slot + 1], store.v[slot: slot + 1], *self._recall_rows)
                 for store in self.cache.recall.stores])
        return self._views[slot]

    def _limits(self, T: int):
        """Dynamo's recompile limits raised for the first chunk of each kind (T = 1 or not) this
        engine runs, which may compile: the compiled layer's variants are kept per function,
        shared by every engine of the process (a few per engine, as ``CompiledPart``'s limits).
        Not on every chunk: a config patch costs milliseconds (3.7 ms here)."""
        if not self._compiled or (T == 1) in self._kinds:
            return contextlib.nullcontext()
        self._kinds.add(T == 1)
        return torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=256)

    def _starts(self, slot: int, R: int, counts: List[List[int]]) -> List[Tuple[int, int]]:
        """Per layer, ``(quantized tokens, ring tokens)`` of the slot after the flush that
        ``cache_begin_step`` is about to do (a full ring moves into the region), from the
        slot's ``counts`` before it."""
        starts = []
        for layer, (n_quant, n_ring) in zip(self.cache.layers, counts):
            if n_ring == R:
                if n_quant + R > layer.capacity:
                    raise RuntimeError(f"slot {slot}: its ring is full and its region has no "
                                       f"room ({n_quant} + {R} > {layer.capacity})")
                n_quant, n_ring = n_quant + R, 0
            starts.append((n_quant, n_ring))
        return starts

    def layer(self, weights, kv: LayerBuffers, first: torch.Tensor, h: torch.Tensor,
              cos: torch.Tensor, sin: torch.Tensor, recall: Optional[tuple]) -> tuple:
        """One layer of a chunk, the same code for every layer (no layer index in it).

        weights: the layer's ``adapter.layer_weights``; kv: the slot's rows of its buffers
        (``(1, ...)`` views; the ring written); first: ``()`` int64 on the device, the ring row
        of the chunk's first token; h ``(1, T, hidden)``; cos, sin ``(1, T, D)``; recall: None,
        or ``(host_k, host_v, recall_k, recall_v)`` of ``ops.tail_attention_recall``. Returns the
        layer's ``h`` and the chunk's ``k, v (1, H_kv, T, D)`` (for the host copy with recall).
        """
        a, T = self.adapter, h.shape[1]
        q, k, v = a.qkv(weights, h, cos, sin)  # q (1, H_q, T, D), k/v (1, H_kv, T, D)
        # rows at a device-side offset: a Python int would be a constant of the compiled graph
        rows = first + torch.arange(T, device=h.device)                         # (T,)
        kv.k_ring.index_copy_(2, rows, k)
        kv.v_ring.index_copy_(2, rows, v)
        bits, group = self.cache.bits, self.cache.group_size
        if recall is None:
            o = ops.tail_attention(q.transpose(1, 2), *kv, a.scale, bits, group)  # (1, T, H_q, D)
        else:
            o = ops.tail_attention_recall(q.transpose(1, 2), *kv, *recall, a.scale, bits, group)
        return a.finish_layer(weights, h, o.reshape(1, T, -1)), k, v
