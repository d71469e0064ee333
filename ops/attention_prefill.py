"""Selective attention: causal prefill attention that also returns every key's cumulative score.

MiniKV picks the heavy-hitter tokens of a prompt by the column sums of the normalized causal
attention probabilities. For one KV head ``h`` of a grouped-query model (query heads
``i`` with ``i // (H_q // H_kv) == h``)::

    out[b, i]       = softmax(q[b, i] @ k[b, h]^T * scale, causal) @ v[b, h]
    scores[b, h, t] = sum over those i, sum over rows r >= t of P_i[r, t]

Computing ``scores`` with a plain attention would materialize the ``L x L`` probabilities
(32 heads x 32k x 32k x 4 bytes = 128 GiB at L = 32k). The Triton path keeps memory linear in
``L`` with two launches and no atomics (so the result is deterministic and no program ever
depends on another program of the same launch):

* pass 1 (``_selective_attention_fwd_kernel``): a causal flash-attention forward, one program
  per (query block, query head), that also stores each row's log-sum-exp (base 2, fp32).
* pass 2 (``_selective_attention_scores_kernel``): one program per (key block, KV head). It
  streams the query blocks of every query head of the group that can see its keys past the
  resident key block, recomputes ``q k^T``, normalizes with the stored log-sum-exp and sums
  down the columns. Each score is written exactly once, by the program that owns its key block.

Work: pass 1 is a causal forward (``q k^T`` and ``P v``); pass 2 repeats the causal ``q k^T``
and the exponentials but not ``P v``, so both together do about 1.5x a forward's matmul FLOPs
and twice its exponentials. Both passes split their loops into fully visible blocks (no mask
arithmetic) and the blocks on the diagonal, and both fold ``log2(e)`` into the scale so every
exponential is one ``exp2``.

Extra memory beyond ``out``: the log-sum-exp ``(B, H_q, L)`` and the scores ``(B, H_kv, L)``,
both fp32 (5 MiB at B=1, 32/8 heads, L=32k).

``causal_attention`` is pass 1 alone, for the selection rules that read no cumulative scores.

On CPU tensors the op runs a chunked PyTorch implementation (``_selective_attention_chunked``)
whose memory is ``O(L x chunk)``; ``selective_attention_ref`` is the plain, fully materialized
definition used by the tests.
"""
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from ._checks import check_tensor

__all__ = ["causal_attention", "selective_attention", "selective_attention_ref"]

# Head dims the Triton kernels are built for: tl.dot needs the reduction dim >= 16 and
# power-of-two block shapes; 256 is the largest head dim of common decoder models. Llama-family
# models use 64 (SmolLM2) or 128 (Llama 2/3, Mistral, Qwen).
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)

_LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

# L is never specialized on: a prompt of any length reuses the same compiled kernel. The strides
# still get Triton's divisibility-by-16 specialization, but with D in SUPPORTED_HEAD_DIMS every
# stride of a (B, H, L, D) or (B, L, H, D) layout is a multiple of 16 whatever L is.
@triton.jit(do_not_specialize=["L"])
def _selective_attention_fwd_kernel(
    Q, K, V, Out, Lse,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    L, H_q, group_size, qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SCALE_NEGATIVE: tl.constexpr,
):
    """Causal flash-attention forward for one (query block, query head); also writes the LSE.

    Grid: (B * H_q, cdiv(L, BLOCK_M)). Requires BLOCK_M % BLOCK_N == 0.
    Lse: (B, H_q, L) fp32 contiguous, holding log2(sum_t exp2(s[r, t])) with
    s = q k^T * qk_scale, qk_scale = scale * log2(e): the natural log-sum-exp times log2(e).
    SCALE_NEGATIVE: whether qk_scale < 0 (the running max of s is then the scaled row minimum).
    """
    pid_bh = tl.program_id(0)
    # The GPU schedules programs roughly in launch order and grid axis 0 varies fastest, so heads
    # are on axis 0 and the query blocks run last-to-first: the last block sees the most keys,
    # and starting the longest programs first keeps the tail of the launch short.
    start_m = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M
    b = (pid_bh // H_q).to(tl.int64)
    h = (pid_bh % H_q).to(tl.int64)
    kv_h = h // group_size

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < L

    q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    k_base = K + b * stride_kb + kv_h * stride_kh
    v_base = V + b * stride_vb + kv_h * stride_vh

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)

    # -- phase 1: key blocks entirely left of the diagonal. Every key there is < start_m < L and
    # visible to every row, so neither the causal mask nor a bounds mask is needed. The row max
    # is taken on the raw logits and scaled once per row, so each logit costs one FMA
    # (qk * scale - max) before its exp2.
    for start_n in range(0, start_m, BLOCK_N):
        cols = start_n + offs_n
        k = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :])
        qk = tl.dot(q, tl.trans(k))
        if SCALE_NEGATIVE:
            m_new = tl.maximum(m_i, tl.min(qk, 1) * qk_scale)
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :])
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new

    # -- phase 2: key blocks on the diagonal (causal mask) and past L (bounds mask). Every row
    # r of this block sees key start_m <= r, so its running max is finite after the first step
    # and fully masked blocks contribute exp2(-inf) = 0.
    for start_n in range(start_m, tl.minimum(start_m + BLOCK_M, L), BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < L
        k_ptrs = k_base + cols[:, None] * stride_kn + offs_d[None, :]
        k = tl.load(k_ptrs, mask=col_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(offs_m[:, None] >= cols[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = v_base + cols[:, None] * stride_vn + offs_d[None, :]
        v = tl.load(v_ptrs, mask=col_ok[:, None], other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new

    # -- epilogue: normalize, store out and the base-2 log-sum-exp of each valid row.
    acc = acc / l_i[:, None]
    o_ptrs = Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :]
    tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=row_ok[:, None])
    tl.store(Lse + pid_bh.to(tl.int64) * L + offs_m, m_i + tl.log2(l_i), mask=row_ok)


@triton.jit
def _logits_and_lse(q_group, lse_group, g, rows, k, offs_d, stride_qh, stride_qm, L):
    """Raw logits q . k^T of query rows ``rows`` of head g of the group against the key block k,
    and those rows' LSE. Rows past L get lse = +inf, so their probabilities are exp2(s - inf) =
    0."""
    row_ok = rows < L
    q = tl.load(q_group + g * stride_qh + rows[:, None] * stride_qm + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    lse = tl.load(lse_group + g * L + rows, mask=row_ok, other=float("inf"))
    return tl.dot(q, tl.trans(k)), lse


@triton.jit(do_not_specialize=["L"])
def _selective_attention_scores_kernel(
    Q, K, Lse, Scores,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    L, H_q, H_kv, group_size, qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Column sums of the normalized causal probabilities for one (key block, KV head).

    Grid: (B * H_kv, cdiv(L, BLOCK_N)). Reads Lse written by the previous launch.
    Scores: (B, H_kv, L) fp32 contiguous; each program writes only its own BLOCK_N entries.
    """
    pid_bh = tl.program_id(0)
    # Key block 0 is seen by every query block, so it has the most work: natural order on axis 1
    # already starts the longest programs first.
    start_n = tl.program_id(1) * BLOCK_N
    b = (pid_bh // H_kv).to(tl.int64)
    kv_h = (pid_bh % H_kv).to(tl.int64)

    offs_m = tl.arange(0, BLOCK_M)
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)

    # The key block stays resident for the whole program (K is read once per GQA group); keys
    # past L load as 0 and their columns are never stored.
    k_ptrs = K + b * stride_kb + kv_h * stride_kh + cols[:, None] * stride_kn + offs_d[None, :]
    k = tl.load(k_ptrs, mask=(cols < L)[:, None], other=0.0)
    # Summing tiles elementwise and reducing once at the end avoids a cross-warp reduction per
    # step (a 64 x 128 fp32 tile is 32 registers per thread at 8 warps).
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    # The group's query heads h = kv_h * group_size + g, g < group_size.
    q_group = Q + b * stride_qb + (kv_h * group_size) * stride_qh
    lse_group = Lse + (b * H_q + kv_h * group_size) * L

    # Query blocks [m_lo, m_mid) overlap the diagonal of this key block and need the causal mask;
    # rows from m_mid on are >= start_n + BLOCK_N, past every key of the block.
    m_lo = (start_n // BLOCK_M) * BLOCK_M
    m_mid = tl.minimum(tl.cdiv(start_n + BLOCK_N, BLOCK_M) * BLOCK_M, L)
    n_diag = tl.cdiv(m_mid - m_lo, BLOCK_M)
    n_full = tl.cdiv(L - m_mid, BLOCK_M)

    # Each part is one flat loop over (head of the group, query block), so the software pipeline
    # (num_stages deep) streams the q tiles and LSE rows of all heads without restarting.
    for i in range(0, group_size * n_diag):
        rows = m_lo + (i % n_diag) * BLOCK_M + offs_m
        s, lse = _logits_and_lse(q_group, lse_group, (i // n_diag).to(tl.int64), rows, k,
                                 offs_d, stride_qh, stride_qm, L)
        # Mask before exp2: a future key's logit may exceed the row's LSE and overflow.
        s = tl.where(rows[:, None] >= cols[None, :], s * qk_scale - lse[:, None], float("-inf"))
        acc += tl.exp2(s)

    for i in range(0, group_size * n_full):
        rows = m_mid + (i % n_full) * BLOCK_M + offs_m
        s, lse = _logits_and_lse(q_group, lse_group, (i // n_full).to(tl.int64), rows, k,
                                 offs_d, stride_qh, stride_qm, L)
        # One FMA and one exp2 per logit.
        acc += tl.exp2(s * qk_scale - lse[:, None])

    tl.store(Scores + pid_bh.to(tl.int64) * L + cols, tl.sum(acc, 0), mask=cols < L)


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _PassConfig:
    """Block shapes and launch parameters of one pass.

    ``block_m`` counts query rows, ``block_n`` keys. Pass 1 (forward): ``block_m`` rows per
    program, ``block_n`` keys per step; ``block_m`` must be a multiple of ``block_n``. Pass 2
    (scores): ``block_n`` keys per program, ``block_m`` query rows per step. Blocks are powers of
    two >= 16 (tl.dot's minimum on GPU).
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name}: expected a power of two >= 16, got {value}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps: expected 1, 2, 4, 8 or 16, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages: expected >= 1, got {self.num_stages}")


def _check_fwd_config(config: _PassConfig) -> None:
    if config.block_m % config.block_n:
        raise ValueError(
            f"block_m: expected a multiple of block_n={config.block_n} in the forward pass, "
            f"got {config.block_m}"
        )


# Starting points for H100/H200 (bf16, the shapes of perf/bench_selective_attention.py); the
# benchmark's --tune flag searches each pass separately and prints replacements. Pass 1 follows
# the usual flash-attention tiling (the q tile stays on chip; K/V stream through shared memory,
# pipelined num_stages deep). Pass 2 holds a large key block and streams smaller query blocks.
_GPU_FWD_CONFIGS = {
    16: _PassConfig(64, 32, 4, 3),
    32: _PassConfig(64, 32, 4, 3),
    64: _PassConfig(128, 64, 4, 3),
    128: _PassConfig(128, 64, 8, 3),
    # D = 256: a 64 x 256 fp32 accumulator needs 8 warps to stay at 64 registers per thread.
    256: _PassConfig(64, 32, 8, 2),
}
_GPU_SCORES_CONFIGS = {
    16: _PassConfig(64, 64, 4, 3),
    32: _PassConfig(64, 64, 4, 3),
    64: _PassConfig(64, 128, 4, 3),
    128: _PassConfig(64, 128, 8, 3),
    256: _PassConfig(32, 64, 4, 2),
}
# Pass 2 at D = 128, tuned on the H200 (perf/NOTES.md, "Selective attention"):
# 4 warps instead of 8 leave room for two programs per SM, so one's exponentials overlap the
# other's matmuls. L <= 4096: (128, 64, 4, 3) 0.194 ms vs 0.240; longer: (64, 128, 4, 4)
# 0.625 ms vs 0.871 at 8k and 9.61 ms vs 13.66 at 32k. Two variants, chosen by length.
_GPU_SCORES_CONFIGS_D128_SHORT = _PassConfig(128, 64, 4, 3)
_GPU_SCORES_CONFIGS_D128_LONG = _PassConfig(64, 128, 4, 4)
# The interpreter runs every program in Python: small tiles keep the tiny test shapes fast and
# make them span several blocks, so the masks and block loops are exercised.
_INTERPRETER_CONFIG = _PassConfig(16, 16, 1, 1)


def _default_configs(head_dim: int, device: torch.device, seq_len: int = 0
                     ) -> Tuple[_PassConfig, _PassConfig]:
    """(pass 1 config, pass 2 config) for this head dim, device and sequence length."""
    if device.type != "cuda":
        return _INTERPRETER_CONFIG, _INTERPRETER_CONFIG
    scores = _GPU_SCORES_CONFIGS[head_dim]
    if head_dim == 128:
        scores = _GPU_SCORES_CONFIGS_D128_SHORT if seq_len <= 4096 else _GPU_SCORES_CONFIGS_D128_LONG
    return _GPU_FWD_CONFIGS[head_dim], scores


def _launch_fwd(q: Tensor, k: Tensor, v: Tensor, qk_scale: float, config: _PassConfig
                ) -> Tuple[Tensor, Tensor]:
    """Pass 1: ``(out, lse)``, lse ``(B, H_q, L)`` fp32 in base 2 (see the kernel)."""
    _check_fwd_config(config)
    B, H_q, L, D = q.shape
    out = torch.empty((B, H_q, L, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H_q, L), dtype=torch.float32, device=q.device)
    grid = (B * H_q, triton.cdiv(L, config.block_m))
    _selective_attention_fwd_kernel[grid](
        q, k, v, out, lse,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        L, H_q, H_q // k.shape[1], qk_scale,
        HEAD_DIM=D, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        SCALE_NEGATIVE=qk_scale < 0,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out, lse


def _launch_scores(q: Tensor, k: Tensor, lse: Tensor, qk_scale: float, config: _PassConfig
                   ) -> Tensor:
    """Pass 2: scores ``(B, H_kv, L)`` fp32 from q, k and pass 1's lse."""
    B, H_q, L, D = q.shape
    H_kv = k.shape[1]
    scores = torch.empty((B, H_kv, L), dtype=torch.float32, device=q.device)
    grid = (B * H_kv, triton.cdiv(L, config.block_n))
    _selective_attention_scores_kernel[grid](
        q, k, lse, scores,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        L, H_q, H_kv, H_q // H_kv, qk_scale,
        HEAD_DIM=D, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return scores


def _selective_attention_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    fwd_config: Optional[_PassConfig] = None,
    scores_config: Optional[_PassConfig] = None,
    *,
    fwd_only: bool = False,
) -> Tuple[Tensor, Tensor]:
    """Run both Triton passes. Same contract as ``selective_attention`` (scale already resolved).

    ``fwd_config`` / ``scores_config`` override the default block configuration of pass 1 /
    pass 2 independently. ``fwd_only=True`` (``causal_attention``) runs pass 1 alone and returns
    ``(out, lse)`` instead of ``(out, scores)``, lse ``(B, H_q, L)`` fp32 holding the natural
    log-sum-exp of each row times log2(e).

    Works on CUDA tensors, and on CPU tensors when ``TRITON_INTERPRET=1`` was set before triton
    was imported. Inputs are read through their strides; only the head dim must be contiguous
    (a (B, L, H, D) buffer viewed as (B, H, L, D) is used in place).
    """
    default_fwd, default_scores = _default_configs(q.shape[-1], q.device, q.shape[2])
    fwd_config = default_fwd if fwd_config is None else fwd_config
    scores_config = default_scores if scores_config is None else scores_config
    _check_fwd_config(fwd_config)
    # The kernels index the head dim with unit stride; anything else (rare) is copied once.
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    # Folding log2(e) into the scale lets both passes use exp2 (one MUFU op) instead of exp.
    qk_scale = scale * _LOG2E
    out, lse = _launch_fwd(q, k, v, qk_scale, fwd_config)
    if fwd_only:
        return out, lse
    return out, _launch_scores(q, k, lse, qk_scale, scores_config)

# ----------------------------------------------------------------------------------------------
# PyTorch implementations
# ----------------------------------------------------------------------------------------------

def selective_attention_ref(
    q: Tensor, k: Tensor, v: Tensor, scale: Optional[float] = None
) -> Tuple[Tensor, Tensor]:
    """The definition, materialized in fp32: ``(B, H_q, L, L)`` probabilities. Tests only.

    Same signature and outputs as ``selective_attention``: out ``(B, H_q, L, D)`` in q's dtype,
    scores ``(B, H_kv, L)`` fp32.
    """
    B, H_q, L, D = q.shape
    H_kv = k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    group_size = H_q // H_kv
    # Query head i uses KV head i // group_size.
    kf = k.float().repeat_interleave(group_size, dim=1)
    vf = v.float().repeat_interleave(group_size, dim=1)
    s = q.float() @ kf.transpose(-1, -2) * scale
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    p = s.masked_fill(~causal, float("-inf")).softmax(dim=-1)
    out = (p @ vf).to(q.dtype)
    scores = p.sum(dim=2).view(B, H_kv, group_size, L).sum(dim=2)
    return out, scores


# Chunk size of the CPU path: about 2^22 fp32 elements (16 MiB) per (B, H_q, rows, keys) tile,
# but never fewer than 64 rows, below which each chunk's matmuls degrade to re-reading all keys
# for a handful of rows. Measured on 2 cores (L = 4096, 9/3 heads, D = 64, fp32): 64-256 rows
# take 0.24-0.27 s, 455 rows 0.33 s (the tiles fall out of cache); SDPA's fused CPU kernel, which
# returns no scores, 0.12 s.
_CPU_CHUNK_ELEMENTS = 1 << 22
_CPU_MIN_CHUNK_ROWS = 64


def _selective_attention_chunked(
    q: Tensor, k: Tensor, v: Tensor, scale: float, query_chunk: Optional[int] = None
) -> Tuple[Tensor, Tensor]:
    """``selective_attention`` over blocks of ``query_chunk`` query rows, in fp32.

    Memory is ``O(B * H_q * query_chunk * L)``; the default chunk keeps one tile near
    ``_CPU_CHUNK_ELEMENTS`` elements (at least ``_CPU_MIN_CHUNK_ROWS`` rows). Each chunk multiplies
    only against the keys it can see (``[0, chunk end)``), which halves the work of a causal
    prefill.
    """
    B, H_q, L, D = q.shape
    H_kv = k.shape[1]
    group_size = H_q // H_kv
    if query_chunk is None:
        query_chunk = min(L, max(_CPU_MIN_CHUNK_ROWS, _CPU_CHUNK_ELEMENTS // (B * H_q * L)))

    # Grouped views (B, H_kv, G, rows, D) against (B, H_kv, 1, keys, D): broadcasting shares one
    # KV head across its query heads without materializing repeated K/V.
    qf = q.float().reshape(B, H_kv, group_size, L, D)
    kf = k.float().unsqueeze(2)
    vf = v.float().unsqueeze(2)
    out = torch.empty((B, H_kv, group_size, L, D), dtype=q.dtype, device=q.device)
    scores = torch.zeros((B, H_kv, L), dtype=torch.float32, device=q.device)
    for start in range(0, L, query_chunk):
        end = min(start + query_chunk, L)
        # s: (B, H_kv, G, end - start, end); rows start..end-1 see keys 0..end-1.
        s = qf[:, :, :, start:end] @ kf[:, :, :, :end].transpose(-1, -2)
        s.mul_(scale)
        rows = torch.arange(start, end, device=q.device)
        future = rows[:, None] < torch.arange(end, device=q.device)[None, :]
        s.masked_fill_(future, float("-inf"))
        p = s.softmax(dim=-1)
        out[:, :, :, start:end] = p @ vf[:, :, :, :end]
        scores[:, :, :end] += p.sum(dim=(2, 3))
    return out.view(B, H_q, L, D), scores


# ----------------------------------------------------------------------------------------------
# Registered op and public wrapper
# ----------------------------------------------------------------------------------------------

@torch.library.custom_op("minikv::selective_attention", mutates_args=())
def _selective_attention_op(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tuple[Tensor, Tensor]:
    # Default (CPU) implementation: chunked, so prompts of thousands of tokens fit in memory.
    return _selective_attention_chunked(q, k, v, scale)


@_selective_attention_op.register_kernel("cuda")
def _(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tuple[Tensor, Tensor]:
    return _selective_attention_triton(q, k, v, scale)


@_selective_attention_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tuple[Tensor, Tensor]:
    B, H_q, L, D = q.shape
    out = q.new_empty((B, H_q, L, D))
    scores = q.new_empty((B, k.shape[1], L), dtype=torch.float32)
    return out, scores


@torch.library.custom_op("minikv::causal_attention", mutates_args=())
def _causal_attention_op(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    # Default (CPU) implementation.
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1]).contiguous()


@_causal_attention_op.register_kernel("cuda")
def _(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    return _selective_attention_triton(q, k, v, scale, fwd_only=True)[0]


@_causal_attention_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    return q.new_empty(q.shape)


def selective_attention(
    q: Tensor, k: Tensor, v: Tensor, scale: Optional[float] = None
) -> Tuple[Tensor, Tensor]:
    """Causal attention over a prompt plus each key's cumulative attention score.

    Parameters
    ----------
    q : (B, H_q, L, D) fp16 / bf16 (fp32 on CPU only). Any strides; with a unit-stride head
        dim (e.g. a (B, L, H_q, D) projection viewed with ``.transpose(1, 2)``) the CUDA kernels
        read it in place, otherwise they copy it once.
    k, v : (B, H_kv, L, D), q's dtype and device, ``H_q % H_kv == 0``. Keys after RoPE.
        Query head ``i`` attends to KV head ``i // (H_q // H_kv)``.
    scale : softmax scale; default ``1 / sqrt(D)``.

    D must be one of 16, 32, 64, 128, 256; any ``L >= 1``.

    Returns
    -------
    out : (B, H_q, L, D) contiguous, q's dtype: ``softmax(q k^T * scale, causal) v``, what
        ``scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)`` returns.
    scores : (B, H_kv, L) fp32 contiguous: ``scores[b, h, t]`` sums, over the query heads of KV
        group ``h`` and over the rows ``r >= t``, the normalized probability ``P[r, t]``. Each
        row sums to 1, so a KV head's scores add up to ``(H_q // H_kv) * L``.

    On CUDA this runs two Triton launches with ``O(L)`` extra memory (fp32 log-sum-exp and the
    scores) and is deterministic; on CPU a chunked PyTorch implementation with
    ``O(L x chunk)`` memory.
    """
    return _selective_attention_op(q, k, v, _check_inputs(q, k, v, scale))


def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float] = None) -> Tensor:
    """Causal attention over a prompt without scores: ``selective_attention``'s output alone.

    Same inputs as ``selective_attention``; returns out ``(B, H_q, L, D)`` contiguous, q's dtype.

    On CUDA this is pass 1 alone (one Triton launch; its log-sum-exp is dropped). Not SDPA:
    cuDNN's attention is 1.2x faster at 32k on the H100 (14.4 ms against 17.5; both passes 27.3),
    but its first call at a new prompt length builds a plan (62-99 ms), and a server sees a new
    length with nearly every request (perf/NOTES.md, "Prefill attention without scores"). On
    CPU: SDPA.
    """
    return _causal_attention_op(q, k, v, _check_inputs(q, k, v, scale))


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float]) -> float:
    """Validate a prefill attention's inputs; returns the softmax scale."""
    check_tensor("q", q, ndim=4, dtypes=(torch.float16, torch.bfloat16, torch.float32))
    B, H_q, L, D = q.shape
    check_tensor("k", k, ndim=4, dtypes=(q.dtype,), device=q.device)
    H_kv = k.shape[1]
    check_tensor("k", k, shape=(B, None, L, D))
    check_tensor("v", v, shape=(B, H_kv, L, D), dtypes=(q.dtype,), device=q.device)
    if q.device.type == "cuda" and q.dtype == torch.float32:
        raise ValueError(
            "q: expected dtype in ['torch.float16', 'torch.bfloat16'] on CUDA, got torch.float32"
        )
    if H_kv == 0 or H_q % H_kv != 0:
        raise ValueError(f"k: expected a number of KV heads dividing H_q={H_q}, got {H_kv}")
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"q: expected head dim in {SUPPORTED_HEAD_DIMS}, got {D}")
    if L == 0 or B == 0:
        raise ValueError(f"q: expected a non-empty batch and sequence, got shape {tuple(q.shape)}")
    return 1.0 / math.sqrt(D) if scale is None else float(scale)
