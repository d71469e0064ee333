"""The static compressed KV cache of ``max_batch_size`` slots: allocated once, before any graph is
captured, never reallocated (layout: ``minikv_compile.ops.cache_layout``), and its memory report.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

import torch

from minikv_compile.ops import CacheLayout

from . import budget


class StaticKVCache:
    """The cache's buffers (``layout``) and the per-slot resets the runtime needs.

    An empty slot holds one ring token and nothing else (``lens = (0, 1)``): the decode step
    runs the attention of every slot of its bucket, and one token (zeros, or a released
    request's stale row) keeps an idle slot's row finite at the cost of reading one token.
    """

    def __init__(self, config, *, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.layout = CacheLayout.allocate(
            capacities=budget.capacities(config, num_layers),
            max_batch_size=config.max_batch_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
            ring=config.residual_length, bits=config.bits, group_size=config.group_size,
            dtype=dtype, device=device)
        self.layers = self.layout.layers
        self.bits, self.group_size = config.bits, config.group_size
        self.max_batch_size, self.ring = config.max_batch_size, config.residual_length
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.empty_slots(0, self.max_batch_size)

    def empty_slots(self, start: int, stop: int) -> None:
        """Empty slots ``[start, stop)`` of every layer (eager; between replays)."""
        for layer in self.layers:
            layer.lens[start:stop, 0].fill_(0)
            layer.lens[start:stop, 1].fill_(1)


@dataclass(frozen=True)
class LayerBytes:
    codes: int        # packed 2/4-bit codes (or the plain 16-bit region) of the tokens held
    scale_zero: int   # fp16 scales and zeros
    ring: int         # the full-precision residual ring
    counters: int     # per-slot lens
    padding: int      # of codes + scale_zero: the held tokens rounded up to whole groups

    @property
    def total(self) -> int:
        return self.codes + self.scale_zero + self.ring + self.counters


@dataclass(frozen=True)
class KVMemoryReport:
    """KV bytes of ``batch`` sequences of ``prompt_len + new_tokens`` tokens, like with like.

    ``layers`` / ``total_bytes``: what those sequences occupy in the compressed cache (their
    slots' share of the allocation for the tokens they hold: codes, scales / zeros rounded up
    to whole groups, the ring, the counters). ``full_bytes``: an uncompressed cache of the same
    batch and lengths in the model's dtype (``full_dtype``); ``ratio`` compares the two.
    ``fp16_bytes``: the same uncompressed cache at 2 bytes a value, the figure the MiniKV
    paper compares with. ``formula_bytes``: the paper's count for this configuration
    (``budget.formula_kv_bytes``, 16-bit values at 2 bytes); the quantized region equals it up
    to ``padding`` (for a 16-bit cache, in a 2-byte dtype).
    ``allocated_bytes``: every buffer of the cache (all slots, at full capacity).
    """

    layers: List[LayerBytes]
    full_bytes: int
    full_dtype: torch.dtype
    fp16_bytes: int
    formula_bytes: int
    allocated_bytes: int
    batch: int
    prompt_len: int
    new_tokens: int
    bits: int
    notes: List[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(layer.total for layer in self.layers)

    @property
    def quantized_region_bytes(self) -> int:
        return sum(layer.codes + layer.scale_zero for layer in self.layers)

    @property
    def ring_bytes(self) -> int:
        return sum(layer.ring for layer in self.layers)

    @property
    def padding_bytes(self) -> int:
        return sum(layer.padding for layer in self.layers)

    @property
    def ratio(self) -> float:
        """The compressed bytes over the uncompressed cache's in the model's dtype."""
        return self.total_bytes / self.full_bytes

    def __str__(self) -> str:
        mib = lambda n: f"{n / 2**20:10.2f} MiB"  # noqa: E731
        codes = sum(layer.codes for layer in self.layers)
        sz = sum(layer.scale_zero for layer in self.layers)
        dtype = str(self.full_dtype).replace("torch.", "")
        lines = [
            f"KV cache for batch {self.batch} x (prompt {self.prompt_len} + {self.new_tokens} new), "
            f"{len(self.layers)} layers, {self.bits}-bit",
            f"  codes               {mib(codes)}",
            f"  scales + zeros      {mib(sz)}",
            f"  residual ring       {mib(self.ring_bytes)}",
            f"  counters            {mib(sum(layer.counters for layer in self.layers))}",
            f"  total               {mib(self.total_bytes)}",
            f"    of which padding  {mib(self.padding_bytes)}",
            f"  formula (paper)     {mib(self.formula_bytes)}   quantized region "
            f"{mib(self.quantized_region_bytes)}",
            f"  uncompressed {dtype:<7}{mib(self.full_bytes)}",
            f"  total / uncompressed {self.ratio:9.4f}   ({100 * (1 - self.ratio):.1f}% smaller)",
            f"  allocated (all slots, full capacity) {mib(self.allocated_bytes)}",
        ]
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


def kv_memory_report(cache: StaticKVCache, *, kept: List[int], prompt_len: int, new_tokens: int,
                     batch: int) -> KVMemoryReport:
    """Bytes ``batch`` sequences of ``prompt_len + new_tokens`` tokens occupy in ``cache``, with
    ``kept[l]`` = prompt tokens layer ``l`` keeps of such a prompt."""
    Bmax, H, D, G = cache.max_batch_size, cache.num_kv_heads, cache.head_dim, cache.group_size
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    layers, allocated = [], 0
    for layer, n_kept in zip(cache.layers, kept):
        allocated += sum(nbytes(t) for t in layer)
        cap = layer.capacity
        codes_tok = (nbytes(layer.k_cache) + nbytes(layer.v_cache)) // (Bmax * cap)
        sz_tok = sum(nbytes(t) for t in (layer.k_scale, layer.k_zero, layer.v_scale,
                                         layer.v_zero)) // (Bmax * cap)
        need = n_kept + new_tokens
        held = min(cap, -(-need // G) * G)
        layers.append(LayerBytes(codes=codes_tok * held * batch, scale_zero=sz_tok * held * batch,
                                 ring=(nbytes(layer.k_ring) + nbytes(layer.v_ring)) // Bmax * batch,
                                 counters=nbytes(layer.lens) // Bmax * batch,
                                 padding=(held - need) * (codes_tok + sz_tok) * batch))
    width = H * D  # d: KV width of one layer
    def full(dtype_bytes: int) -> int:
        return budget.full_kv_bytes(num_layers=len(cache.layers), kv_width=width,
                                    tokens=prompt_len + new_tokens, batch=batch,
                                    dtype_bytes=dtype_bytes)

    # the paper's count: 16-bit values at 2 bytes, as fp16_bytes
    formula = budget.formula_kv_bytes(bits=cache.bits, group_size=G, kv_width=width, kept=kept,
                                      new_tokens=new_tokens, batch=batch)
    notes = [
        f"ring: {cache.ring} tokens per slot and layer in {cache.dtype} on top of the formula",
        "padding: the held tokens rounded up to a whole quantization group",
    ]
    return KVMemoryReport(layers=layers, full_bytes=full(cache.dtype.itemsize),
                          full_dtype=cache.dtype, fp16_bytes=full(2), formula_bytes=formula,
                          allocated_bytes=allocated, batch=batch, prompt_len=prompt_len,
                          new_tokens=new_tokens, bits=cache.bits, notes=notes)
