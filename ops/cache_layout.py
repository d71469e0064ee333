"""The compressed cache's layout: one contract for every op that reads or writes the cache.

Per layer (``Bmax`` slots, ``T_cap`` quantized tokens per slot, ring of ``R`` tokens, ``P = 32 /
bits`` codes per int32, key groups of ``G`` tokens and value groups of ``GV = min(G, D)``
channels (:func:`value_group`); the code layout of :mod:`.quant`)::

    k_cache  (Bmax, H, T_cap / P, D) int32        keys, per-channel groups packed along tokens
    k_scale, k_zero (Bmax, H, T_cap / G, D) fp16
    v_cache  (Bmax, H, T_cap, D / P) int32        values, per-token groups packed along channels
    v_scale, v_zero (Bmax, H, T_cap, D / GV) fp16
    k_ring, v_ring  (Bmax, H, R, D) model dtype   the most recent tokens in full precision
                    (or R + 1 rows: a spare row)
    lens     (Bmax, 2) int32                      [quantized tokens, ring tokens] per slot

With ``bits == 16`` k_cache / v_cache are ``(Bmax, H, T_cap, D)`` in the model dtype and the four
scale / zero tensors are empty. Slot ``b`` holds, in order, region tokens ``[0, lens[b, 0])`` then
ring tokens ``[0, lens[b, 1])``; nothing past them is ever read. Layers may differ in ``T_cap``
only (the pyramid budget), so an all-layer launch reaches them through an address table.

A ring of ``R + 1`` rows (``bits < 16``, ``R`` a multiple of G) has a spare row: it still flushes
``R`` tokens at a time (:func:`ring_length`), so a token written one row past the last counted
one, attended by a step and never counted in ``lens`` (SpeCache's speculative token), always
has a row, also when the ring's ``R`` rows are full.
"""
from __future__ import annotations

from typing import List, NamedTuple, Sequence

import torch

from ._checks import (FLOAT_DTYPES, GROUP_SIZES, QUANT_BITS, check_choice, check_quant_params,
                      check_tensor, codes_per_word)
TABLE_COLS = 10  # the nine buffers' addresses, then T_cap


class LayerBuffers(NamedTuple):
    """One layer's buffers, in the argument order of the ``minikv`` cache ops."""

    k_cache: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    v_cache: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor
    k_ring: torch.Tensor
    v_ring: torch.Tensor
    lens: torch.Tensor

    @property
    def capacity(self) -> int:
        """T_cap: quantized tokens one slot can hold."""
        return self.v_cache.shape[2]


BUFFER_NAMES = LayerBuffers._fields


class CacheLayout:
    """Every layer's buffers, validated once, and the address table of the all-layer launches.

    ``table (L, 10)`` int64 on the device: row ``l`` holds the data pointers of layer ``l``'s nine
    buffers, then its ``T_cap``. Captured launches read it at every replay, so it lives as long
    as the buffers. ``table_host`` is the same rows on the CPU: a launch compares them with the
    buffers it was handed (a host-side check, no device read) and, for any others (the copies
    functionalization makes when a compiler cannot write in place), writes a table of those on
    the device instead of copying one from the host.
    """

    def __init__(self, layers: Sequence[Sequence[torch.Tensor]], bits: int, group_size: int):
        if not layers:
            raise ValueError("layers: expected at least one layer's buffers, got none")
        self.layers: List[LayerBuffers] = []
        shapes = set()
        for i, bufs in enumerate(layers):
            if len(bufs) != len(BUFFER_NAMES):
                raise ValueError(f"layers[{i}]: expected the {len(BUFFER_NAMES)} buffers "
                                 f"{BUFFER_NAMES}, got {len(bufs)}")
            bufs = LayerBuffers(*bufs)
            Bmax, H, _, R, D = check_layer(bufs, bits, group_size)
            shapes.add((Bmax, H, R, D, bufs.k_ring.dtype, bufs.k_ring.device))
            self.layers.append(bufs)
        if len(shapes) > 1:
            raise ValueError(f"layers: expected one (Bmax, H, R, D, ring dtype, device) for every "
                             f"layer, got {sorted(shapes, key=str)}")
        (self.max_batch_size, self.num_kv_heads, self.ring, self.head_dim, self.dtype,
         self.device) = shapes.pop()
        self.bits, self.group_size = bits, group_size
        self.table_host = torch.tensor(table_rows(self.layers), dtype=torch.int64)
        self.table = self.table_host.to(self.device)  # the one host-to-device copy, here

    @classmethod
    def allocate(cls, *, capacities: Sequence[int], max_batch_size: int, num_kv_heads: int,
                 head_dim: int, ring: int, bits: int, group_size: int, dtype: torch.dtype,
                 device: torch.device, spare_ring_row: bool = False) -> "CacheLayout":
        """Zeroed buffers for ``capacities[l]`` quantized tokens per slot in layer ``l``; rings of
        ``ring`` rows, ``ring + 1`` with ``spare_ring_row`` (bits < 16)."""
        B, H, D, G, R = max_batch_size, num_kv_heads, head_dim, group_size, ring
        layers = []
        for cap in capacities:
            if bits == 16:
                empty = lambda: torch.empty(0, dtype=torch.float16, device=device)  # noqa: E731
                k_cache = torch.zeros(B, H, cap, D, dtype=dtype, device=device)
                v_cache = torch.zeros(B, H, cap, D, dtype=dtype, device=device)
                k_scale, k_zero, v_scale, v_zero = empty(), empty(), empty(), empty()
            else:
                P = codes_per_word(bits)
                k_cache = torch.zeros(B, H, cap // P, D, dtype=torch.int32, device=device)
                k_scale = torch.zeros(B, H, cap // G, D, dtype=torch.float16, device=device)
                k_zero = torch.zeros_like(k_scale)
                v_cache = torch.zeros(B, H, cap, D // P, dtype=torch.int32, device=device)
                v_scale = torch.zeros(B, H, cap, D // value_group(G, D), dtype=torch.float16,
                                      device=device)
                v_zero = torch.zeros_like(v_scale)
            k_ring = torch.zeros(B, H, R + int(spare_ring_row), D, dtype=dtype, device=device)
            lens = torch.zeros(B, 2, dtype=torch.int32, device=device)
            layers.append(LayerBuffers(k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring,
                                       torch.zeros_like(k_ring), lens))
        return cls(layers, bits, group_size)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def columns(self) -> List[List[torch.Tensor]]:
        """The nine buffers as nine per-layer lists (the list arguments of the all-layer ops)."""
        return [list(c) for c in zip(*self.layers)]


def table_rows(layers: Sequence[Sequence[torch.Tensor]]) -> tuple:
    """Per layer: its nine buffers' data pointers, then ``T_cap`` (``v_cache`` dim 2)."""
    return tuple(tuple(t.data_ptr() for t in bufs) + (bufs[3].shape[2],) for bufs in layers)


def value_group(group_size: int, head_dim: int) -> int:
    """GV, the channels of a value group: ``group_size`` capped at the head dim, so that a head of
    64 channels can take key groups of 128 tokens (the keys' scales and zeros halve: 15.6% ->
    14.8% of fp16's bytes at 2 bits) while its values keep one group per token."""
    return min(group_size, head_dim)


def ring_length(rows: int, bits: int, group_size: int) -> int:
    """R, the tokens a ring of ``rows`` rows holds and flushes: ``rows`` less a spare row."""
    return rows if bits == 16 else rows - rows % group_size


def check_layer(bufs: Sequence[torch.Tensor], bits: int, group_size: int, whole: bool = True):
    """Validate one layer's buffers against the layout; return ``(Bmax, H, T_cap, R, D)``,
    ``R`` the ring's length (:func:`ring_length`: its rows less a spare row).

    ``whole``: each buffer must be a whole allocation, not a view (ops that write it)."""
    check_choice("bits", bits, QUANT_BITS + (16,))
    check_choice("group_size", group_size, GROUP_SIZES)
    if bits != 16:
        check_quant_params(bits, group_size)
    k_cache, k_scale, k_zero, v_cache, v_scale, v_zero, k_ring, v_ring, lens = bufs
    G = group_size
    check_tensor("k_ring", k_ring, ndim=4, dtypes=FLOAT_DTYPES, contiguous=True)
    Bmax, H, R, D = k_ring.shape
    dev, dtype = k_ring.device, k_ring.dtype
    check_tensor("v_ring", v_ring, shape=(Bmax, H, R, D), dtypes=(dtype,), device=dev,
                 contiguous=True)
    check_tensor("lens", lens, shape=(Bmax, 2), dtypes=(torch.int32,), device=dev,
                 contiguous=True)
    if bits == 16:
        check_tensor("v_cache", v_cache, shape=(Bmax, H, None, D), dtypes=(dtype,), device=dev,
                     contiguous=True)
        T_cap = v_cache.shape[2]
        check_tensor("k_cache", k_cache, shape=(Bmax, H, T_cap, D), dtypes=(dtype,), device=dev,
                     contiguous=True)
        for name, t in (("k_scale", k_scale), ("k_zero", k_zero), ("v_scale", v_scale),
                        ("v_zero", v_zero)):
            check_tensor(name, t)  # unused with bits == 16
    else:
        P = codes_per_word(bits)
        GV = value_group(G, D)
        if R % G > 1 or R < G or D % GV or GV % P:
            raise ValueError(f"k_ring: expected ring rows (dim 2) R or R + 1 (a spare row) with "
                             f"R divisible by group_size={G} and head dim D (dim 3) by "
                             f"min(group_size, D), itself a multiple of {P}, got shape "
                             f"{tuple(k_ring.shape)}")
        check_tensor("v_cache", v_cache, shape=(Bmax, H, None, D // P), dtypes=(torch.int32,),
                     device=dev, contiguous=True)
        T_cap = v_cache.shape[2]
        if T_cap % G:
            raise ValueError(f"v_cache: expected capacity T_cap (dim 2) divisible by "
                             f"group_size={G}, got shape {tuple(v_cache.shape)}")
        check_tensor("k_cache", k_cache, shape=(Bmax, H, T_cap // P, D), dtypes=(torch.int32,),
                     device=dev, contiguous=True)
        for name, t in (("k_scale", k_scale), ("k_zero", k_zero)):
            check_tensor(name, t, shape=(Bmax, H, T_cap // G, D), dtypes=(torch.float16,),
                         device=dev, contiguous=True)
        for name, t in (("v_scale", v_scale), ("v_zero", v_zero)):
            check_tensor(name, t, shape=(Bmax, H, T_cap, D // GV), dtypes=(torch.float16,),
                         device=dev, contiguous=True)
    if whole:
        for name, t in zip(BUFFER_NAMES, bufs):
            check_base(name, t)
    return Bmax, H, T_cap, ring_length(R, bits, G), D


def check_base(name: str, t: torch.Tensor) -> None:
    """A mutating op must see the whole allocation, not a view: kernels index the base layout."""
    if t._base is not None:
        raise ValueError(f"{name}: expected a whole cache buffer, got a view of shape "
                         f"{tuple(t.shape)} into a {tuple(t._base.shape)} tensor")
