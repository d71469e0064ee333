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
        self.num_kv_heads, self.head_dim, self.dtype, self.device = num_kv_heads, head_dim, dtype, device
        self.empty_slots(0, self.max_batch_size)

    def empty_slots(self, start: int, stop: int) -> None:
        """Empty slots ``[start, stop)`` of every layer (eager; between replays)."""
        for layer in self.layers:
            layer.lens[start:stop, 0].fill_(0)
            layer.lens[start:stop, 1].fill_(1)


@dataclass(frozen=True)
class LayerBytes:
    codes: int        # packed 2/4-bit codes (or the plain 16-bit region)
    scale_zero: int   # fp16 scales and zeros
    ring: int         # the full-precision residual ring
    counters: int     # per-slot lens
    padding: int      # part of the quantized region no request of the configured size can fill

    @property
    def total(self) -> int:
        return self.codes + self.scale_zero + self.ring + self.counters


@dataclass(frozen=True)
class KVMemoryReport:
    """KV bytes actually allocated, against the uncompressed cache and the formula
    (``budget.formula_kv_bytes``).

    ``formula_bytes`` is the paper's Appendix-I count for this configuration (2-bit:
    ``H * d * (kept + L_gen)`` bytes per sequence; ``H`` layers, ``d`` KV width); the allocated
    quantized region (codes + scales/zeros) equals it up to ``padding``; ``ring`` is extra.
    """

    layers: List[LayerBytes]
    fp16_bytes: int          # 2 * H * d * (L + L_gen) * 2 * batch: the uncompressed cache
    formula_bytes: int
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
        """Allocated bytes over the fp16 cache's bytes (smaller is better)."""
        return self.total_bytes / self.fp16_bytes

    def __str__(self) -> str:
        mib = lambda n: f"{n / 2**20:10.2f} MiB"  # noqa: E731
        codes = sum(layer.codes for layer in self.layers)
        sz = sum(layer.scale_zero for layer in self.layers)
        lines = [
            f"KV cache for batch {self.batch} x (prompt {self.prompt_len} + {self.new_tokens} new), "
            f"{len(self.layers)} layers, {self.bits}-bit",
            f"  codes               {mib(codes)}",
            f"  scales + zeros      {mib(sz)}",
            f"  residual ring       {mib(self.ring_bytes)}",
            f"  counters            {mib(sum(layer.counters for layer in self.layers))}",
            f"  allocated total     {mib(self.total_bytes)}",
            f"    of which padding  {mib(self.padding_bytes)}",
            f"  formula (App. I)    {mib(self.formula_bytes)}   quantized region "
            f"{mib(self.quantized_region_bytes)}",
            f"  fp16 cache          {mib(self.fp16_bytes)}",
            f"  allocated / fp16    {self.ratio:10.4f}   ({100 * (1 - self.ratio):.1f}% smaller)",
        ]
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


def kv_memory_report(cache: StaticKVCache, *, kept: List[int], prompt_len: int, new_tokens: int
                     ) -> KVMemoryReport:
    """Bytes of ``cache``'s buffers, with ``kept[l]`` = prompt tokens layer ``l`` keeps at most."""
    B, H, D = cache.max_batch_size, cache.num_kv_heads, cache.head_dim
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    layers = []
    for layer, n_kept in zip(cache.layers, kept):
        region = nbytes(layer.k_cache) + nbytes(layer.v_cache)
        sz = sum(nbytes(t) for t in (layer.k_scale, layer.k_zero, layer.v_scale, layer.v_zero))
        unused_tokens = layer.capacity - (n_kept + new_tokens)
        per_token = (region + sz) // layer.capacity
        layers.append(LayerBytes(codes=region, scale_zero=sz,
                                 ring=nbytes(layer.k_ring) + nbytes(layer.v_ring),
                                 counters=nbytes(layer.lens),
                                 padding=max(0, unused_tokens) * per_token))
    width = H * D  # d: KV width of one layer
    fp16 = budget.full_kv_bytes(num_layers=len(cache.layers), kv_width=width,
                                tokens=prompt_len + new_tokens, batch=B, dtype_bytes=2)
    formula = budget.formula_kv_bytes(bits=cache.bits, group_size=cache.group_size,
                                      kv_width=width, kept=kept, new_tokens=new_tokens, batch=B)
    notes = [
        f"ring: {cache.ring} tokens per slot and layer in {cache.dtype} on top of the formula",
        "padding: capacity rounded up to a whole quantization group",
    ]
    return KVMemoryReport(layers=layers, fp16_bytes=fp16, formula_bytes=formula, batch=B,
                          prompt_len=prompt_len, new_tokens=new_tokens, bits=cache.bits, notes=notes)
