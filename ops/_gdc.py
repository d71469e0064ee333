"""Programmatic dependent launch (PDL): grid dependency control from Triton kernels (sm_90+).

A kernel launched with ``launch_pdl=True`` may start while the kernel before it on the stream
is still finishing, once every program of that kernel has called :func:`launch_dependents` (or
exited). Everything it does before :func:`wait` must not touch memory the earlier kernels write;
:func:`wait` returns once they have all completed and their writes are visible. Both
instructions are no-ops when the launch did not ask for PDL. Inline PTX, so that the kernels
compile the same on every Triton version the project runs on.

``MINIKV_PDL=0`` in the environment turns it off (every launch then waits for the one before it
to finish): a profile then shows each kernel's own duration, not its wait for the previous one.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._checks import compiled_major


@triton.jit
def wait():
    tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def launch_dependents():
    tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def launch_dependents_then_wait(ENABLED: tl.constexpr):
    """The entry of every PDL kernel here, before it touches memory: let the next kernel start
    launching, then wait for the ones before. Nothing when ``ENABLED`` is false."""
    if ENABLED:
        launch_dependents()
        wait()


def supported(device: torch.device) -> bool:
    """CUDA sm_90+, not the interpreter, not turned off by ``MINIKV_PDL=0``."""
    return os.environ.get("MINIKV_PDL") != "0" and compiled_major(device) >= 9
