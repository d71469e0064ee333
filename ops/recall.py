"""Recall of full-precision K/V from host memory (SpeCache).

SpeCache keeps two copies of every token the quantized cache holds: the low-bit one on the GPU
(the region of :mod:`.cache_layout`) and the model-dtype one in host memory. Before a decode
attention, the ``K`` positions that the step is expected to attend to most are brought back to
the GPU, and the attention uses their full-precision K/V instead of their dequantized values.
The data, per layer (``Bmax`` slots, ``H_kv`` KV heads, ``T_cap`` quantized tokens per slot)::

    host store   k, v        (Bmax, H_kv, T_cap, D) model dtype, host memory (pinned when a GPU
                                                  reads it); row t = the token at quantized
                                                  position t of that slot and head, the order
                                                  of the quantized cache's codes
    recall       recall_k, recall_v (Bmax, H_kv, K, D) model dtype, on the device
                 recall_idx  (Bmax, H_kv, K) int32  quantized position of each recalled row;
                                                  -1 = unused row

Attention with recall is attention over the quantized region in which every position listed in
``recall_idx`` (and below ``lens[b, 0]``) takes the recalled k/v in place of its dequantized
value, followed by the ring as usual. Ring tokens are full precision already and never recalled.
That attention is ``minikv::decode_attention_recall`` (:mod:`.attention_decode_recall`: the
decode attention kernels with recall on, whose recall parts are device functions here), which
also writes the statistic the next step's recall is chosen from: ``mass (Bmax, L, H_kv, >= T_cap
+ ring rows)`` uint8, one plane per slot and layer, the attention a KV group pays each position
the next step holds (a full ring's tokens at the positions its flush gives them) as a code of its
logarithm (:func:`mass_codes`), 0 at the others.

The ops here:

* ``minikv::recall_gather``: ``recall_k[b, h, j] = host_k[b, h, recall_idx[b, h, j]]`` (and v)
  for the slots of a bucket, one launch. On CUDA the Triton kernel dereferences the pinned host
  store itself (zero-copy through unified virtual addressing: a pinned tensor's ``data_ptr()``
  is a valid device address), so the gather is an ordinary kernel node of the captured step,
  with no host synchronization and no copy issued from Python.
* ``minikv::recall_store``: each slot's newest ring token to the host row it takes in the
  quantized order (the host copy grows as tokens are generated, not at flushes).
* ``minikv::recall_store_rows``: T consecutive tokens of one slot (a prefill's kept tokens, a
  tail prefill's chunk) to their host rows, stored by a kernel into the pinned rows
  (stream-ordered, no wait for the GPU).
* :func:`recall_topk`: the positions to recall next, the top-k by ``mass`` per (slot, layer,
  KV head), every layer in one call at the step's end, in plain torch ops (``torch.topk``) that
  the compiled step fuses, with no host sync; :func:`recall_topk_ref` is its rule on attention
  probabilities.

How the host store crosses the op boundary: the op takes the two host tensors as CPU tensors
and runs on the device of the others (CUDA's dispatch key outranks CPU's, so ``idx`` and the
recall buffers on CUDA select the kernel; all on the CPU, the reference), while the public
wrapper takes a :class:`HostStore`, validated once when it is made, because whether a tensor is
pinned is invisible to fake tensors and ``Tensor.is_pinned()`` breaks a ``fullgraph`` trace.
(A CPU tensor among CUDA ones is already how ``minikv::cache_begin_step`` takes ``table_host``
inside the compiled, captured step.)
"""
from __future__ import annotations

from typing import Union

import torch
import triton
import triton.language as tl

from ._checks import FLOAT_DTYPES, check_tensor
from .cache_layout import check_base

# The ranking's mass in one byte a position: code = clamp(round(MASS_STEPS * log2(mass)) +
# MASS_ZERO, 1, 255), 0 = not held. Codes 9% apart span masses 2^-23.75 .. 2^8 (a position's
# attention, summed over a group's query heads, against the step before's log-sum-exp); fp32
# was 1.6% of fp16's K/V bytes at head dim 64, this is 0.4%.
MASS_STEPS = 8
MASS_ZERO = 191

# The gather's launch. A gather program waits on host reads for its whole life, and each one
# resident takes an SM's share from the step's kernels on the main stream, so few programs with
# many reads in flight each: tiles of 32768 elements of k (and of v) over 8 warps, 128 of each
# per thread (256 rows of D 128, 128 KB of host reads in flight per program), at most 4
# programs. KIVI-2 + K 64 on the 8B shape, one H200, ms a step (``perf/NOTES.md``, "SpeCache in
# the engine"): 8 x 4k 5.71 against 6.35 with the tiles of 8192 elements over 4 warps and 8
# programs before; 1 x 32k 5.44 against 5.56; 16 programs of 64 KB were slower (6.69), 256
# elements of each a thread too (6.27-8.08), 2 or 8 programs of 128 KB too (5.89, 5.80).
_TILE_ELEMENTS = 32768
_GATHER_WARPS = 8
_GATHER_PROGRAMS = 4


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def _recall_gather_kernel(host_k, host_v, idx, recall_k, recall_v, T_cap, K, D, ROWS,
                          BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program p: the tiles ``p, p + P, ...`` of ``BLOCK_R`` rows of the ``ROWS = B * H_kv * K``
    recall rows taken in order (P programs; a tile may span planes).

    host_k, host_v: (Bmax, H_kv, T_cap, D), possibly host memory; idx: (B, H_kv, K) int32;
    recall_k, recall_v: (Bmax, H_kv, K, D). The first B * H_kv planes of all of them are the
    planes of slots < B, so row r of ``idx`` is row r of the recall buffers, of plane r // K.
    """
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    first, n_prog = tl.program_id(0), tl.num_programs(0)
    for i in range(0, tl.cdiv(tl.cdiv(ROWS, BLOCK_R) - first, n_prog)):
        r = (first.to(tl.int64) + i * n_prog) * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = r < ROWS
        # -- which host rows: -1 (and anything outside [0, T_cap), never read) gives a zero row
        t = tl.load(idx + r, mask=r_ok, other=-1)
        hit = (t >= 0) & (t < T_cap)
        src = ((r // K) * T_cap + t)[:, None] * D + d[None, :]
        src_mask = hit[:, None] & d_ok[None, :]
        # -- read both host rows before storing either: two reads in flight per row
        k = tl.load(host_k + src, mask=src_mask, other=0.0)
        v = tl.load(host_v + src, mask=src_mask, other=0.0)
        dst = r[:, None] * D + d[None, :]
        dst_mask = r_ok[:, None] & d_ok[None, :]
        tl.store(recall_k + dst, k, mask=dst_mask)
        tl.store(recall_v + dst, v, mask=dst_mask)


@triton.jit
def _recall_store_kernel(k_ring, v_ring, lens, ring_index, host_k, host_v, H, T_cap, D,
                         ROWS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program b: slot b's ring row ``ring_index[b]`` (every head) -> host row ``lens[b, 0] +
    ring_index[b]``; nothing for -1. k_ring, v_ring: (Bmax, H, ROWS, D); host_k, host_v:
    (Bmax, H, T_cap, D), possibly host memory."""
    b = tl.program_id(0).to(tl.int64)
    i = tl.load(ring_index + b)
    t = tl.load(lens + 2 * b) + i
    if (i >= 0) & (t < T_cap):
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        mask = (h < H)[:, None] & (d < D)[None, :]
        src = ((b * H + h[:, None]) * ROWS + i) * D + d[None, :]
        dst = ((b * H + h[:, None]) * T_cap + t) * D + d[None, :]
        tl.store(host_k + dst, tl.load(k_ring + src, mask=mask), mask=mask)
        tl.store(host_v + dst, tl.load(v_ring + src, mask=mask), mask=mask)


# start and T are not specialized, and the block does not depend on T: their values (1, multiples
# of 16) would each compile a variant on the serving path (a prefill's kept tokens, a tail's chunk
# after a flush) that the warm-up does not run
@triton.jit(do_not_specialize=["start", "T"])
def _recall_store_rows_kernel(k, v, host_k, host_v, start, T, T_cap, D,
                              stride_kh, stride_kt, stride_kd, stride_vh, stride_vt, stride_vd,
                              BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (h, j): rows ``j * BLOCK_T ..`` of head h of ``k, v (H, T, D)`` (any strides) ->
    host rows ``start + t`` of ``host_k, host_v (H, T_cap, D)``, contiguous, possibly host
    memory."""
    h = tl.program_id(0).to(tl.int64)
    t = (tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # (t * stride: int64)
    d = tl.arange(0, BLOCK_D)
    mask = (t < T)[:, None] & (d < D)[None, :]
    dst = ((h * T_cap + start + t) * D)[:, None] + d[None, :]
    tl.store(host_k + dst, tl.load(k + h * stride_kh + t[:, None] * stride_kt
                                   + d[None, :] * stride_kd, mask=mask), mask=mask)
    tl.store(host_v + dst, tl.load(v + h * stride_vh + t[:, None] * stride_vt
                                   + d[None, :] * stride_vd, mask=mask), mask=mask)


def _recall_store_rows_triton(k, v, host_k, host_v, start) -> None:
    H, T, D = k.shape
    block_d = triton.next_power_of_2(D)
    block_t = max(1, 4096 // block_d)
    _recall_store_rows_kernel[(H, triton.cdiv(T, block_t))](
        k, v, host_k, host_v, start, T, host_k.shape[1], D, *k.stride(), *v.stride(),
        BLOCK_T=block_t, BLOCK_D=block_d)


def _recall_store_triton(k_ring, v_ring, lens, ring_index, host_k, host_v) -> None:
    _, H, rows, D = k_ring.shape
    _recall_store_kernel[(ring_index.shape[0],)](
        k_ring, v_ring, lens, ring_index, host_k, host_v, H, host_k.shape[2], D, ROWS=rows,
        BLOCK_H=triton.next_power_of_2(H), BLOCK_D=triton.next_power_of_2(D))


def _recall_gather_triton(host_k, host_v, idx, recall_k, recall_v) -> None:
    B, H, K = idx.shape
    T_cap, D = host_k.shape[2], host_k.shape[3]
    rows = B * H * K
    if rows == 0:
        return
    block_d = triton.next_power_of_2(D)
    block_r = max(1, min(_TILE_ELEMENTS // block_d, triton.next_power_of_2(rows)))
    grid = (min(triton.cdiv(rows, block_r), _GATHER_PROGRAMS),)
    _recall_gather_kernel[grid](host_k, host_v, idx, recall_k, recall_v, T_cap, K, D, rows,
                                BLOCK_R=block_r, BLOCK_D=block_d, num_warps=_GATHER_WARPS)


# ----------------------------------------------------------------------------------------------
# The decode attention's recall parts: device functions of ``attention_decode``'s split kernel,
# called under its RECALL constexpr (``minikv::decode_attention_recall``)
# ----------------------------------------------------------------------------------------------

_MASS_STEPS = tl.constexpr(MASS_STEPS)
_MASS_ZERO = tl.constexpr(MASS_ZERO)


@triton.jit
def kept(bm_plane, tokens, hi, RECALL: tl.constexpr):
    """(BLOCK_N,) bool: ``tokens < hi``, less (with RECALL) the recalled ones, whose bit
    ``t % 32`` of word ``t // 32`` is set in the plane's recall bitmap."""
    keep = tokens < hi
    if RECALL:
        word = tl.load(bm_plane + tokens // 32, mask=keep, other=0)
        keep = keep & (((word >> (tokens % 32)) & 1) == 0)
    return keep


@triton.jit
def store_mass(mass_plane, tokens, keep, p, m_i, lse2, held):
    """The attention mass of a block's kept tokens, ``sum_n exp2(s[t, n] - lse2[n])`` over the
    columns n, computed as ``sum_n p[t, n] * exp2(m_i[n] - lse2[n])`` (p = exp2(s - m_i)), stored
    as its one-byte code (:func:`mass_codes`).

    tokens, keep: (BLOCK_N,); p: (BLOCK_N, BLOCK_H) fp32; m_i: (BLOCK_H,) the running max p was
    taken against; lse2: (BLOCK_H,) the reference log-sum-exp (log2 domain) of the last row's
    columns, +inf in the others (weight 0); held: (BLOCK_N,) or a scalar, False for a token the
    next step does not hold quantized: code 0 (never ranked). The exponent is capped at 120: a
    reference far below this step's scores saturates the mass (at code 255) instead of making
    inf * 0 = NaN.
    """
    w = tl.exp2(tl.minimum(m_i - lse2, 120.0))
    mass = tl.sum(p * w[None, :], axis=1)
    code = tl.floor(tl.log2(tl.maximum(mass, 1e-30)) * _MASS_STEPS + (_MASS_ZERO + 0.5))
    code = tl.where(held, tl.minimum(tl.maximum(code, 1.0), 255.0), 0.0)
    tl.store(mass_plane + tokens, code.to(tl.uint8), mask=keep)


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def mark_recalled(bm_plane, ridx_plane, K_REC, lo, hi):
    """Words ``[lo // 32, ceil(hi / 32))`` of a plane's recall bitmap, from its K indices: bit
    ``t % 32`` of word ``t // 32`` is set iff some index is ``t`` (-1: none). Whole words, so
    that two splits sharing a word write the same value."""
    w_hi = tl.cdiv(hi, 32)
    for w0 in range(lo // 32, w_hi, 32):
        w = w0 + tl.arange(0, 32)
        words = tl.zeros((32,), tl.int32)
        for j0 in range(0, K_REC, 64):
            j = j0 + tl.arange(0, 64)
            pos = tl.load(ridx_plane + j, mask=j < K_REC, other=-1)
            bit = tl.where(pos >= 0, 1 << (pos & 31), 0)
            hits = tl.where((pos // 32)[None, :] == w[:, None], bit[None, :], 0)   # (32, 64)
            words = words | tl.reduce(hits, 1, _or)
        tl.store(bm_plane + w, words, mask=w < w_hi)


# ----------------------------------------------------------------------------------------------
# Pure-PyTorch references
# ----------------------------------------------------------------------------------------------


def recall_gather_ref(host_k, host_v, idx, recall_k, recall_v) -> None:
    """Reference for :func:`recall_gather` (the op's arguments; tensors on any devices)."""
    B, H, K = idx.shape
    T_cap = host_k.shape[2]
    t = idx.to(device=host_k.device, dtype=torch.int64)             # (B, H, K)
    hit = (t >= 0) & (t < T_cap)
    rows = torch.where(hit, t, 0)[..., None].expand(B, H, K, host_k.shape[3])
    for host, out in ((host_k, recall_k), (host_v, recall_v)):
        got = torch.gather(host[:B], 2, rows)                       # (B, H, K, D)
        got = torch.where(hit[..., None], got, torch.zeros_like(got))
        out[:B].copy_(got)


def recall_store_ref(k_ring, v_ring, lens, ring_index, host_k, host_v) -> None:
    """Reference for :func:`recall_store` (the op's arguments; tensors on any devices)."""
    T_cap = host_k.shape[2]
    for b, i in enumerate(ring_index.tolist()):
        t = int(lens[b, 0]) + i
        if i >= 0 and t < T_cap:
            host_k[b, :, t] = k_ring[b, :, i].to(host_k.device)
            host_v[b, :, t] = v_ring[b, :, i].to(host_v.device)


def recall_store_rows_ref(k, v, host_k, host_v, start: int) -> None:
    """Reference for :func:`recall_store_rows` (the op's arguments; tensors on any devices)."""
    rows = slice(start, start + k.shape[1])
    host_k[:, rows] = k.to(host_k.device)
    host_v[:, rows] = v.to(host_v.device)


def mass_codes(mass: torch.Tensor) -> torch.Tensor:
    """fp32 masses (any shape; -inf = not held, 0 and below 2^-23.75 = the lowest code) to the
    uint8 codes the attention writes (``MASS_STEPS`` codes a doubling, mass 1 at ``MASS_ZERO``)."""
    code = torch.floor(torch.log2(mass) * MASS_STEPS + (MASS_ZERO + 0.5))
    return torch.where(mass == float("-inf"), 0, code.clamp(1, 255)).to(torch.uint8)


def mass_values(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes back to fp32 masses (the middle of each code's range; 0 for code 0)."""
    m = torch.exp2((codes.float() - MASS_ZERO) / MASS_STEPS)
    return torch.where(codes > 0, m, 0.0)


def recall_topk_ref(probs: torch.Tensor, k: int, num_kv_heads: int) -> torch.Tensor:
    """The positions to recall: per (slot, KV head), the ``k`` with the most attention mass.

    The mass of position ``t`` for KV head ``h`` is the sum of ``probs[b, i, t]`` over the query
    heads ``i`` of its group (``i // (H_q / H_kv) == h``), the attention the whole group pays it.

    Args:
        probs: ``(B, H_q, T)`` attention probabilities over the quantized positions (zero where
            nothing is held); ``H_q % num_kv_heads == 0``.
        k: positions per (slot, KV head), ``k >= 0``.
        num_kv_heads: H_kv.

    Returns:
        ``(B, H_kv, k)`` int32: positions by decreasing mass (ties in ``torch.topk``'s order),
        -1 in the last ``k - T`` columns when ``T < k``.
    """
    B, H_q, T = probs.shape
    mass = probs.float().reshape(B, num_kv_heads, H_q // num_kv_heads, T).sum(2)  # (B, H_kv, T)
    top = torch.topk(mass, min(k, T), dim=-1).indices.to(torch.int32)
    pad = top.new_full((B, num_kv_heads, k - top.shape[-1]), -1)
    return torch.cat([top, pad], dim=-1)


# ----------------------------------------------------------------------------------------------
# Registered op: the reference by default (CPU), the Triton kernel on CUDA
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("minikv::recall_gather", mutates_args=("recall_k", "recall_v"))
def _recall_gather_op(host_k: torch.Tensor, host_v: torch.Tensor, idx: torch.Tensor,
                      recall_k: torch.Tensor, recall_v: torch.Tensor) -> None:
    recall_gather_ref(host_k, host_v, idx, recall_k, recall_v)


@_recall_gather_op.register_fake
def _(host_k, host_v, idx, recall_k, recall_v):
    return None


# Chosen whenever idx / the recall buffers are CUDA tensors, the host store being CPU tensors.
_recall_gather_op.register_kernel("cuda")(_recall_gather_triton)


@torch.library.custom_op("minikv::recall_store", mutates_args=("host_k", "host_v"))
def _recall_store_op(k_ring: torch.Tensor, v_ring: torch.Tensor, lens: torch.Tensor,
                     ring_index: torch.Tensor, host_k: torch.Tensor, host_v: torch.Tensor) -> None:
    recall_store_ref(k_ring, v_ring, lens, ring_index, host_k, host_v)


@_recall_store_op.register_fake
def _(k_ring, v_ring, lens, ring_index, host_k, host_v):
    return None


_recall_store_op.register_kernel("cuda")(_recall_store_triton)


@torch.library.custom_op("minikv::recall_store_rows", mutates_args=("host_k", "host_v"))
def _recall_store_rows_op(k: torch.Tensor, v: torch.Tensor, host_k: torch.Tensor,
                          host_v: torch.Tensor, start: int) -> None:
    recall_store_rows_ref(k, v, host_k, host_v, start)


@_recall_store_rows_op.register_fake
def _(k, v, host_k, host_v, start):
    return None


_recall_store_rows_op.register_kernel("cuda")(_recall_store_rows_triton)


def _recall_topk_ops(mass: torch.Tensor, k: int, block: int = 1) -> torch.Tensor:
    """:func:`recall_topk`'s computation (the same arguments, checked by it)."""
    score = mass
    if block > 1:
        held = torch.nn.functional.pad(mass > 0, (0, -mass.shape[-1] % block))  # (..., T')
        blocks = torch.nn.functional.pad(mass_values(mass), (0, -mass.shape[-1] % block))
        # a block's mass: the sum of its held positions (-1 for a block with none)
        score = torch.where(held.unflatten(-1, (-1, block)).any(-1),
                            blocks.unflatten(-1, (-1, block)).sum(-1), -1.0)
    top = torch.topk(score, min(k // block, score.shape[-1]), dim=-1)
    idx = torch.where(top.values > 0, top.indices, -1)                     # (..., n)
    if block > 1:
        pos = (idx[..., None] * block + torch.arange(block, device=mass.device)).flatten(-2)
        idx = torch.where((pos >= 0) & held.gather(-1, pos.clamp(min=0)), pos, -1)
    idx = idx.to(torch.int32)
    if idx.shape[-1] < k:
        idx = torch.cat([idx, idx.new_full((*idx.shape[:-1], k - idx.shape[-1]), -1)], dim=-1)
    return idx


# ----------------------------------------------------------------------------------------------
# Public surface
# ----------------------------------------------------------------------------------------------


class HostStore:
    """One layer's full-precision K/V in host memory, validated once for the device that reads
    it (the recall kernel dereferences it; a pageable page there is an illegal address).

    ``k, v: (Bmax, H_kv, T_cap, D)`` in the model dtype, contiguous CPU tensors, pinned when
    ``device`` is CUDA (with unified addressing, pinned memory is mapped for every GPU). Row
    ``t`` of plane ``(b, h)`` is the token at quantized position ``t`` of slot ``b``. Writers
    (prefill, ring flushes) fill rows in place; a captured gather reads them at every replay, so
    the store must outlive the graphs that read it.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, device: Union[str, torch.device]):
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"device: expected a cpu or cuda device, got {self.device}")
        if self.device.type == "cuda" and self.device.index is None and torch.cuda.is_available():
            # tensors report cuda:N; "cuda" alone would never equal them
            self.device = torch.device("cuda", torch.cuda.current_device())
        check_tensor("k", k, ndim=4, dtypes=FLOAT_DTYPES, device="cpu", contiguous=True)
        check_tensor("v", v, shape=tuple(k.shape), dtypes=(k.dtype,), device="cpu",
                     contiguous=True)
        if self.device.type == "cuda":
            for name, t in (("k", k), ("v", v)):
                if not t.is_pinned():
                    raise ValueError(f"{name}: expected pinned host memory (a GPU reads it "
                                     f"directly), got pageable memory")
        self.k, self.v = k, v

    @classmethod
    def allocate(cls, *, max_batch_size: int, num_kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype, device: Union[str, torch.device]) -> "HostStore":
        """Zeroed ``(max_batch_size, num_kv_heads, capacity, head_dim)`` k and v, pinned when
        ``device`` is CUDA."""
        pin = torch.device(device).type == "cuda"
        shape = (max_batch_size, num_kv_heads, capacity, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, pin_memory=pin),
                   torch.zeros(shape, dtype=dtype, pin_memory=pin), device)

    @property
    def nbytes(self) -> int:
        """Host bytes of k and v together."""
        return self.k.nbytes + self.v.nbytes


def recall_gather(store: HostStore, idx: torch.Tensor, recall_k: torch.Tensor,
                  recall_v: torch.Tensor) -> None:
    """Copy the host rows ``idx`` names into the recall buffers of the slots of a bucket.

    For every ``b < B``, KV head ``h`` and row ``j``: ``recall_k[b, h, j] = store.k[b, h,
    idx[b, h, j]]`` (and v); rows with ``idx < 0`` (or ``>= T_cap``, not checked: that would
    sync) become zeros. Slots ``>= B`` are not touched. One launch on CUDA, reading the pinned
    store in place; no host synchronization, so it may be captured in a CUDA graph, and the
    graph replayed after ``idx`` and the store's rows change in place.

    Args:
        store: the layer's :class:`HostStore`, ``(Bmax, H_kv, T_cap, D)``, made for the
            recall buffers' device.
        idx: ``(B, H_kv, K)`` int32, contiguous (a leading slice of the ``(Bmax, H_kv, K)``
            index buffer is fine), on the recall buffers' device; ``1 <= B <= Bmax``.
        recall_k, recall_v: ``(Bmax, H_kv, K, D)`` in the store's dtype, contiguous, whole
            buffers (not views), on ``store.device``; mutated.

    Raises:
        ValueError: a shape, dtype or device inconsistent with the above.
    """
    Bmax, H = _check_store_and_pair(store, ("recall_k", recall_k), ("recall_v", recall_v))
    K = recall_k.shape[2]
    for name, t in (("recall_k", recall_k), ("recall_v", recall_v)):
        check_base(name, t)
    check_tensor("idx", idx, shape=(None, H, K), dtypes=(torch.int32,), device=store.device,
                 contiguous=True)
    if not 1 <= idx.shape[0] <= Bmax:
        raise ValueError(f"idx: expected 1 <= B (idx.shape[0]) <= max_batch_size={Bmax}, "
                         f"got shape {tuple(idx.shape)}")
    torch.ops.minikv.recall_gather(store.k, store.v, idx, recall_k, recall_v)


def recall_topk(mass: torch.Tensor, k: int, block: int = 1) -> torch.Tensor:
    """The positions to recall at the next step: per row of ``mass`` (a slot, layer and KV
    head), the ``k`` positions with the most attention mass (:func:`recall_topk_ref`'s rule on
    the group sums that ``decode_attention_recall`` writes), or the ``k / block`` aligned blocks
    of ``block`` positions with the most mass (larger host reads). Code 0 marks a position the
    next step does not hold (the attention writes it for ring tokens that stay in the ring; the
    cache resets an emptied slot's planes to it); it is never chosen. Positions whose codes tie
    (masses within 9%) are taken in ``torch.topk``'s order.

    One call ranks every layer of a step (``(B, L, H_kv, T)``): plain torch ops on the device (a
    select, ``torch.topk``), no host sync, fused by ``torch.compile`` into the step, capturable
    in a CUDA graph. One ``torch.topk`` per layer cost ~45 us at 1 x 32k tokens x 8 KV heads
    (H100), 1.5 ms a step of 32 layers; a sort-based Triton top-k was slower (``perf/NOTES.md``,
    "SpeCache").

    Args:
        mass: ``(..., T)`` uint8, contiguous: the masses' codes (:func:`mass_codes`), 0 where
            not held.
        k: positions per row, ``k >= 0``, a multiple of ``block``.
        block: 1 (single positions) or the block size, ``>= 1``.

    Returns:
        ``(..., k)`` int32: positions by decreasing code (blocks: by the sum of their masses;
        ties in ``torch.topk``'s order), -1 where a row holds fewer than ``k`` (blocks: the
        positions of a chosen block that are not held).

    Raises:
        ValueError: a shape, dtype or value inconsistent with the above.
    """
    check_tensor("mass", mass, dtypes=(torch.uint8,), contiguous=True)
    if mass.ndim < 1:
        raise ValueError(f"mass: expected at least 1 dim (positions last), got shape "
                         f"{tuple(mass.shape)}")
    for name, value, lo in (("k", k, 0), ("block", block, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < lo:
            raise ValueError(f"{name}: expected an int >= {lo}, got {value!r}")
    if k % block:
        raise ValueError(f"k: expected a multiple of block={block}, got {k}")
    return _recall_topk_ops(mass, k, block)


def _check_store_and_pair(store, first: tuple, second: tuple) -> tuple:
    """``store`` a :class:`HostStore`; ``first`` / ``second`` (name, tensor) contiguous
    ``(Bmax, H_kv, any, D)`` buffers in the store's dtype on its device, the second shaped as
    the first. Returns ``(Bmax, H_kv)``."""
    if not isinstance(store, HostStore):
        raise ValueError(f"store: expected a HostStore, got {type(store).__name__}")
    Bmax, H, _, D = store.k.shape
    check_tensor(*first, shape=(Bmax, H, None, D), dtypes=(store.k.dtype,), device=store.device,
                 contiguous=True)
    check_tensor(*second, shape=tuple(first[1].shape), dtypes=(store.k.dtype,),
                 device=store.device, contiguous=True)
    return Bmax, H


def recall_store(store: HostStore, k_ring: torch.Tensor, v_ring: torch.Tensor, lens: torch.Tensor,
                 ring_index: torch.Tensor) -> None:
    """Copy each slot's newest ring token to its host row: ``store.k[b, :, lens[b, 0] + i] =
    k_ring[b, :, i]`` (and v) for ``i = ring_index[b] >= 0``, the row that token takes in the
    quantized order once the ring is flushed (a flush appends the ring's tokens in order at
    ``lens[b, 0]``). Slots with -1 and slots ``>= B`` are not touched.

    Writing each token as it enters the ring keeps the host copy complete without a copy of
    128 tokens at every flush; per step and layer it is ``H_kv x D x 2`` values per slot. One
    launch on CUDA, storing into the pinned store in place (no host synchronization, capturable).

    Args:
        store: the layer's :class:`HostStore` ``(Bmax, H_kv, T_cap, D)``, made for the ring's
            device.
        k_ring, v_ring: the layer's rings ``(Bmax, H_kv, rows, D)`` in the store's dtype,
            contiguous, after this step's ring write.
        lens: ``(Bmax, 2)`` int32, the layer's counters after ``cache_begin_step``.
        ring_index: ``(B,)`` int32, contiguous: the layer's row of ``cache_begin_step``'s result.

    Raises:
        ValueError: a shape, dtype or device inconsistent with the above.
    """
    Bmax, _ = _check_store_and_pair(store, ("k_ring", k_ring), ("v_ring", v_ring))
    check_tensor("lens", lens, shape=(Bmax, 2), dtypes=(torch.int32,), device=store.device,
                 contiguous=True)
    check_tensor("ring_index", ring_index, ndim=1, dtypes=(torch.int32,), device=store.device,
                 contiguous=True)
    if not 1 <= ring_index.shape[0] <= Bmax:
        raise ValueError(f"ring_index: expected 1 <= B <= max_batch_size={Bmax} entries, got "
                         f"shape {tuple(ring_index.shape)}")
    torch.ops.minikv.recall_store(k_ring, v_ring, lens, ring_index, store.k, store.v)


def recall_store_rows(host_k: torch.Tensor, host_v: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, start: int) -> None:
    """Copy T consecutive tokens of one slot to their host rows: ``host_k[:, start + t] = k[:,
    t]`` (and v) for ``t < T`` (a prefill's kept tokens from row 0; a tail prefill's chunk,
    whose ring rows take quantized positions ``start ..`` once flushed). On CUDA one launch
    storing into the pinned rows in place, ordered on the stream like any kernel (a later
    gather on the stream reads them; a CPU reader syncs first); a ``copy_`` into the strided
    rows would wait for the GPU and stage through pageable memory.

    Args:
        host_k, host_v: ``(H_kv, T_cap, D)``, CPU, contiguous (one slot's plane of a
            :class:`HostStore`, ``store.k[slot]``; pinned when k is on CUDA, which a pageable
            tensor would fail in the launch).
        k, v: ``(H_kv, T, D)`` in the store's dtype, any strides, on the store's device.
        start: the first host row, ``0 <= start <= T_cap - T``.

    Raises:
        ValueError: a shape, dtype, device or ``start`` inconsistent with the above.
    """
    check_tensor("host_k", host_k, ndim=3, dtypes=FLOAT_DTYPES, device="cpu", contiguous=True)
    H, T_cap, D = host_k.shape
    check_tensor("host_v", host_v, shape=(H, T_cap, D), dtypes=(host_k.dtype,), device="cpu",
                 contiguous=True)
    check_tensor("k", k, shape=(H, None, D), dtypes=(host_k.dtype,))
    check_tensor("v", v, shape=tuple(k.shape), dtypes=(host_k.dtype,), device=k.device)
    if not 0 <= start <= T_cap - k.shape[1]:
        raise ValueError(f"start: expected 0 <= start <= T_cap - T = {T_cap - k.shape[1]}, got "
                         f"{start}")
    torch.ops.minikv.recall_store_rows(k, v, host_k, host_v, int(start))
