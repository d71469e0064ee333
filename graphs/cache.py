"""The static compressed KV cache: every buffer allocated once, before any graph is captured.

Per layer (layout contract of ``minikv_compile.ops``; ``Bmax`` slots, ``T_cap`` quantized tokens,
ring of ``R`` tokens, ``b`` bits, group ``G``)::

    k_cache  (Bmax, H_kv, T_cap * b / 32, D) int32   keys, per-channel groups packed along tokens
    k_scale  (Bmax, H_kv, T_cap / G, D)      fp16
    k_zero   (Bmax, H_kv, T_cap / G, D)      fp16
    v_cache  (Bmax, H_kv, T_cap, D * b / 32) int32   values, per-token groups packed along channels
    v_scale  (Bmax, H_kv, T_cap, D / G)      fp16
    v_zero   (Bmax, H_kv, T_cap, D / G)      fp16
    k_ring   (Bmax, H_kv, R, D)              model dtype (recent tokens in full precision)
    v_ring   (Bmax, H_kv, R, D)              model dtype
    lens     (Bmax, 2)                       int32: [quantized tokens, ring tokens] per slot

With ``bits=16`` the quantized region is a plain ``(Bmax, H_kv, T_cap, D)`` buffer in the model
dtype and the scale/zero buffers are empty. ``table`` holds every layer's buffer addresses for
the decode step's all-layer launch (``ops.cache_begin_step``); it lives as long as the cache.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

import torch

from minikv_compile import ops


@dataclass
class LayerCache:
    k_cache: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    v_cache: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor
    k_ring: torch.Tensor
    v_ring: torch.Tensor
    lens: torch.Tensor

    def buffers(self) -> tuple:
        """The buffers in the argument order of the ``minikv`` cache ops."""
        return (self.k_cache, self.k_scale, self.k_zero, self.v_cache, self.v_scale, self.v_zero,
                self.k_ring, self.v_ring, self.lens)

    @property
    def capacity(self) -> int:
        """T_cap: quantized tokens a slot can hold."""
        return self.v_cache.shape[2]


class StaticKVCache:
    """All layers' buffers for ``max_batch_size`` slots; allocated once, never reallocated."""

    def __init__(self, *, capacities: List[int], max_batch_size: int, num_kv_heads: int,
                 head_dim: int, ring: int, bits: int, group_size: int, dtype: torch.dtype,
                 device: torch.device):
        self.bits, self.group_size, self.ring = bits, group_size, ring
        self.max_batch_size, self.num_kv_heads, self.head_dim = max_batch_size, num_kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.layers = [self._allocate(cap) for cap in capacities]
        # Addresses of every layer's buffers for the all-layer launches (ops.cache_begin_step).
        self.table = ops.cache_table([layer.buffers() for layer in self.layers])

    def _allocate(self, cap: int) -> LayerCache:
        B, H, D, G, R = self.max_batch_size, self.num_kv_heads, self.head_dim, self.group_size, self.ring
        dev = self.device
        if self.bits == 16:
            empty = lambda: torch.empty(0, dtype=torch.float16, device=dev)  # noqa: E731
            k_cache = torch.zeros(B, H, cap, D, dtype=self.dtype, device=dev)
            v_cache = torch.zeros(B, H, cap, D, dtype=self.dtype, device=dev)
            k_scale, k_zero, v_scale, v_zero = empty(), empty(), empty(), empty()
        else:
            per_word = 32 // self.bits
            k_cache = torch.zeros(B, H, cap // per_word, D, dtype=torch.int32, device=dev)
            k_scale = torch.zeros(B, H, cap // G, D, dtype=torch.float16, device=dev)
            k_zero = torch.zeros_like(k_scale)
            v_cache = torch.zeros(B, H, cap, D // per_word, dtype=torch.int32, device=dev)
            v_scale = torch.zeros(B, H, cap, D // G, dtype=torch.float16, device=dev)
            v_zero = torch.zeros_like(v_scale)
        k_ring = torch.zeros(B, H, R, D, dtype=self.dtype, device=dev)
        v_ring = torch.zeros_like(k_ring)
        lens = torch.zeros(B, 2, dtype=torch.int32, device=dev)
        return LayerCache(k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring, lens)

    def reset(self, num_slots: int | None = None) -> None:
        """Empty slots ``[0, num_slots)`` (all by default). Stale data past ``lens`` is never read."""
        for layer in self.layers:
            layer.lens[: num_slots or self.max_batch_size].zero_()


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
    """KV bytes actually allocated, against the uncompressed cache and DESIGN.md's formula.

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
    fp16 = 2 * len(cache.layers) * width * (prompt_len + new_tokens) * 2 * B
    if cache.bits == 16:
        formula = sum(2 * width * (k + new_tokens) * 2 for k in kept) * B
    else:
        # b-bit codes + fp16 scale + fp16 zero per G values, for K and V.
        per_value = cache.bits / 8 + 4 / cache.group_size
        formula = int(sum(2 * width * (k + new_tokens) * per_value for k in kept) * B)
    notes = [
        f"ring: {cache.ring} tokens per slot and layer in {cache.dtype} on top of the formula",
        "padding: capacity rounded up to a whole quantization group",
    ]
    return KVMemoryReport(layers=layers, fp16_bytes=fp16, formula_bytes=formula, batch=B,
                          prompt_len=prompt_len, new_tokens=new_tokens, bits=cache.bits, notes=notes)
