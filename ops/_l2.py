"""Prefetches toward L2 from Triton kernels: hints, never a change to any result.

``prefetch.global.L2`` asks the memory system to bring a 128-byte line into L2 and returns at
once; nothing waits for it. L2 is the point of coherence for global memory on NVIDIA GPUs, so a
prefetched line can never be stale: a later write to it updates L2. Inline PTX (the interpreter
has none; callers skip these there).

``MINIKV_L2_HINT=0`` in the environment turns the attention's hint off (``share`` then hands out
nothing), to measure what it is worth.

Two uses in a decode step, both about DRAM that would otherwise idle:

* ``fused_linear`` asks for the first columns of its own weight rows before its PDL wait, while
  the kernel before it finishes;
* ``decode_attention`` takes an optional tensor to stream toward L2 while it runs (the engine
  passes the layer's o_proj weights): at the engine's short rows the attention kernel is bound by
  instruction issue, not by memory, and the projection after it then reads its weights from L2.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

LINE_BYTES = 128


@triton.jit
def prefetch(ptrs):
    """Ask L2 for the line holding each address of ``ptrs`` (any shape), without waiting."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def prefetch_share(base_ptr, lines, per_program, pid, BLOCK: tl.constexpr):
    """Program ``pid``'s share of a contiguous buffer: lines ``[pid * per_program, + per_program)``
    of ``lines`` 128-byte lines from ``base_ptr`` (an int8 pointer), BLOCK at a time."""
    first = pid * per_program
    end = tl.minimum(first + per_program, lines)
    for i0 in range(first, end, BLOCK):
        i = tl.minimum(i0 + tl.arange(0, BLOCK), end - 1)
        prefetch(base_ptr + i.to(tl.int64) * 128)


def share(tensor: Optional[torch.Tensor], programs: int,
          dummy: torch.Tensor) -> Tuple[torch.Tensor, int, int]:
    """(int8 view, lines, lines per program) of a contiguous ``tensor`` spread over ``programs``
    programs; ``tensor`` None gives ``dummy`` and 0 lines (the kernels then issue nothing)."""
    if tensor is None or tensor.numel() == 0 or os.environ.get("MINIKV_L2_HINT") == "0":
        return dummy, 0, 0
    flat = tensor.view(-1).view(torch.int8)
    lines = triton.cdiv(flat.numel(), LINE_BYTES)
    return flat, lines, triton.cdiv(lines, programs)
