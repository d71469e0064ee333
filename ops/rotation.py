"""``minikv::hadamard_heads``: every head of a row times the orthonormal Sylvester Hadamard matrix
(the rotation of q and k before the cache quantizes the keys).

One launch for a decode layer's q and k (and the copy of its v), on tensor cores: the +-1 matrix
``S`` (``S[i, j] = (-1)^popcount(i & j)``) is built in registers and exact in fp16/bf16, so
``x @ S`` in the model's dtype with fp32 accumulation has exact products, and the
``1 / sqrt(D)`` is applied in fp32 before the one rounding. Inside a compiled step the rotation
as ``x.float() @ H`` was five launches a layer (casts, cuBLAS GEMMs, a split-K reduce) that also
broke the PDL chain, +2.2 ms on a 6.6 ms step on the Llama-3.1-8B shape at batch 1 (H100);
an fp32 ``tl.dot`` with ``H`` loaded from memory was slower still (``perf/NOTES.md``, "Rotation
before quantizing").
"""
from __future__ import annotations

import numbers
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from . import _gdc as gdc
from ._checks import FLOAT_DTYPES, check_tensor

_BLOCK_R = 16  # head rows per program: tl.dot's smallest M
HEAD_DIMS = (16, 32, 64, 128, 256)


def hadamard_matrix(n: int, device=None) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix (n, n) fp32: entries +-1/sqrt(n), symmetric
    (``[[S, S], [S, -S]]`` from ``S = [1]``, so ``S[i, j] = (-1)^popcount(i & j)``).

    ``n`` must be a power of two (a head dim of 64, 128, 256); other sizes raise ValueError.
    """
    if n < 1 or n & (n - 1):
        raise ValueError(f"rotation='hadamard': expected a head_dim that is a power of two, got {n}")
    H = torch.ones(1, 1, dtype=torch.float64)
    while H.shape[0] < n:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)])
    return (H / n ** 0.5).to(device=device, dtype=torch.float32)


@triton.jit
def _hadamard_heads_kernel(x_ptr, y_ptr, M, K, ROT, stride_xm, inv_sqrt_d,
                           D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_C: tl.constexpr, PDL: tl.constexpr, INTERPRET: tl.constexpr):
    # Rotated part: row r of the (M * ROT / D, D) head view is head r % (ROT / D) of token
    # r // (ROT / D); the output columns in tiles of BLOCK_N (one tile up to D = 128).
    gdc.launch_dependents_then_wait(PDL)
    heads = ROT // D
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, D)
    m, j = (r // heads).to(tl.int64), r % heads
    r_ok = r < M * heads
    x = tl.load(x_ptr + m[:, None] * stride_xm + j[:, None] * D + d[None, :],
                mask=r_ok[:, None], other=0.0)
    for n0 in tl.static_range(0, D, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        p = d[:, None] & n[None, :]  # parity of popcount(i & j), D <= 256: 8 bits
        p ^= p >> 4
        p ^= p >> 2
        p ^= p >> 1
        s = 1 - 2 * (p & 1)
        if INTERPRET or x.dtype == tl.float32:  # (the interpreter's bf16 dot is not one)
            acc = tl.dot(x.to(tl.float32), s.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(x, s.to(x.dtype))  # exact products, fp32 sums
        tl.store(y_ptr + m[:, None] * K + j[:, None] * D + n[None, :],
                 (acc * inv_sqrt_d).to(y_ptr.dtype.element_ty), mask=r_ok[:, None])
    # Copied part: columns [ROT, K) of row program_id, by the first M programs.
    row = tl.program_id(0).to(tl.int64)
    if row < M:
        c = ROT + tl.arange(0, BLOCK_C)
        c_ok = c < K
        tl.store(y_ptr + row * K + c, tl.load(x_ptr + row * stride_xm + c, mask=c_ok),
                 mask=c_ok)


def hadamard_heads_ref(x: torch.Tensor, head_dim: int, rotated: int) -> torch.Tensor:
    """The CPU implementation: ``x[:, :rotated]`` per head times ``hadamard_matrix(head_dim)``
    in fp32, rounded once to x's dtype; the other columns copied."""
    M, K = x.shape
    h = hadamard_matrix(head_dim, device=x.device)
    y = (x[:, :rotated].float().reshape(-1, head_dim) @ h).reshape(M, rotated).to(x.dtype)
    return torch.cat([y, x[:, rotated:]], dim=1)


def _hadamard_heads_triton(x: torch.Tensor, head_dim: int, rotated: int) -> torch.Tensor:
    M, K = x.shape
    y = torch.empty(M, K, dtype=x.dtype, device=x.device)
    rows = M * (rotated // head_dim)
    grid = (max(triton.cdiv(rows, _BLOCK_R), M),)  # a program per row for the copied columns
    pdl = gdc.supported(x.device)
    _hadamard_heads_kernel[grid](x, y, M, K, rotated, x.stride(0), head_dim ** -0.5, D=head_dim,
                                 BLOCK_N=min(head_dim, 128), BLOCK_R=_BLOCK_R,
                                 BLOCK_C=triton.next_power_of_2(max(K - rotated, 16)), PDL=pdl,
                                 INTERPRET=os.environ.get("TRITON_INTERPRET") == "1",
                                 num_warps=4, launch_pdl=pdl)
    return y


@torch.library.custom_op("minikv::hadamard_heads", mutates_args=())
def _hadamard_heads_op(x: torch.Tensor, head_dim: int, rotated: int) -> torch.Tensor:
    return hadamard_heads_ref(x, head_dim, rotated)


@_hadamard_heads_op.register_fake
def _(x, head_dim, rotated):
    return x.new_empty(x.shape)


_hadamard_heads_op.register_kernel("cuda")(_hadamard_heads_triton)


def hadamard_heads(x: torch.Tensor, head_dim: int, rotated: Optional[int] = None) -> torch.Tensor:
    """Multiply every ``head_dim``-column head among the first ``rotated`` columns of each row by
    ``hadamard_matrix(head_dim)``.

    Args:
        x: ``(M, K)`` fp16/bf16/fp32, unit stride along the last dim (a column slice of a
            larger row, like the q and k of a fused [q; k; v] projection, is fine).
        head_dim: ``D`` in {16, 32, 64, 128, 256}.
        rotated: a multiple of ``D`` up to ``K`` (default ``K``); the columns after it are
            copied unchanged.

    Returns:
        ``(M, K)`` in x's dtype, contiguous: ``y[m, i*D:(i+1)*D] = x[m, i*D:(i+1)*D] @ H`` for
        the rotated heads, in fp32 and rounded once to x's dtype (on CUDA the products by the
        +-1 entries are exact and 1/sqrt(D) is applied to the sum; the CPU multiplies by the
        fp32 H).

    Raises:
        ValueError: inconsistent shapes, dtypes or arguments.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"x: expected unit stride along the last dim, got strides {x.stride()}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim: expected one of {HEAD_DIMS}, got {head_dim!r}")
    K = x.shape[1]
    rotated = K if rotated is None else rotated
    if isinstance(rotated, numbers.Integral) and not isinstance(rotated, bool):
        rotated = int(rotated)
    if not isinstance(rotated, int) or rotated % head_dim or not 0 < rotated <= K:
        raise ValueError(f"rotated: expected a multiple of head_dim={head_dim} in "
                         f"[{head_dim}, {K}] (x's columns), got {rotated!r}")
    return torch.ops.minikv.hadamard_heads(x, head_dim, rotated)
