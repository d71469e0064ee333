"""Input checks shared by every op: one helper, one message shape ("expected X, got Y").

Checks use plain ``if ...: raise ValueError`` on Python-visible properties (shape, dtype,
device). Under ``torch.compile`` these are evaluated on fake tensors at trace time, so they cost
nothing per step and never cause a graph break.
"""
from __future__ import annotations

import functools
import os
from typing import Iterable, Optional, Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_tensor(
    name: str,
    t: torch.Tensor,
    *,
    ndim: Optional[int] = None,
    shape: Optional[Sequence[Optional[int]]] = None,
    dtypes: Optional[Iterable[torch.dtype]] = None,
    device: Optional[torch.device] = None,
    contiguous: bool = False,
) -> None:
    """Raise ``ValueError`` naming ``name``, what was expected and what was given.

    ``shape`` entries of ``None`` match any size.
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")
    if shape is not None:
        ok = t.dim() == len(shape) and all(s is None or s == n for s, n in zip(shape, t.shape))
        if not ok:
            want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
            raise ValueError(f"{name}: expected shape {want}, got {tuple(t.shape)}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            raise ValueError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if device is not None and t.device != torch.device(device):
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")


def check_choice(name: str, value, choices: Iterable) -> None:
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {value!r}")


QUANT_BITS = (1, 2, 4)
GROUP_SIZES = (16, 32, 64, 128)


def check_quant_params(bits: int, group_size: int) -> None:
    """bits in QUANT_BITS; group_size in GROUP_SIZES and a multiple of the codes per int32
    (keys pack P consecutive tokens of one group into a word): 1 bit needs groups of >= 32."""
    check_choice("bits", bits, QUANT_BITS)
    check_choice("group_size", group_size, GROUP_SIZES)
    if group_size % codes_per_word(bits):
        raise ValueError(f"group_size: expected a multiple of {codes_per_word(bits)} (the codes "
                         f"one int32 packs at bits={bits}), got {group_size}")


def codes_per_word(bits: int) -> int:
    """Codes packed into one int32: 32 for 1-bit, 16 for 2-bit, 8 for 4-bit (least-significant
    bits first)."""
    return 32 // bits


def compiled_major(device: torch.device) -> int:
    """The compute-capability major of the GPU a kernel compiles for on ``device``: 0 on the CPU
    and under ``TRITON_INTERPRET=1``. Asked at every launch of some kernels, so cached."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return 0
    return _properties(device).major


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of the GPU of ``device`` (1 on the CPU): sizes grids that should
    fill the GPU once. Asked at every launch of some kernels, so cached."""
    return _properties(device).multi_processor_count if device.type == "cuda" else 1


def _properties(device: torch.device):
    return _properties_of(device.index if device.index is not None
                          else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _properties_of(index: int):
    return torch.cuda.get_device_properties(index)
