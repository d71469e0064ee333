"""``minikv::rotate_heads``: every head of a row times a D x D matrix (the Hadamard rotation of
q and k before the cache quantizes the keys).

One launch for a decode layer's q and k (and the copy of its v): inside a compiled step the
rotation as ``x @ H`` was five launches a layer (casts, cuBLAS GEMMs, a split-K reduce) that
also broke the PDL chain between the projection and the ring write, 2.1 ms of a 6.6 ms step on
the Llama-3.1-8B shape at batch 1 on the H100 (``perf/results/h100/specache_9f29641``).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import _gdc as gdc
from ._checks import FLOAT_DTYPES, check_tensor

_BLOCK_R = 16  # head rows per program: tl.dot's smallest M


@triton.jit
def _rotate_heads_kernel(x_ptr, h_ptr, y_ptr, M, K, ROT, stride_xm,
                         D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                         PDL: tl.constexpr):
    # Rotated part: row r of the (M * ROT / D, D) head view is head r % (ROT / D) of token
    # r // (ROT / D); fp32 products, accumulated in fp32 ("ieee": no TF32 rounding of x or H).
    gdc.launch_dependents_then_wait(PDL)
    heads = ROT // D
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, D)
    m, j = r // heads, r % heads
    r_ok = r < M * heads
    x = tl.load(x_ptr + m[:, None] * stride_xm + j[:, None] * D + d[None, :],
                mask=r_ok[:, None], other=0.0).to(tl.float32)
    h = tl.load(h_ptr + d[:, None] * D + d[None, :])
    y = tl.dot(x, h, input_precision="ieee")
    tl.store(y_ptr + m[:, None] * K + j[:, None] * D + d[None, :],
             y.to(y_ptr.dtype.element_ty), mask=r_ok[:, None])
    # Copied part: columns [ROT, K) of each row, by the first programs.
    row = tl.program_id(0)
    c = ROT + tl.arange(0, BLOCK_C)
    for c0 in range(0, K - ROT, BLOCK_C):
        if row < M:
            c_ok = c + c0 < K
            tl.store(y_ptr + row * K + c + c0,
                     tl.load(x_ptr + row * stride_xm + c + c0, mask=c_ok), mask=c_ok)


def rotate_heads_ref(x: torch.Tensor, h: torch.Tensor, rotated: int) -> torch.Tensor:
    """The CPU implementation: ``x[:, :rotated]`` per D-column head times ``h`` in fp32, rounded
    once to x's dtype; the other columns copied."""
    M, K = x.shape
    D = h.shape[0]
    y = (x[:, :rotated].float().reshape(-1, D) @ h).reshape(M, rotated).to(x.dtype)
    return torch.cat([y, x[:, rotated:]], dim=1)


def _rotate_heads_triton(x: torch.Tensor, h: torch.Tensor, rotated: int) -> torch.Tensor:
    M, K = x.shape
    D = h.shape[0]
    y = torch.empty(M, K, dtype=x.dtype, device=x.device)
    rows = M * (rotated // D)
    # one program per row at least, so that the copied columns have a program each
    grid = (max(triton.cdiv(rows, _BLOCK_R), M),)
    pdl = gdc.supported(x.device)
    _rotate_heads_kernel[grid](x, h, y, M, K, rotated, x.stride(0), D=D, BLOCK_R=_BLOCK_R,
                               BLOCK_C=triton.next_power_of_2(max(K - rotated, 16)), PDL=pdl,
                               num_warps=4, launch_pdl=pdl)
    return y


@torch.library.custom_op("minikv::rotate_heads", mutates_args=())
def _rotate_heads_op(x: torch.Tensor, h: torch.Tensor, rotated: int) -> torch.Tensor:
    return rotate_heads_ref(x, h, rotated)


@_rotate_heads_op.register_fake
def _(x, h, rotated):
    return x.new_empty(x.shape)


_rotate_heads_op.register_kernel("cuda")(_rotate_heads_triton)


def rotate_heads(x: torch.Tensor, h: torch.Tensor, rotated: Optional[int] = None) -> torch.Tensor:
    """Multiply every ``D``-column head among the first ``rotated`` columns of each row by ``h``.

    Args:
        x: ``(M, K)`` fp16/bf16/fp32, unit stride along the last dim (a column slice of a
            larger row, like the q and k of a fused [q; k; v] projection, is fine).
        h: ``(D, D)`` fp32, contiguous, on x's device; ``D`` a power of two from 16 to 256.
        rotated: a multiple of ``D`` up to ``K`` (default ``K``); the columns after it are
            copied unchanged.

    Returns:
        ``(M, K)`` in x's dtype, contiguous: ``y[m, i*D:(i+1)*D] = x[m, i*D:(i+1)*D] @ h`` in
        fp32, rounded once, for the rotated heads.

    Raises:
        ValueError: inconsistent shapes, dtypes or devices.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    if x.shape[1] and x.stride(1) != 1:
        raise ValueError(f"x: expected unit stride along the last dim, got strides {x.stride()}")
    D = h.shape[0] if h.dim() == 2 else 0
    if D not in (16, 32, 64, 128, 256):
        raise ValueError(f"h: expected a (D, D) matrix with D a power of two from 16 to 256, got "
                         f"shape {tuple(h.shape)}")
    check_tensor("h", h, shape=(D, D), dtypes=(torch.float32,), device=x.device, contiguous=True)
    K = x.shape[1]
    rotated = K if rotated is None else rotated
    if not isinstance(rotated, int) or rotated % D or not 0 < rotated <= K:
        raise ValueError(f"rotated: expected a multiple of D={D} in [{D}, {K}] (x's columns), "
                         f"got {rotated!r}")
    return torch.ops.minikv.rotate_heads(x, h, rotated)
