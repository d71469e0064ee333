"""A linear layer for the few rows of a decode step, with the RMSNorm before it and the residual
add, the RoPE of q and k or the SiLU-gate after it fused in.

``fused_linear(x, weight, bias, rms_weight=..., residual=..., rope_cos=..., glu_out=...)``
computes, for ``x (M, K)`` and ``weight (N, K)``::

    a = x                                                          (no prologue)
    a = rms_weight * (x.float() * rsqrt(mean(x.float() ** 2) + eps)).to(x.dtype)   (RMSNorm)
    y = (a @ weight.T + bias).to(x.dtype)
    y = (x @ weight.T * rsqrt(sum(rms_sumsq) / K + eps) + bias).to(x.dtype)   (prescaled)
    then at most one of
    y = y + residual                                    (in x's dtype)
    y[:, :R] = rope(y[:, :R], cos, sin)                 (the q and k heads)
    y = silu(y[:, :N/2]) * y[:, N/2:]                   (glu_out: weight is [gate; up])

with the roundings of the HF modules it replaces (``LlamaRMSNorm``, ``nn.Linear``,
``act_fn(gate) * up`` with SiLU, ``h + ...``): each intermediate the module chain would hold in
the model dtype is rounded to it here too. Only the sum over K runs in another order (fp32
accumulation over tiles), so results match the module chain to the last bit of the model
dtype, not exactly (the "prescaled" split of the norm moves its roundings, see below).
``rope`` rotates each head of ``D = cos.shape[1]`` columns the way HF's
Llama does (``y * cos + rotate_half(y) * sin``, halves ``[0, D/2)`` and ``[D/2, D)``), in fp32
from the rounded ``y``, rounded once, as the compiled decode step computes it.

Why. At decode time a linear layer of an LLM is a GEMV: it reads its weights once and does two
FLOPs per weight. The Llama-3.1-8B decode step at batch 1 had 15 kernels per layer with cuBLAS;
the RMSNorms, the SiLU-gate and cuBLAS's split-K reductions were five of them, each ~1-2 us of
launch and latency for a few KB of data. Here each program reads the whole (tiny) input row
itself, so the norm costs no launch; the residual add is the last store. Epilogues that need
two output columns together take them into one program: a program that rotates takes the rows
``j`` and ``j + D/2`` of one head, one that gates takes the gate row ``j`` and the up row
``N/2 + j`` (its columns are two half-blocks, not one block).

Kernel: one program per ``BLOCK_N`` weight rows and ``BLOCK_M`` rows of x, the whole K in a
loop (no split-K, so no reduction launch and no atomics). The weight tile is the only large
stream. One row: FMA, the next weight tile prefetched into registers. Several rows: tensor-core
tiles of 16 or 32 (padded) rows, staged through shared memory by the compiler's pipeline, the
first weight columns asked into L2 before the PDL wait. There a norm inside costs every program
a pass over every K tile of those rows, so the norm is split over two launches instead: the launch
that writes h also writes ``norm_weight * h`` and the sums of squares of h's rows over its
column blocks (``norm_out``), and the projection reads those as its input (``rms_sumsq``,
prologue "prescaled"), multiplying its fp32 product by the 1 / RMS before the bias: the main
loop stays a plain GEMM from the pipelined shared memory. Or ``rms_norm`` runs the prologue as a
launch of its own (see the adapter's ``_norm_prologue``).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import _gdc as gdc
from ._checks import FLOAT_DTYPES, check_choice, check_tensor

# The kernel's PROLOGUE is the index in this tuple. "prescaled": x is already the norm's weight
# times the rows h it normalizes (``norm_out``'s ``y_scaled``), and the 1 / RMS of h, from the
# partial sums of squares ``rms_sumsq``, scales the product instead of the input.
PROLOGUES = ("none", "rmsnorm", "prescaled")
MAX_SUMS = 4096  # partial sums of squares per row that a "prescaled" launch takes
# ``launch_config``'s keys, in the order of a ``launch`` tensor (``launch_tensor``). A tensor, not
# ints: a compiled step passes it as an input, so one compiled graph serves every bucket of a
# plan (ints would be baked into it: one compile per bucket).
LAUNCH_KEYS = ("USE_DOT", "BLOCK_M", "BLOCK_N", "BLOCK_K", "NUM_STAGES", "num_warps", "K_PREFETCH")


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def _load_weights(w_ptr, cols, n_ok, k, K, stride_wn):
    """The (BLOCK_N, BLOCK_K) weight tile at columns ``k`` (zeros past K)."""
    return tl.load(w_ptr + cols[:, None] * stride_wn + k[None, :],
                   mask=n_ok[:, None] & (k < K)[None, :], other=0.0)


@triton.jit
def _load_input(x_ptr, nw_ptr, rows, m_ok, k, k_ok, stride_xm, rstd, PROLOGUE: tl.constexpr):
    """The (BLOCK_M, BLOCK_K) tile of ``a`` (see the module docstring) in x's dtype."""
    offs = rows[:, None] * stride_xm + k[None, :]
    mask = m_ok[:, None] & k_ok[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if PROLOGUE == 1:
        nw = tl.load(nw_ptr + k, mask=k_ok, other=0.0)
        x = nw[None, :] * (x.to(tl.float32) * rstd[:, None]).to(x.dtype)
    return x


@triton.jit
def _halves(y):
    """(BLOCK_M, 2 * HALF) -> its columns [0, HALF) and [HALF, 2 * HALF), each (BLOCK_M, HALF)."""
    BLOCK_M: tl.constexpr = y.shape[0]
    HALF: tl.constexpr = y.shape[1] // 2
    return tl.split(tl.permute(tl.reshape(y, (BLOCK_M, 2, HALF)), (0, 2, 1)))


@triton.jit
def _rope(y, c, s, offs_n, HALF: tl.constexpr):
    """Rotate a (BLOCK_M, 2 * HALF) tile whose columns are [j .. j+HALF) and their partners
    [j + D/2 ..): ``y * cos - partner * sin`` on the first half, ``+`` on the second. c, s: the
    cos and sin of each element's row and column (``_epilogue_operands``)."""
    BLOCK_M: tl.constexpr = y.shape[0]
    yf = y.to(tl.float32)
    first, second = _halves(yf)
    partner = tl.reshape(tl.permute(tl.join(second, first), (0, 2, 1)), (BLOCK_M, 2 * HALF))
    sign = tl.where(offs_n < HALF, -1.0, 1.0)[None, :]
    return (yf * c.to(tl.float32) + sign * partner * s.to(tl.float32)).to(y.dtype)


@triton.jit
def _epilogue_operands(b_ptr, cos_ptr, sin_ptr, r_ptr, g_ptr, rows, cols, m_ok, n_ok, stride_cm,
                       stride_rm, HAS_BIAS: tl.constexpr, ROPE: tl.constexpr,
                       HEAD_DIM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                       NORM_OUT: tl.constexpr):
    """What the epilogue reads besides the product: bias, cos and sin, residual, the next norm's
    weight (0.0 for those a launch has not; every program of a RoPE launch loads cos and sin,
    the few that do not rotate included). The tensor-core path loads them after the PDL wait and
    before the main loop, so that their round trip to L2 hides under the weight stream instead of
    following it: its launches are one wave of one program per SM, and a load after the loop is
    on the launch's tail (o and down at 8 rows: 0.3-0.4 us faster on the H200)."""
    mask = m_ok[:, None] & n_ok[None, :]
    bias = 0.0
    c = 0.0
    s = 0.0
    r = 0.0
    g = 0.0
    if HAS_BIAS:
        bias = tl.load(b_ptr + cols, mask=n_ok, other=0.0)
    if ROPE:
        d = rows[:, None] * stride_cm + (cols % HEAD_DIM)[None, :]
        c = tl.load(cos_ptr + d, mask=mask, other=0.0)
        s = tl.load(sin_ptr + d, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0)
    if NORM_OUT:
        g = tl.load(g_ptr + cols, mask=n_ok, other=0.0)
    return bias, c, s, r, g


@triton.jit
def _rstd(x_ptr, rows, m_ok, K, stride_xm, eps, BLOCK_K: tl.constexpr):
    """1 / RMS of each row of x, in fp32 (every program reads its rows whole, from L2)."""
    BLOCK_M: tl.constexpr = rows.shape[0]
    kk = tl.arange(0, BLOCK_K)
    sq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        xs = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :],
                     mask=m_ok[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
        sq += xs * xs
    return 1.0 / tl.sqrt(tl.sum(sq, axis=1) / K + eps)


@triton.jit
def _prefetch_l2(w_ptr, cols, n_ok, K, stride_wn, K_PREFETCH: tl.constexpr, LINE: tl.constexpr):
    """Ask L2 for columns [0, K_PREFETCH) of this program's weight rows, one prefetch per
    line of LINE elements (128 bytes), without waiting for them. The weights are never written
    during a step, so this may run before the PDL wait: the lines stream from HBM while the
    kernel before finishes, and the main loop then finds them in L2."""
    k = tl.minimum(tl.arange(0, K_PREFETCH // LINE) * LINE, K - 1)
    ptrs = w_ptr + tl.where(n_ok, cols, 0)[:, None] * stride_wn + k[None, :]
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _rstd_of_sums(ss_ptr, rows, m_ok, P, stride_sm, K, eps, BLOCK_P: tl.constexpr):
    """1 / RMS of each row from its ``P`` partial sums of squares (one load, from L2)."""
    p = tl.arange(0, BLOCK_P)
    ss = tl.load(ss_ptr + rows[:, None] * stride_sm + p[None, :],
                 mask=m_ok[:, None] & (p < P)[None, :], other=0.0)
    return 1.0 / tl.sqrt(tl.sum(ss, axis=1) / K + eps)


@triton.jit
def _wait_then_rstd(x_ptr, ss_ptr, rows, m_ok, K, P, stride_xm, stride_sm, eps,
                    PROLOGUE: tl.constexpr, PDL: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_P: tl.constexpr):
    """Let the next kernel launch and wait for the one that wrote x (PDL), then the RMSNorm's
    1 / RMS of the rows: from x itself ("rmsnorm"), from the partial sums of squares
    ("prescaled"), zeros without a norm."""
    gdc.launch_dependents_then_wait(PDL)
    rstd = tl.zeros([rows.shape[0]], dtype=tl.float32)
    if PROLOGUE == 1:
        rstd = _rstd(x_ptr, rows, m_ok, K, stride_xm, eps, BLOCK_K)
    if PROLOGUE == 2:
        rstd = _rstd_of_sums(ss_ptr, rows, m_ok, P, stride_sm, K, eps, BLOCK_P)
    return rstd


@triton.jit
def _fused_linear_kernel(
    x_ptr, w_ptr, b_ptr, nw_ptr, r_ptr, cos_ptr, sin_ptr, ss_ptr, g_ptr, y_ptr, ys_ptr, so_ptr,
    M, N, K, P, eps, ROPE_ROWS,
    stride_xm, stride_wn, stride_rm, stride_cm, stride_sm, stride_ym, stride_ysm, stride_som,
    PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    ROPE: tl.constexpr, HEAD_DIM: tl.constexpr, GLU_OUT: tl.constexpr, NORM_OUT: tl.constexpr,
    USE_DOT: tl.constexpr, FP32_DOT: tl.constexpr, PDL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr, NUM_STAGES: tl.constexpr, K_PREFETCH: tl.constexpr, LINE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    cols = pid_n * BLOCK_N + offs_n
    HALF: tl.constexpr = BLOCK_N // 2
    n_ok = cols < N
    rotate = False
    if ROPE:  # programs [0, ROPE_ROWS / BLOCK_N): rows j0 + [0, HALF) and j0 + D/2 + [0, HALF)
        per_head: tl.constexpr = HEAD_DIM // BLOCK_N
        rotate = pid_n * BLOCK_N < ROPE_ROWS
        j0 = (pid_n // per_head) * HEAD_DIM + (pid_n % per_head) * HALF
        pairs = j0 + offs_n % HALF + (offs_n // HALF) * (HEAD_DIM // 2)
        cols = tl.where(rotate, pairs, cols)
        n_ok = cols < N
    if GLU_OUT:  # output columns j0 + [0, HALF): gate rows j0 + [0, HALF), up rows N/2 + ...
        j = pid_n * HALF + offs_n % HALF
        cols = j + (offs_n // HALF) * (N // 2)
        n_ok = j < N // 2
    m_ok = rows < M
    kk = tl.arange(0, BLOCK_K)

    if USE_DOT:  # tensor-core tiles, loads pipelined over NUM_STAGES by the compiler
        if PDL and K_PREFETCH > 0:  # the first tiles toward L2 before the wait
            _prefetch_l2(w_ptr, cols, n_ok, K, stride_wn, K_PREFETCH, LINE)
        rstd = _wait_then_rstd(x_ptr, ss_ptr, rows, m_ok, K, P, stride_xm, stride_sm, eps,
                               PROLOGUE, PDL, BLOCK_K, BLOCK_P)
        bias, c, s, r, g = _epilogue_operands(b_ptr, cos_ptr, sin_ptr, r_ptr, g_ptr, rows, cols,
                                              m_ok, n_ok, stride_cm, stride_rm, HAS_BIAS,
                                              ROPE, HEAD_DIM, HAS_RESIDUAL, NORM_OUT)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            k = k0 + kk
            a = _load_input(x_ptr, nw_ptr, rows, m_ok, k, k < K, stride_xm, rstd, PROLOGUE)
            w = _load_weights(w_ptr, cols, n_ok, k, K, stride_wn)
            if FP32_DOT:
                acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(w), acc)
    else:  # BLOCK_M == 1: FMA, the next weight tile in flight while this one is used
        # The weights are never written during a step: the first tile loads before waiting for
        # the kernel that produced x (PDL), so it streams during that kernel's last wave.
        w = _load_weights(w_ptr, cols, n_ok, kk, K, stride_wn)
        rstd = _wait_then_rstd(x_ptr, ss_ptr, rows, m_ok, K, P, stride_xm, stride_sm, eps,
                               PROLOGUE, PDL, BLOCK_K, BLOCK_P)
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # summed over K after the loop
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            k = k0 + kk
            a = _load_input(x_ptr, nw_ptr, rows, m_ok, k, k < K, stride_xm, rstd, PROLOGUE)
            w_next = _load_weights(w_ptr, cols, n_ok, k + BLOCK_K, K, stride_wn)
            acc2 += w.to(tl.float32) * a.to(tl.float32)                  # a is (1, BLOCK_K)
            w = w_next
        acc = tl.reshape(tl.sum(acc2, axis=1), (BLOCK_M, BLOCK_N))
        # After the loop here: its launches run many short programs per SM, whose tails hide
        # under each other's loops; before it, q/k/v took 18.5 us instead of 17.2 on the H200.
        bias, c, s, r, g = _epilogue_operands(b_ptr, cos_ptr, sin_ptr, r_ptr, g_ptr, rows, cols,
                                              m_ok, n_ok, stride_cm, stride_rm, HAS_BIAS,
                                              ROPE, HEAD_DIM, HAS_RESIDUAL, NORM_OUT)

    if PROLOGUE == 2:  # x was the norm's weight times h: the norm's 1 / RMS scales the product
        acc = acc * rstd[:, None]
    if HAS_BIAS:
        acc += bias.to(tl.float32)[None, :]
    y = acc.to(y_ptr.dtype.element_ty)
    if GLU_OUT:  # silu(gate) * up, each rounded as the module chain rounds it
        gate, up = _halves(y)
        g = gate.to(tl.float32)
        y = (g / (1.0 + tl.exp(-g))).to(y.dtype) * up
        out = pid_n * HALF + tl.arange(0, HALF)
        tl.store(y_ptr + rows[:, None] * stride_ym + out[None, :], y,
                 mask=m_ok[:, None] & (out < N // 2)[None, :])
    else:
        mask = m_ok[:, None] & n_ok[None, :]
        if ROPE:
            if rotate:
                y = _rope(y, c, s, offs_n, HALF)
        if HAS_RESIDUAL:
            y = (y.to(tl.float32) + r.to(tl.float32)).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], y, mask=mask)
        if NORM_OUT:  # what the next RMSNorm needs of y: y * its weight, and y's squares summed
            yf = tl.where(mask, y.to(tl.float32), 0.0)
            tl.store(ys_ptr + rows[:, None] * stride_ysm + cols[None, :],
                     (g.to(tl.float32)[None, :] * yf).to(y.dtype), mask=mask)
            tl.store(so_ptr + rows * stride_som + pid_n, tl.sum(yf * yf, axis=1), mask=m_ok)


@triton.jit
def _rms_norm_kernel(x_ptr, nw_ptr, y_ptr, K, eps, stride_xm, stride_ym,
                     PDL: tl.constexpr, BLOCK_K: tl.constexpr):
    # The fused_linear prologue on its own: one row per program, the same roundings.
    rows = tl.program_id(0) + tl.arange(0, 1)
    m_ok = rows >= 0  # one row, in range by construction of the grid
    rstd = _wait_then_rstd(x_ptr, x_ptr, rows, m_ok, K, 1, stride_xm, 0, eps, 1, PDL, BLOCK_K, 1)
    kk = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        k_ok = k < K
        a = _load_input(x_ptr, nw_ptr, rows, m_ok, k, k_ok, stride_xm, rstd, 1)
        tl.store(y_ptr + rows[:, None] * stride_ym + k[None, :], a,
                 mask=m_ok[:, None] & k_ok[None, :])


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's ``LlamaRMSNorm`` over the last dim (the CPU implementation of ``rms_norm``)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     rms_weight: Optional[torch.Tensor], residual: Optional[torch.Tensor],
                     rope_cos: Optional[torch.Tensor], rope_sin: Optional[torch.Tensor],
                     rope_rows: int, prologue: str, eps: float,
                     glu_out: bool = False,
                     rms_sumsq: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The module chain in plain PyTorch (what the kernel computes; the CPU implementation)."""
    _check_prologue(prologue, rms_weight, rms_sumsq)
    if prologue == "prescaled":  # the product in fp32, then 1 / RMS, bias, one rounding
        rstd = torch.rsqrt(rms_sumsq.sum(-1, keepdim=True) / x.shape[1] + eps)
        y = F.linear(x.float(), weight.float()) * rstd
        y = (y + bias.float() if bias is not None else y).to(x.dtype)
    else:
        a = rms_norm_ref(x, rms_weight, eps) if prologue == "rmsnorm" else x
        y = F.linear(a, weight, bias)
    if glu_out:
        gate, up = y.chunk(2, dim=-1)
        return F.silu(gate) * up
    if residual is not None:
        return y + residual
    if rope_cos is not None:
        M, D = rope_cos.shape
        heads = y[:, :rope_rows].view(M, -1, D)
        half = D // 2
        rotated = torch.cat((-heads[..., half:], heads[..., :half]), dim=-1)
        heads = heads * rope_cos[:, None] + rotated * rope_sin[:, None]
        y = torch.cat((heads.reshape(M, rope_rows), y[:, rope_rows:]), dim=1)
    return y


def norm_out_blocks(M: int, N: int, K: int, dtype: torch.dtype) -> tuple[int, int]:
    """``(P, width)``: ``fused_linear(norm_out=...)`` sums the squares of each output row over
    ``P`` blocks of ``width`` columns (the launch's ``BLOCK_N``: one sum per program)."""
    width = _block_n(M > 1, N, dtype)
    return triton.cdiv(N, width), width


def fused_linear_norm_out_ref(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                              residual: Optional[torch.Tensor], norm_weight: torch.Tensor
                              ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``y = [residual +] linear(x, weight, bias)``, ``norm_weight * y`` (rounded as HF's RMSNorm
    rounds that product) and the sums of ``y.float() ** 2`` over the column blocks of
    ``norm_out_blocks`` (the CPU implementation)."""
    y = fused_linear_ref(x, weight, bias, None, residual, None, None, 0, "none", 0.0)
    M, N = y.shape
    P, width = norm_out_blocks(M, N, x.shape[1], x.dtype)
    sq = F.pad(y.float() ** 2, (0, P * width - N))
    return y, norm_weight * y, sq.view(M, P, width).sum(-1)


# ----------------------------------------------------------------------------------------------
# Launch
# ----------------------------------------------------------------------------------------------


def _block_n(several: bool, N: int, dtype: torch.dtype) -> int:
    """A launch's ``BLOCK_N`` (weight rows per program, ``launch_config``'s rule). It depends on
    x's rows only as one or several, so ``norm_out_blocks`` sizes the norm's column blocks from
    a compiled step's symbolic batch without a guard on its size (an ``M <= 16`` guard had
    compiled the step's layer again for bucket 32)."""
    if not several:
        return 4
    return 32 if dtype == torch.float32 or N <= 4096 else 64


def launch_config(M: int, N: int, K: int, dtype: torch.dtype) -> dict:
    """Block sizes, stages, warps, the inner product and the L2 prefetch of a launch.

    One row (the decode step at batch 1): FMA over (4 x BLOCK_K) weight tiles, the next one in
    flight while this one is used, the products summed over K once after the loop. BLOCK_K 1024
    for K = 4096 (q/k/v, o, gate/up), 512 for K = 14336 (down): the best or within 5% of it of
    12 configurations per Llama-3.1-8B layer on the H200.

    Several rows: tensor-core tiles of 16 (padded) rows, 32 from 17 rows on (one program reads
    its weight rows once for all of them), the weight tiles staged through shared memory by the
    compiler; bytes in flight per program, against programs enough to cover the SMs, decide the
    tile. On the H200 at 8 rows: 32 x 512 over 4 stages for N <= 4096 (o 12.3 us,
    down 31.7 us), 64 x 256 x 4 up to N = 8192 (q/k/v 18.2 us; 32 x 256: 20.5 us), and above
    that (gate/up, more than one wave of programs) 64 x 256 x 3, two programs per SM: the decode
    step at 8 x 4k 4.581 ms against 4.619 with 128 x 128 x 4. Where every program is resident
    from the start (N <= 8192) the first 512 columns of each program's weight rows are asked into
    L2 before the PDL wait (``_prefetch_l2``): 0.4-0.5 us off o and down at 8 rows (slower on
    gate/up, and at one row, whose first tile already loads before the wait). Every launch is a
    PDL one. ``perf/NOTES.md``, "Several rows", has the sweeps and A/Bs behind each choice.
    """
    block_n = _block_n(M > 1, N, dtype)
    if M == 1:
        block_k = 1024 if K <= 8192 else 512
        return dict(USE_DOT=False, BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=1,
                    num_warps=4, K_PREFETCH=0)
    if dtype == torch.float32:
        return dict(USE_DOT=True, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=32, NUM_STAGES=2,
                    num_warps=4, K_PREFETCH=0)
    block_k, stages, prefetch = ((512, 4, 512) if N <= 4096 else
                                 (256, 4, 512) if N <= 8192 else (256, 3, 0))
    block_m = 16 if M <= 16 else 32
    if block_m == 32 and N <= 4096:  # the measured 32-row plan (fused_rows.py); 4 is untried
        stages = 3
    return dict(USE_DOT=True, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                NUM_STAGES=stages, num_warps=4, K_PREFETCH=prefetch)


def launch_tensor(config: dict) -> torch.Tensor:
    """A launch decided ahead of the call (``launch_config``'s dict) as ``fused_linear``'s
    ``launch``: its values in ``LAUNCH_KEYS`` order, a CPU int64 tensor."""
    return torch.tensor([int(config[k]) for k in LAUNCH_KEYS], dtype=torch.int64)


def _fused_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         rms_weight: Optional[torch.Tensor], residual: Optional[torch.Tensor],
                         rope_cos: Optional[torch.Tensor], rope_sin: Optional[torch.Tensor],
                         rope_rows: int, prologue: str, eps: float, glu_out: bool = False,
                         rms_sumsq: Optional[torch.Tensor] = None,
                         launch: Optional[torch.Tensor] = None,
                         norm_out: Optional[torch.Tensor] = None, **override):
    """The launch behind both ops: returns ``y``, or ``(y, y_scaled, sumsq)`` with ``norm_out``.
    ``launch``: the caller's launch (``launch_tensor``), else ``launch_config``'s for these
    shapes; ``override``: keys of it replaced (tests run odd tiles through it)."""
    _check_prologue(prologue, rms_weight, rms_sumsq)
    M = x.shape[0]
    N, K = weight.shape
    y = x.new_empty(M, N // 2 if glu_out else N)
    if launch is None:
        cfg = launch_config(M, N, K, x.dtype)
    else:
        cfg = dict(zip(LAUNCH_KEYS, launch.tolist()))
        cfg["USE_DOT"] = bool(cfg["USE_DOT"])
        width = norm_out_blocks(M, N, K, x.dtype)[1]
        if norm_out is not None and cfg["BLOCK_N"] != width:  # the op's sumsq has that width
            raise ValueError(f"launch: expected BLOCK_N {width} with norm_out "
                             f"(norm_out_blocks), got {cfg['BLOCK_N']}")
    cfg.update(override)
    num_warps = cfg.pop("num_warps")
    pdl = gdc.supported(x.device)
    rope = rope_cos is not None
    head_dim = rope_cos.shape[1] if rope else 2
    if rope:  # a rotating program holds whole pairs: BLOCK_N even and dividing the head dim
        block_n = cfg["BLOCK_N"]
        while head_dim % block_n:
            block_n //= 2
        if cfg["USE_DOT"] and block_n < 16:  # too narrow for tl.dot: one row per program
            cfg.update(launch_config(1, N, K, x.dtype))
            num_warps = cfg.pop("num_warps")
            block_n = min(cfg["BLOCK_N"], block_n)
        cfg["BLOCK_N"] = block_n
    per_program = cfg["BLOCK_N"] // 2 if glu_out else cfg["BLOCK_N"]  # output columns
    grid = (triton.cdiv(y.shape[1], per_program), triton.cdiv(M, cfg["BLOCK_M"]))
    dummy = weight  # any pointer for the operands a launch does not read
    if norm_out is not None:
        y_scaled = torch.empty_like(y)
        sumsq = x.new_empty(M, grid[0], dtype=torch.float32)
    else:
        y_scaled, sumsq = dummy, dummy
    P = rms_sumsq.shape[1] if rms_sumsq is not None else 1
    _fused_linear_kernel[grid](
        x, weight, bias if bias is not None else dummy,
        rms_weight if rms_weight is not None else dummy,
        residual if residual is not None else dummy,
        rope_cos if rope else dummy, rope_sin if rope else dummy,
        rms_sumsq if rms_sumsq is not None else dummy,
        norm_out if norm_out is not None else dummy, y, y_scaled, sumsq,
        M, N, K, P, eps, rope_rows,
        x.stride(0), weight.stride(0),
        residual.stride(0) if residual is not None else 0,
        rope_cos.stride(0) if rope else 0,
        rms_sumsq.stride(0) if rms_sumsq is not None else 0, y.stride(0),
        y_scaled.stride(0) if norm_out is not None else 0,
        sumsq.stride(0) if norm_out is not None else 0,
        PROLOGUE=PROLOGUES.index(prologue), HAS_BIAS=bias is not None, ROPE=rope,
        HEAD_DIM=head_dim, HAS_RESIDUAL=residual is not None, GLU_OUT=glu_out,
        NORM_OUT=norm_out is not None, BLOCK_P=triton.next_power_of_2(P),
        FP32_DOT=x.dtype == torch.float32, PDL=pdl, LINE=128 // weight.element_size(),
        num_warps=num_warps, launch_pdl=pdl, **cfg,
    )
    return (y, y_scaled, sumsq) if norm_out is not None else y


def _fused_linear_norm_out_triton(x, weight, bias, residual, norm_weight, launch=None,
                                  **override):
    return _fused_linear_triton(x, weight, bias, None, residual, None, None, 0, "none", 0.0,
                                launch=launch, norm_out=norm_weight, **override)


def _rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """One program per row, the whole row in one tile up to 4096 columns (8 warps there)."""
    M, K = x.shape
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    block_k = min(triton.next_power_of_2(K), 4096)
    pdl = gdc.supported(x.device)
    _rms_norm_kernel[(M,)](x, weight, y, K, eps, x.stride(0), y.stride(0), PDL=pdl,
                           BLOCK_K=block_k, num_warps=8 if block_k >= 4096 else 4,
                           launch_pdl=pdl)
    return y


# ----------------------------------------------------------------------------------------------
# Registered op: the reference by default (CPU), the Triton kernel on CUDA
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("minikv::fused_linear", mutates_args=())
def _fused_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     rms_weight: Optional[torch.Tensor], residual: Optional[torch.Tensor],
                     rope_cos: Optional[torch.Tensor], rope_sin: Optional[torch.Tensor],
                     rope_rows: int, prologue: str, eps: float,
                     glu_out: bool = False,
                     rms_sumsq: Optional[torch.Tensor] = None,
                     launch: Optional[torch.Tensor] = None) -> torch.Tensor:
    return fused_linear_ref(x, weight, bias, rms_weight, residual, rope_cos, rope_sin, rope_rows,
                            prologue, eps, glu_out, rms_sumsq)


@_fused_linear_op.register_fake
def _(x, weight, bias, rms_weight, residual, rope_cos, rope_sin, rope_rows, prologue, eps,
      glu_out=False, rms_sumsq=None, launch=None):
    return x.new_empty(x.shape[0], weight.shape[0] // 2 if glu_out else weight.shape[0])


_fused_linear_op.register_kernel("cuda")(_fused_linear_triton)


@torch.library.custom_op("minikv::fused_linear_norm_out", mutates_args=())
def _fused_linear_norm_out_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                              residual: Optional[torch.Tensor], norm_weight: torch.Tensor,
                              launch: Optional[torch.Tensor] = None
                              ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return fused_linear_norm_out_ref(x, weight, bias, residual, norm_weight)


@_fused_linear_norm_out_op.register_fake
def _(x, weight, bias, residual, norm_weight, launch=None):
    (M, K), N = x.shape, weight.shape[0]
    P, _ = norm_out_blocks(M, N, K, x.dtype)
    return x.new_empty(M, N), x.new_empty(M, N), x.new_empty(M, P, dtype=torch.float32)


_fused_linear_norm_out_op.register_kernel("cuda")(_fused_linear_norm_out_triton)


@torch.library.custom_op("minikv::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_ref(x, weight, eps)


@_rms_norm_op.register_fake
def _(x, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


_rms_norm_op.register_kernel("cuda")(_rms_norm_triton)


# ----------------------------------------------------------------------------------------------
# Public wrapper
# ----------------------------------------------------------------------------------------------


def fused_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                 rms_weight: Optional[torch.Tensor] = None,
                 rms_sumsq: Optional[torch.Tensor] = None, eps: float = 1e-6,
                 residual: Optional[torch.Tensor] = None,
                 rope_cos: Optional[torch.Tensor] = None, rope_sin: Optional[torch.Tensor] = None,
                 rope_rows: int = 0, glu_out: bool = False,
                 norm_out: Optional[torch.Tensor] = None, launch: Optional[torch.Tensor] = None):
    """``[residual +] linear(prologue(x), weight, bias)``, or its first ``rope_rows`` columns
    rotated, or ``silu(gate) * up`` of its two halves, in one launch (module docstring).

    An RMSNorm between two projections can also be split over them, so that it costs no launch
    of its own at several rows: the first projection (``norm_out=`` the norm's weight) returns,
    beside its output ``h``, ``norm_weight * h`` and partial sums of ``h ** 2``; the second takes
    those as ``x`` and ``rms_sumsq`` and scales its product by the 1 / RMS of h. That is the
    norm's math with its roundings moved: ``rms_weight * round(h / rms(h))`` becomes
    ``round(rms_weight * h) / rms(h)``, each one rounding of the model dtype from the exact value.

    Args:
        x: ``(M, K)`` fp16/bf16/fp32, unit stride along the last dim.
        weight: ``(N, K)`` in x's dtype and device, unit stride along K (an ``nn.Linear``
            weight).
        bias: ``(N,)`` or None.
        rms_weight: ``(K,)``: apply RMSNorm with this weight and ``eps`` to x first.
        rms_sumsq: ``(M, P)`` fp32, the sums of squares of the rows of the ``h`` that ``x`` was
            made from, in any ``1 <= P <= MAX_SUMS`` blocks (``norm_out``'s third output): ``x``
            is ``norm_weight * h`` and the product is scaled by ``rsqrt(sum / K + eps)`` before
            the bias (not with ``rms_weight``). ``norm_weight * h`` is rounded to the model
            dtype before the norm divides it: in fp16 it must stay under 65504 (HF's order,
            divide first, has no such bound), so fp16 models may prefer ``rms_norm``.
        residual: ``(M, N)`` added to the output (unit stride along N).
        rope_cos, rope_sin: ``(M, D)`` (row ``m``'s position), unit stride along D, D even:
            rotate output columns ``[0, rope_rows)`` as heads of D (not with ``residual``).
        rope_rows: a positive multiple of D, at most N, when rope_cos is given.
        glu_out: the weight is [gate; up] (N even): return ``silu(y[:, :N/2]) * y[:, N/2:]``
            (no residual, no RoPE).
        norm_out: ``(N,)``, the weight of the RMSNorm that the output goes through next: also
            return what ``rms_sumsq`` needs (no prologue, RoPE or ``glu_out``).
        launch: the launch decided ahead (a decode step's plan): ``launch_tensor`` of a
            ``launch_config``-like dict, ``(7,)`` int64 on the CPU; None: ``launch_config`` of
            this call's shapes. With ``norm_out`` its ``BLOCK_N`` must be ``norm_out_blocks``'s
            width. The CPU reference ignores it.

    Returns:
        ``y (M, N)`` (``(M, N / 2)`` with ``glu_out``) in x's dtype, contiguous; with
        ``norm_out``, ``(y, norm_out * y, sumsq)``: ``sumsq (M, P)`` fp32 sums ``y ** 2`` over
        ``P`` blocks of columns (``norm_out_blocks``).

    Raises:
        ValueError: inconsistent shapes, dtypes or devices, more than one of RoPE, residual
            and ``glu_out``, ``norm_out`` / ``rms_sumsq`` with what they exclude, or more sums
            per row than ``MAX_SUMS``.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    dev, dt = x.device, x.dtype
    check_tensor("weight", weight, ndim=2, dtypes=(dt,), device=dev)
    if launch is not None:
        check_tensor("launch", launch, shape=(len(LAUNCH_KEYS),), dtypes=(torch.int64,),
                     device=torch.device("cpu"))
    N, K = weight.shape
    check_tensor("x", x, shape=(None, K))
    M = x.shape[0]
    if M == 0 or N == 0 or K == 0:
        raise ValueError(f"expected non-empty x and weight, got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    _check_unit_last_stride("x", x)
    _check_unit_last_stride("weight", weight)
    if bias is not None:
        check_tensor("bias", bias, shape=(N,), dtypes=(dt,), device=dev, contiguous=True)
    if rms_weight is not None:
        check_tensor("rms_weight", rms_weight, shape=(K,), dtypes=(dt,), device=dev,
                     contiguous=True)
    if rms_sumsq is not None:
        if rms_weight is not None:
            raise ValueError("expected rms_weight (a norm of x) or rms_sumsq (x already "
                             "scaled by the norm's weight), got both")
        check_tensor("rms_sumsq", rms_sumsq, ndim=2, dtypes=(torch.float32,), device=dev)
        check_tensor("rms_sumsq", rms_sumsq, shape=(M, None))
        _check_unit_last_stride("rms_sumsq", rms_sumsq)
        if not 1 <= rms_sumsq.shape[1] <= MAX_SUMS:  # each program loads a row's sums at once
            raise ValueError(f"rms_sumsq: expected 1 to {MAX_SUMS} sums per row, got "
                             f"{rms_sumsq.shape[1]}")
    if residual is not None:
        check_tensor("residual", residual, shape=(M, N), dtypes=(dt,), device=dev)
        _check_unit_last_stride("residual", residual)
    _check_rope(rope_cos, rope_sin, rope_rows, residual, M, N, dt, dev)
    if glu_out:
        if residual is not None or rope_cos is not None:
            raise ValueError("expected glu_out without a residual or RoPE, got "
                             + ("a residual" if residual is not None else "RoPE"))
        if N % 2:
            raise ValueError(f"weight: expected an even number of rows ([gate; up]) with "
                             f"glu_out, got {N}")
    if norm_out is not None:
        given = [name for name, t in (("rms_weight", rms_weight), ("rms_sumsq", rms_sumsq),
                                      ("RoPE", rope_cos)) if t is not None]
        given += ["glu_out"] if glu_out else []
        if given:
            raise ValueError(f"expected norm_out without a prologue, RoPE or glu_out, got "
                             f"{', '.join(given)}")
        check_tensor("norm_out", norm_out, shape=(N,), dtypes=(dt,), device=dev, contiguous=True)
        P, width = norm_out_blocks(M, N, K, dt)
        if P > MAX_SUMS:
            raise ValueError(f"norm_out: expected at most {MAX_SUMS} column blocks of sums per "
                             f"row (what a prescaled launch takes), got {P} ({N} columns in "
                             f"blocks of {width})")
        return torch.ops.minikv.fused_linear_norm_out(x, weight, bias, residual, norm_out,
                                                      launch)
    prologue = ("rmsnorm" if rms_weight is not None else
                "prescaled" if rms_sumsq is not None else "none")
    return torch.ops.minikv.fused_linear(x, weight, bias, rms_weight, residual, rope_cos,
                                         rope_sin, int(rope_rows), prologue, float(eps),
                                         bool(glu_out), rms_sumsq, launch)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """HF's ``LlamaRMSNorm`` of the rows of ``x``: what ``fused_linear(rms_weight=...)`` does in
    front of its projection, as a launch of its own for steps of several rows (module
    docstring). The launch takes part in PDL, so the projection after it starts (and prefetches
    its weights) while it runs.

    Args:
        x: ``(M, K)`` fp16/bf16/fp32, unit stride along the last dim.
        weight: ``(K,)`` in x's dtype and device.

    Returns:
        ``(M, K)`` in x's dtype, contiguous.

    Raises:
        ValueError: inconsistent shapes, dtypes or devices, or an empty x.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    if x.numel() == 0:
        raise ValueError(f"x: expected a non-empty tensor, got shape {tuple(x.shape)}")
    _check_unit_last_stride("x", x)
    check_tensor("weight", weight, shape=(x.shape[1],), dtypes=(x.dtype,), device=x.device,
                 contiguous=True)
    return torch.ops.minikv.rms_norm(x, weight, float(eps))


def _check_prologue(prologue: str, rms_weight, rms_sumsq) -> None:
    """The op's ``prologue`` names the operand it reads: "rmsnorm" ``rms_weight``, "prescaled"
    ``rms_sumsq``, "none" neither (the public wrapper derives it; the op may be called as is)."""
    check_choice("prologue", prologue, PROLOGUES)
    given = tuple(name for name, t in (("rms_weight", rms_weight), ("rms_sumsq", rms_sumsq))
                  if t is not None)
    want = {"none": (), "rmsnorm": ("rms_weight",), "prescaled": ("rms_sumsq",)}[prologue]
    if given != want:
        raise ValueError(f"prologue {prologue!r}: expected the operands {list(want)}, got "
                         f"{list(given)}")


def _check_unit_last_stride(name: str, t: torch.Tensor) -> None:
    if t.stride(1) != 1:
        raise ValueError(f"{name}: expected unit stride along the last dim, got strides "
                         f"{t.stride()}")


def _check_rope(cos, sin, rows, residual, M, N, dt, dev) -> None:
    if cos is None and sin is None:
        if rows:
            raise ValueError(f"rope_rows: expected 0 without rope_cos/rope_sin, got {rows}")
        return
    if cos is None or sin is None:
        raise ValueError("expected both rope_cos and rope_sin or neither, got one")
    if residual is not None:
        raise ValueError("expected RoPE or a residual, got both")
    check_tensor("rope_cos", cos, ndim=2, dtypes=(dt,), device=dev)
    D = cos.shape[1]
    check_tensor("rope_cos", cos, shape=(M, D))
    check_tensor("rope_sin", sin, shape=(M, D), dtypes=(dt,), device=dev)
    for name, t in (("rope_cos", cos), ("rope_sin", sin)):
        if t.stride(1) != 1 or t.stride(0) != cos.stride(0):
            raise ValueError(f"{name}: expected unit stride along D (and the same row stride "
                             f"for both), got strides {t.stride()}")
    if D % 2:
        raise ValueError(f"rope_cos: expected an even head dim, got {D}")
    if rows <= 0 or rows % D or rows > N:
        raise ValueError(f"rope_rows: expected a positive multiple of the head dim {D} "
                         f"<= N={N}, got {rows}")
