"""The static compressed KV cache of ``max_batch_size`` slots: allocated once, before any graph is
captured, never reallocated (layout: ``minikv_compile.ops.cache_layout``), and its memory report.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from minikv_compile.ops import CacheLayout, HostStore
from minikv_compile.ops.cache_layout import BUFFER_NAMES, codes_per_word

from . import budget


class RecallLayer(NamedTuple):
    """One layer's device buffers of SpeCache's recall (``K`` = ``recall_top_k``)::

        k, v      (Bmax, H_kv, K, D) model dtype  the recalled full-precision rows
        idx       (Bmax, H_kv, K) int32           their quantized positions; -1 = unused (a
                                                  plane of ``RecallBuffers.idx``)
        lse_ref   (Bmax, H_q) fp32                the speculative row's log-sum-exp of the
                                                  step before (the scale of its mass)
        layer     (1,) int32                      the layer's index: its plane of ``mass``
    """

    k: torch.Tensor
    v: torch.Tensor
    idx: torch.Tensor
    lse_ref: torch.Tensor
    layer: torch.Tensor


class RecallBuffers:
    """SpeCache's buffers: per layer the full-precision K/V of every token the quantized cache
    holds, in host memory (``stores``, a :class:`HostStore` of ``(Bmax, H_kv, T_cap, D)``,
    pinned on CUDA), the device buffers of ``RecallLayer``, and the two that one ranking of
    every layer at the step's end needs: ``mass (Bmax, L, H_kv, max T_cap + ring rows)`` uint8,
    which each layer's attention writes (its plane; a code of the mass's logarithm, 0 = not
    held), and ``idx (L, Bmax, H_kv, K)`` int32, which the ranking writes and each layer's gather
    and attention read (its plane). The mass is 1 byte per token, layer and KV head (1/256 of a
    bf16 cache's bytes at D 64), the price of ranking every layer in one ``torch.topk`` instead
    of one a layer (1.5 ms a step at 1 x 32k on the 8B shape).

    The pinned bytes are checked against the host's available memory before anything is
    allocated: pinned memory cannot be swapped, and an allocation that takes the last of it
    fails (or stalls the host) mid-request instead of here.
    """

    def __init__(self, *, top_k: int, block: int, capacities: List[int], max_batch_size: int,
                 num_kv_heads: int, num_q_heads: int, head_dim: int, ring_rows: int,
                 dtype: torch.dtype, device: torch.device, resync: str = "off"):
        B, H, D, K = max_batch_size, num_kv_heads, head_dim, top_k
        self.top_k, self.block, self.resync = top_k, block, resync
        self.host_bytes = 2 * B * H * D * dtype.itemsize * sum(capacities)
        check_host_memory(self.host_bytes)
        self.stores = [HostStore.allocate(max_batch_size=B, num_kv_heads=H, capacity=cap,
                                          head_dim=D, dtype=dtype, device=device)
                       for cap in capacities]
        L = len(capacities)
        self.idx = torch.full((L, B, H, K), -1, dtype=torch.int32, device=device)
        self.mass = torch.zeros((B, L, H, max(capacities) + ring_rows), dtype=torch.uint8,
                                device=device)
        self.layer_ids = torch.arange(L, dtype=torch.int32, device=device)
        self.layers = [RecallLayer(torch.zeros(B, H, K, D, dtype=dtype, device=device),
                                   torch.zeros(B, H, K, D, dtype=dtype, device=device),
                                   self.idx[i],
                                   torch.zeros(B, num_q_heads, dtype=torch.float32, device=device),
                                   self.layer_ids[i:i + 1])
                       for i in range(L)]

    @property
    def device_bytes(self) -> int:
        """Bytes of the device buffers (every slot)."""
        return (self.mass.nbytes + self.idx.nbytes + self.layer_ids.nbytes
                + sum(t.nbytes for layer in self.layers for t in (layer.k, layer.v, layer.lse_ref)))

    def empty_slots(self, start: int, stop: int) -> None:
        """Slots ``[start, stop)``: nothing recalled, nothing ranked (eager; between replays)."""
        self.idx[:, start:stop].fill_(-1)
        self.mass[start:stop].fill_(0)
        for layer in self.layers:
            layer.lse_ref[start:stop].fill_(0.0)


def host_available_bytes() -> Optional[int]:
    """The host memory the kernel says is available now (``MemAvailable``), None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def check_host_memory(nbytes: int, share: float = 0.8) -> None:
    """``MemoryError`` unless ``nbytes`` fit in ``share`` of the host's available memory (the
    rest stays for the process, the model's loading and the system)."""
    available = host_available_bytes()
    if available is not None and nbytes > share * available:
        raise MemoryError(
            f"recall_top_k: the host copy of the KV cache needs {nbytes / 2**30:.2f} GiB of "
            f"host memory (2 x max_batch_size x KV heads x head_dim x dtype bytes x the layers' "
            f"capacities), expected at most {share:.0%} of the {available / 2**30:.2f} GiB "
            f"available; lower max_batch_size, max_prompt_len or max_new_tokens")


class StaticKVCache:
    """The cache's buffers (``layout``) and the per-slot resets the runtime needs.

    An empty slot holds one ring token and nothing else (``lens = (0, 1)``): the decode step
    runs the attention of every slot of its bucket, and one token (zeros, or a released
    request's stale row) keeps an idle slot's row finite at the cost of reading one token.
    """

    def __init__(self, config, *, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, num_q_heads: Optional[int] = None):
        caps = budget.capacities(config, num_layers)
        recall = config.recall_top_k > 0
        # SpeCache: the host copy first (its check comes before any allocation), and rings with
        # a spare row for the speculative token
        self.recall = RecallBuffers(
            top_k=config.recall_top_k, block=config.recall_block, capacities=caps,
            max_batch_size=config.max_batch_size, num_kv_heads=num_kv_heads,
            num_q_heads=num_q_heads or num_kv_heads, head_dim=head_dim,
            ring_rows=config.residual_length + 1, dtype=dtype, device=device,
            resync=config.recall_resync) if recall else None
        self.layout = CacheLayout.allocate(
            capacities=caps,
            max_batch_size=config.max_batch_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
            ring=config.residual_length, bits=config.bits, group_size=config.group_size,
            dtype=dtype, device=device, spare_ring_row=recall)
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
        if self.recall is not None:
            self.recall.empty_slots(start, stop)

    def snapshot(self, slot: int, tokens: Sequence[int], logits: Optional[torch.Tensor]
                 ) -> "SlotSnapshot":
        """A copy of what slot ``slot`` holds (every layer's valid rows: the codes, scales and
        zeros of its quantized tokens, its ring tokens, the host copy with recall), holding the
        K/V of ``tokens``; ``logits (V,)`` fp32 of the last of them, or None. One host sync
        (the counters; it also orders the host copy's reads after the stream's pending stores,
        a tail prefill's chunk rows among them); the slot is not changed."""
        counts = torch.stack([layer.lens[slot] for layer in self.layers]).tolist()
        layers, host = [], [] if self.recall is not None else None
        for i, (layer, (n_quant, n_ring)) in enumerate(zip(self.layers, counts)):
            rows = self._rows(n_quant, n_ring)
            layers.append({name: getattr(layer, name)[slot, :, :n].clone()
                           for name, n in rows.items()})
            if host is not None:
                store, n = self.recall.stores[i], n_quant + n_ring
                host.append(tuple(t[slot, :, :n].clone() for t in (store.k, store.v)))
        return SlotSnapshot(tokens=tuple(tokens), lens=tuple(map(tuple, counts)), layers=layers,
                            host=host, logits=None if logits is None else logits.clone())

    def _rows(self, n_quant: int, n_ring: int) -> Dict[str, int]:
        """Each buffer's rows (its dim 2) that hold ``n_quant`` quantized and ``n_ring`` ring
        tokens."""
        P = 1 if self.bits == 16 else codes_per_word(self.bits)
        rows = {"k_cache": n_quant // P, "v_cache": n_quant, "k_ring": n_ring, "v_ring": n_ring}
        if self.bits != 16:
            rows.update(k_scale=n_quant // self.group_size, k_zero=n_quant // self.group_size,
                        v_scale=n_quant, v_zero=n_quant)
        return rows

    def check_snapshot(self, snap: "SlotSnapshot", extra_tokens: int, name: str) -> None:
        """``ValueError`` unless ``snap`` has this cache's layout and, with ``extra_tokens``
        more (a tail and the tokens to generate), fits a slot's capacity in every layer."""
        if not isinstance(snap, SlotSnapshot):
            raise ValueError(f"{name}: expected a SlotSnapshot, got {type(snap).__name__}")
        if len(snap.layers) != len(self.layers):
            raise ValueError(f"{name}: expected {len(self.layers)} layers, got "
                             f"{len(snap.layers)}")
        if (snap.host is not None) != (self.recall is not None):
            raise ValueError(f"{name}: expected {'a' if self.recall else 'no'} host copy "
                             f"(recall_top_k), got {'one' if snap.host else 'none'}")
        k_ring = snap.layers[0]["k_ring"]
        if (k_ring.dtype, k_ring.device.type, tuple(k_ring.shape[::2])) != (
                self.dtype, self.device.type, (self.num_kv_heads, self.head_dim)):
            raise ValueError(f"{name}: expected K/V of {self.num_kv_heads} heads x "
                             f"{self.head_dim} in {self.dtype} on {self.device.type}, got "
                             f"{k_ring.shape[0]} x {k_ring.shape[2]} in {k_ring.dtype} on "
                             f"{k_ring.device.type}")
        for i, (layer, (n_quant, n_ring)) in enumerate(zip(self.layers, snap.lens)):
            need = n_quant + n_ring + extra_tokens
            if need > layer.capacity:
                raise ValueError(
                    f"{name}: layer {i} holds {n_quant + n_ring} tokens of the cached prefix; "
                    f"with {extra_tokens} more (the tail and max_new_tokens) that is {need}, "
                    f"expected at most the slot's capacity of {layer.capacity} (the engine's "
                    f"max_prompt_len and max_new_tokens size it)")
            if n_ring > self.ring:
                raise ValueError(f"{name}: layer {i} holds {n_ring} ring tokens, expected at "
                                 f"most residual_length={self.ring}")
            # every tensor as this cache's buffer holds it (restore's copy_ would convert a
            # dtype or broadcast a shape without a word)
            want = {key: (self.num_kv_heads, n, *getattr(layer, key).shape[3:])
                    for key, n in self._rows(n_quant, n_ring).items()}
            pairs = [(key, t, getattr(layer, key).dtype) for key, t in snap.layers[i].items()]
            if snap.host is not None:
                store = self.recall.stores[i]
                want.update(host_k=(self.num_kv_heads, n_quant + n_ring, self.head_dim),
                            host_v=(self.num_kv_heads, n_quant + n_ring, self.head_dim))
                pairs += [("host_k", snap.host[i][0], store.k.dtype),
                          ("host_v", snap.host[i][1], store.v.dtype)]
            got = sorted(k for k, _, _ in pairs)
            if got != sorted(want):
                raise ValueError(f"{name}: layer {i}: expected the tensors {sorted(want)}, got "
                                 f"{got}")
            for key, t, dtype in pairs:
                if (tuple(t.shape), t.dtype) != (want[key], dtype):
                    raise ValueError(f"{name}: layer {i}'s {key}: expected {want[key]} in "
                                     f"{dtype}, got {tuple(t.shape)} in {t.dtype}")

    def restore(self, slot: int, snap: "SlotSnapshot") -> None:
        """Slot ``slot`` takes ``snap``'s state (checked by ``check_snapshot``), everything else
        of the slot emptied (recall's state: nothing recalled); other slots are untouched.
        Queued behind the device's work (the counters are filled with Python ints), except the
        host copy with recall: the CPU writes it at once, so first the device's work ends (a
        tail prefill cut short may still be storing its chunk's rows into this slot's host
        rows; the tail that follows a restore syncs at its start anyway)."""
        if snap.host is not None and self.layers[0].lens.is_cuda:
            torch.cuda.synchronize(self.layers[0].lens.device)
        self.empty_slots(slot, slot + 1)
        for i, (layer, tensors, (n_quant, n_ring)) in enumerate(
                zip(self.layers, snap.layers, snap.lens)):
            for name, t in tensors.items():
                getattr(layer, name)[slot, :, : t.shape[1]].copy_(t, non_blocking=True)
            layer.lens[slot, 0].fill_(n_quant)
            layer.lens[slot, 1].fill_(n_ring)
            if snap.host is not None:
                store = self.recall.stores[i]
                for dst, src in zip((store.k, store.v), snap.host[i]):
                    dst[slot, :, : src.shape[1]].copy_(src, non_blocking=True)


@dataclass(frozen=True)
class SlotSnapshot:
    """One slot's compressed state, not tied to a slot: what ``StaticKVCache.snapshot`` copies
    and ``restore`` writes back.

    tokens: the ids whose K/V it holds, in order (logical positions ``0 .. len - 1``).
    lens: per layer ``(n_quant, n_ring)``, the quantized and ring tokens held.
    layers: per layer the buffers' valid rows without the slot dim (``ops.cache_layout``),
        on the cache's device: ``k_cache (H, n_quant / P, D)``, ``k_scale, k_zero (H, n_quant
        / G, D)``, ``v_cache (H, n_quant, D / P)``, ``v_scale, v_zero (H, n_quant, D / GV)``,
        ``k_ring, v_ring (H, n_ring, D)``; with bits 16 ``k_cache, v_cache (H, n_quant, D)`` and
        no scales or zeros.
    host: recall's host copy per layer, ``(k, v)`` each ``(H, n_quant + n_ring, D)`` in host
        memory (not pinned: a restore copies it host to host), or None without recall.
    logits: ``(V,)`` fp32 of the last token (what the first new token is chosen from when
        nothing follows it), or None when the state was taken after decoding.
    """

    tokens: Tuple[int, ...]
    lens: Tuple[Tuple[int, int], ...]
    layers: List[Dict[str, torch.Tensor]]
    host: Optional[List[Tuple[torch.Tensor, torch.Tensor]]]
    logits: Optional[torch.Tensor]

    def tensors(self) -> Dict[str, torch.Tensor]:
        """Every tensor by a flat name (``layer{l}.{buffer}``, ``layer{l}.host_k`` / ``host_v``,
        ``logits``)."""
        out = {f"layer{i}.{name}": t for i, layer in enumerate(self.layers)
               for name, t in layer.items()}
        for i, pair in enumerate(self.host or ()):
            out[f"layer{i}.host_k"], out[f"layer{i}.host_v"] = pair
        if self.logits is not None:
            out["logits"] = self.logits
        return out

    @classmethod
    def from_tensors(cls, tokens: Sequence[int], tensors: Dict[str, torch.Tensor],
                     num_layers: int) -> "SlotSnapshot":
        """The snapshot whose ``tensors()`` are ``tensors`` (the counters read off the shapes);
        ``ValueError`` naming a missing tensor."""
        def get(key: str) -> torch.Tensor:
            if key not in tensors:
                raise ValueError(f"tensors: expected {key!r}, got none")
            return tensors[key]

        quantized = "layer0.k_scale" in tensors
        names = BUFFER_NAMES[:8] if quantized else ("k_cache", "v_cache", "k_ring", "v_ring")
        layers = [{n: get(f"layer{i}.{n}") for n in names} for i in range(num_layers)]
        host = None
        if "layer0.host_k" in tensors:
            host = [(get(f"layer{i}.host_k"), get(f"layer{i}.host_v")) for i in range(num_layers)]
        lens = tuple((layer["v_cache"].shape[1], layer["k_ring"].shape[1]) for layer in layers)
        return cls(tokens=tuple(tokens), lens=lens, layers=layers, host=host,
                   logits=tensors.get("logits"))

    @property
    def nbytes(self) -> int:
        """Bytes on the device (the host copy and the logits excluded)."""
        return sum(t.nbytes for layer in self.layers for t in layer.values())

    @property
    def host_nbytes(self) -> int:
        """Bytes of the host copy (recall), 0 without one."""
        return sum(t.nbytes for pair in self.host or () for t in pair)


@dataclass(frozen=True)
class LayerBytes:
    codes: int        # packed 1/2/4-bit codes (or the plain 16-bit region) of the tokens held
    scale_zero: int   # fp16 scales and zeros
    ring: int         # the full-precision residual ring
    counters: int     # per-slot lens
    padding: int      # of codes + scale_zero: the held tokens rounded up to whole groups
    recall: int = 0   # SpeCache's device buffers (recalled rows, indices, lse, mass share)
    host: int = 0     # SpeCache's full-precision copy of the held tokens, in host memory

    @property
    def total(self) -> int:
        """Bytes on the device (the host copy is not among them)."""
        return self.codes + self.scale_zero + self.ring + self.counters + self.recall


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
    With SpeCache (``recall_top_k``): ``recall_bytes``, its device buffers (in the totals), and
    ``host_bytes``, the held tokens' full-precision copy in host memory (not in the totals;
    ``host_allocated_bytes`` for all slots at full capacity).
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
    host_allocated_bytes: int = 0

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
    def recall_bytes(self) -> int:
        return sum(layer.recall for layer in self.layers)

    @property
    def host_bytes(self) -> int:
        return sum(layer.host for layer in self.layers)

    @property
    def padding_bytes(self) -> int:
        return sum(layer.padding for layer in self.layers)

    @property
    def ratio(self) -> float:
        """The compressed bytes over the uncompressed cache's in the model's dtype."""
        return self.total_bytes / self.full_bytes

    def allocation(self) -> str:
        """The whole allocation in one line (a server prints it at start-up): every slot at full
        capacity on the device, and the host copy with recall."""
        gib = lambda n: f"{n / 2**30:.2f} GiB ({n:,} bytes)"  # noqa: E731
        line = f"{gib(self.allocated_bytes)} on the device"
        if self.host_allocated_bytes:
            line += f", host copy (recall) {gib(self.host_allocated_bytes)} in host memory"
        return line

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
        ] + ([f"  recall buffers      {mib(self.recall_bytes)}"] if self.recall_bytes else []) + [
            f"  total               {mib(self.total_bytes)}",
            f"    of which padding  {mib(self.padding_bytes)}",
            f"  formula (paper)     {mib(self.formula_bytes)}   quantized region "
            f"{mib(self.quantized_region_bytes)}",
            f"  uncompressed {dtype:<7}{mib(self.full_bytes)}",
            f"  total / uncompressed {self.ratio:9.4f}   ({100 * (1 - self.ratio):.1f}% smaller)",
            f"  allocated (all slots, full capacity) {mib(self.allocated_bytes)}",
        ]
        if self.host_allocated_bytes:
            lines += [f"  host copy (SpeCache) {mib(self.host_bytes)}   allocated "
                      f"{mib(self.host_allocated_bytes)} in host memory, not in the totals"]
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


def kv_memory_report(cache: StaticKVCache, *, kept: List[int], prompt_len: int, new_tokens: int,
                     batch: int) -> KVMemoryReport:
    """Bytes ``batch`` sequences of ``prompt_len + new_tokens`` tokens occupy in ``cache``, with
    ``kept[l]`` = prompt tokens layer ``l`` keeps of such a prompt."""
    Bmax, H, D, G = cache.max_batch_size, cache.num_kv_heads, cache.head_dim, cache.group_size
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    layers, allocated = [], 0
    rec = cache.recall
    per_slot = lambda ts: sum(nbytes(t) for t in ts) // Bmax  # noqa: E731

    def recall_slot(i: int) -> int:
        """A slot's recall bytes in layer i: its recalled rows, indices, lse and mass plane."""
        r = rec.layers[i]
        return per_slot((r.k, r.v, r.idx, r.lse_ref)) + per_slot([rec.mass]) // len(kept)

    for i, (layer, n_kept) in enumerate(zip(cache.layers, kept)):
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
                                 padding=(held - need) * (codes_tok + sz_tok) * batch,
                                 recall=0 if rec is None else batch * recall_slot(i),
                                 host=0 if rec is None else batch * need * 2 * H * D
                                 * cache.dtype.itemsize))
    if rec is not None:
        allocated += rec.device_bytes
    width = H * D  # d: KV width of one layer
    def full(dtype_bytes: int) -> int:
        return budget.full_kv_bytes(num_layers=len(cache.layers), kv_width=width,
                                    tokens=prompt_len + new_tokens, batch=batch,
                                    dtype_bytes=dtype_bytes)

    # the paper's count: 16-bit values at 2 bytes, as fp16_bytes
    formula = budget.formula_kv_bytes(bits=cache.bits, group_size=G, kv_width=width, head_dim=D,
                                      kept=kept, new_tokens=new_tokens, batch=batch)
    notes = [
        f"ring: {cache.ring} tokens per slot and layer in {cache.dtype} on top of the formula"
        + ("" if rec is None else " (and a spare row for SpeCache's speculative token)"),
        "padding: the held tokens rounded up to a whole quantization group",
    ]
    return KVMemoryReport(layers=layers, full_bytes=full(cache.dtype.itemsize),
                          full_dtype=cache.dtype, fp16_bytes=full(2), formula_bytes=formula,
                          allocated_bytes=allocated, batch=batch, prompt_len=prompt_len,
                          new_tokens=new_tokens, bits=cache.bits, notes=notes,
                          host_allocated_bytes=0 if rec is None else rec.host_bytes)
