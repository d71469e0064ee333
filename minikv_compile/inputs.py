"""Argument checks for every public entry point: "expected X, got Y", before any work.

Numbers are accepted in their integral forms (Python, numpy scalars, 0-d torch tensors) and
nothing is coerced: a float, a string or a bool is never read as a token id, a count or a flag.
Every failure is a ``ValueError`` whose message starts with the argument's name.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, List, Optional, Tuple

import numpy as np
import torch

from minikv_compile.graphs.sampling import Sampling

__all__ = ["check_int", "check_float", "check_bool", "token_rows", "eos_ids", "SamplingParams",
           "sampling_params", "MIN_TEMPERATURE", "MIN_PENALTY", "FP32_MAX", "FP32_TINY"]

# logits / temperature stays finite in fp32 for any real logit (|x| < 1e4 gives < 1e8), and at
# 1e-4 the softmax is already one-hot unless two logits lie within ~1e-3: below it, use greedy.
MIN_TEMPERATURE = 1e-4
# Sampling runs in fp32: a float knob must be a number fp32 holds (not rounded to inf, nor to 0 or
# a subnormal), and a seen positive logit (|x| < 1e4) divided by the repetition penalty and then
# by MIN_TEMPERATURE must stay finite: 1e4 / (1e-4 * 3.4e38) = 2.9e-31, so at least 1e-30.
FP32_MAX = float(torch.finfo(torch.float32).max)
FP32_TINY = float(torch.finfo(torch.float32).tiny)
MIN_PENALTY = 1e-30

_INT_DTYPES = frozenset(d for d in (getattr(torch, n, None) for n in (
    "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64")) if d is not None)
_TOKENIZE_HINT = "tokenize the text first, e.g. tokenizer(text, return_tensors='pt')"


def _show(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _typed(value: Any) -> str:
    """``repr`` and type, for messages where the type is what is wrong."""
    if isinstance(value, torch.Tensor):
        return f"{_show(value)} ({value.dtype}, shape {tuple(value.shape)})"
    if isinstance(value, np.ndarray):
        return f"{_show(value)} (numpy {value.dtype}, shape {value.shape})"
    return f"{_show(value)} ({type(value).__name__})"


def _int_like(value: Any) -> Optional[int]:
    """``value`` as a Python int if it is an integral scalar (never a bool); else None."""
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, torch.Tensor) and value.ndim == 0 and value.dtype in _INT_DTYPES:
        return int(value.item())
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "iu":
        return int(value.item())
    return None


def _real_like(value: Any) -> Optional[float]:
    """``value`` as a Python float if it is a real scalar (int or float, never a bool); else None."""
    as_int = _int_like(value)
    if as_int is not None:
        try:
            return float(as_int)
        except OverflowError:
            return math.inf
    if isinstance(value, (float, np.floating)):
        return float(value)
    if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim == 0:
        torch_in = isinstance(value, torch.Tensor)
        if value.dtype.is_floating_point if torch_in else value.dtype.kind == "f":
            return float(value.item())
    return None


def _range_text(lo, hi, lo_open: bool = False, hi_open: bool = False) -> str:
    if lo is not None and hi is not None:
        return f" in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    if lo is not None:
        return f" {'>' if lo_open else '>='} {lo}"
    if hi is not None:
        return f" {'<' if hi_open else '<='} {hi}"
    return ""


def check_int(name: str, value: Any, *, lo: Optional[int] = None, hi: Optional[int] = None) -> int:
    """``value`` as a Python int in ``[lo, hi]`` (either end may be None: unbounded).

    Accepts Python ints, numpy integer scalars and 0-d integer tensors; refuses bools, floats
    (``2.0`` too), strings (``"8"`` too) and everything else.

    Raises
    ------
    ValueError
        ``"{name}: expected an int in [lo, hi], got {value!r}"``.
    """
    wanted = f"an int{_range_text(lo, hi)}"
    as_int = _int_like(value)
    if as_int is None:
        raise ValueError(f"{name}: expected {wanted}, got {_typed(value)}")
    if (lo is not None and as_int < lo) or (hi is not None and as_int > hi):
        raise ValueError(f"{name}: expected {wanted}, got {_show(value)}")
    return as_int


def check_float(name: str, value: Any, *, lo: Optional[float] = None, hi: Optional[float] = None,
                lo_open: bool = False, hi_open: bool = False, fp32: bool = False) -> float:
    """``value`` as a finite Python float in the range ``lo``..``hi`` (ends open or closed);
    with ``fp32``, also one that float32 holds: 0 or a magnitude in [FP32_TINY, FP32_MAX].

    Accepts Python, numpy and 0-d tensor ints and floats; refuses bools, strings, nan and inf.

    Raises
    ------
    ValueError
        ``"{name}: expected a finite number in (lo, hi], got {value!r}"``.
    """
    wanted = f"a finite number{_range_text(lo, hi, lo_open, hi_open)}"
    as_float = _real_like(value)
    if as_float is None:
        raise ValueError(f"{name}: expected {wanted}, got {_typed(value)}")
    if (not math.isfinite(as_float)
            or (lo is not None and (as_float <= lo if lo_open else as_float < lo))
            or (hi is not None and (as_float >= hi if hi_open else as_float > hi))):
        raise ValueError(f"{name}: expected {wanted}, got {_show(value)}")
    if fp32 and as_float != 0 and not FP32_TINY <= abs(as_float) <= FP32_MAX:
        raise ValueError(f"{name}: expected {wanted} that float32 holds (0 or a magnitude in "
                         f"[{FP32_TINY:.4g}, {FP32_MAX:.4g}]), got {_show(value)}")
    return as_float


def check_bool(name: str, value: Any) -> bool:
    """``value`` as a Python bool: only ``True`` / ``False`` (numpy or 0-d bool tensor too).

    Raises
    ------
    ValueError
        For anything else, ``1``, ``0`` and ``"yes"`` included.
    """
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, torch.Tensor) and value.ndim == 0 and value.dtype == torch.bool:
        return bool(value.item())
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind == "b":
        return bool(value.item())
    raise ValueError(f"{name}: expected True or False, got {_typed(value)}")


# -- prompts -----------------------------------------------------------------------------------


def _is_row(value: Any) -> bool:
    return (isinstance(value, (list, tuple))
            or (isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim == 1))


def _array_values(name: str, value, mask: bool) -> list:
    """A 1-D / 2-D tensor or array as nested lists of Python ints, its dtype and values checked."""
    torch_in = isinstance(value, torch.Tensor)
    if torch_in:
        ok = value.dtype in _INT_DTYPES or (mask and value.dtype == torch.bool)
        dtype = value.dtype
    else:
        ok = value.dtype.kind in ("iub" if mask else "iu")
        dtype = f"numpy {value.dtype}"
    if not ok:
        wanted = "a bool or integer 0/1 mask" if mask else "integer token ids"
        text = not mask and not torch_in and value.dtype.kind in "US"
        hint = f"; {_TOKENIZE_HINT}" if text else ""
        raise ValueError(f"{name}: expected {wanted}, got dtype {dtype}{hint}")
    if mask and (value.dtype == torch.bool if torch_in else value.dtype.kind == "b"):
        value = value.to(torch.uint8) if torch_in else value.astype(np.uint8)
    elif mask:
        bad = (value != 0) & (value != 1)
        if bad.any():
            where = bad.nonzero()
            at = [int(w[0]) for w in where] if not torch_in else where[0].tolist()
            raise ValueError(f"{name}{''.join(f'[{i}]' for i in at)}: expected 0 or 1, "
                             f"got {value[tuple(at)].item()}")
    return value.tolist()


def _element(name: str, value: Any, mask: bool) -> int:
    if isinstance(value, (str, bytes)):
        hint = "" if mask else f"; {_TOKENIZE_HINT}"
        raise ValueError(f"{name}: expected {'0 or 1' if mask else 'a token id (int)'}, "
                         f"got a string {_show(value)}{hint}")
    if mask:
        if isinstance(value, (bool, np.bool_)) or (isinstance(value, torch.Tensor) and value.ndim == 0
                                                   and value.dtype == torch.bool):
            return int(bool(value))
        as_int = _int_like(value)
        if as_int not in (0, 1):
            raise ValueError(f"{name}: expected 0 or 1, got {_typed(value)}")
        return as_int
    as_int = _int_like(value)
    if as_int is None:
        raise ValueError(f"{name}: expected a token id (int), got {_typed(value)}")
    return as_int


def _row(name: str, row: Any, mask: bool) -> List[int]:
    if isinstance(row, (torch.Tensor, np.ndarray)):
        return _array_values(name, row, mask)
    if all(type(t) is int for t in row) and (not mask or set(row) <= {0, 1}):
        return list(row)  # the common case: 10x faster on a 16 x 4096 batch than each element
    return [_element(f"{name}[{j}]", t, mask) for j, t in enumerate(row)]


def _as_rows(name: str, value: Any, mask: bool) -> Tuple[List[List[int]], bool]:
    """``(rows, is_array)``: a 1-D or 2-D tensor / array / list as rows of Python ints."""
    if isinstance(value, (str, bytes)):
        hint = "" if mask else f"; {_TOKENIZE_HINT}"
        raise ValueError(f"{name}: expected {'a 0/1 mask' if mask else 'token ids'}, "
                         f"got a string {_show(value)}{hint}")
    if isinstance(value, (torch.Tensor, np.ndarray)):
        if value.ndim not in (1, 2):
            raise ValueError(f"{name}: expected a 1-D (L,) or 2-D (B, L) array, "
                             f"got shape {tuple(value.shape)}")
        values = _array_values(name, value, mask)
        return ([values] if value.ndim == 1 else values), True
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name}: expected a tensor, a numpy array or a list of ints or of int lists, "
                         f"got {_typed(value)}")
    if not value:
        return [], False
    if _is_row(value[0]):
        for i, r in enumerate(value):
            if not _is_row(r):
                raise ValueError(f"{name}[{i}]: expected a list of ints like the rows before it, "
                                 f"got {_typed(r)}")
        return [_row(f"{name}[{i}]", r, mask) for i, r in enumerate(value)], False
    return [_row(name, value, mask)], False


def _mask_rows(name: str, value: Any) -> List[List[int]]:
    rows, _ = _as_rows(name, value, mask=True)
    return rows


def token_rows(input_ids: Any, attention_mask: Any, vocab_size: Any, *,
               pad_token_id: Any = None) -> List[List[int]]:
    """The prompts as lists of token ids, the masked-out positions removed.

    Parameters
    ----------
    input_ids:
        ``(B, L)`` or ``(L,)`` integer tensor or numpy array; a list of ints (one prompt); a
        list of int lists (ragged when there is no mask); or a ``BatchEncoding`` / dict with
        ``"input_ids"`` (and ``"attention_mask"``), as a tokenizer returns it.
    attention_mask:
        None, or 0/1 values (bool or integer) of the ids' shape: ``(B, L)``, or ``(L,)`` for one
        prompt. Any pattern: left or right padding, or holes. With a dict ``input_ids`` it must
        be None or equal to the dict's mask.
    vocab_size:
        Every kept id must lie in ``[0, vocab_size)``.
    pad_token_id:
        The model's pad id, or None. A ``(B > 1, L)`` tensor / array with no mask whose rows start
        or end with it is refused: padding would be read as prompt (HF only warns).

    Returns
    -------
    list[list[int]]
        ``B`` non-empty rows of Python ints.

    Raises
    ------
    ValueError
        Floats, bools, strings (tokenize first), ids out of range, masks other than 0/1, shape
        mismatches, an empty batch or an empty prompt: "expected X, got Y", naming the argument.
    """
    vocab = check_int("vocab_size", vocab_size, lo=1)
    pad = None if pad_token_id is None else check_int("pad_token_id", pad_token_id)
    mask_name = "attention_mask"
    if isinstance(input_ids, Mapping):
        extra = sorted(map(str, set(input_ids) - {"input_ids", "attention_mask"}))
        if "input_ids" not in input_ids or extra:
            raise ValueError("input_ids: expected a tensor, a list or a mapping with the keys "
                             "'input_ids' and 'attention_mask' (as a tokenizer returns), "
                             f"got keys {sorted(map(str, input_ids))}")
        inner_mask = input_ids.get("attention_mask")
        if attention_mask is not None and inner_mask is not None:
            inner_name = "input_ids['attention_mask']"
            if _mask_rows("attention_mask", attention_mask) != _mask_rows(inner_name, inner_mask):
                raise ValueError(f"attention_mask: expected None or the same mask as {inner_name}, "
                                 "got a different one")
        if inner_mask is not None:
            attention_mask, mask_name = inner_mask, "input_ids['attention_mask']"
        input_ids = input_ids["input_ids"]

    rows, is_array = _as_rows("input_ids", input_ids, mask=False)
    if not rows:
        raise ValueError("input_ids: expected at least one prompt, got none")

    if attention_mask is not None:
        lengths = sorted({len(r) for r in rows})
        if len(lengths) > 1:
            raise ValueError(f"input_ids: expected rows of one length (padded) with an attention_mask, "
                             f"got lengths {lengths}")
        mask = _mask_rows(mask_name, attention_mask)
        shape, mask_shape = (len(rows), lengths[0]), (len(mask), len(mask[0]) if mask else 0)
        if len({len(m) for m in mask}) > 1 or mask_shape != shape:
            got = [len(m) for m in mask] if len({len(m) for m in mask}) > 1 else mask_shape
            raise ValueError(f"{mask_name}: expected the shape of input_ids {shape}, got {got}")
        rows = [[t for t, m in zip(r, mr) if m] for r, mr in zip(rows, mask)]
    elif pad is not None and is_array and input_ids.ndim == 2 and len(rows) > 1:
        padded = [i for i, r in enumerate(rows) if r and (r[0] == pad or r[-1] == pad)]
        if padded:
            raise ValueError(f"attention_mask: expected a mask with a padded batch, got None while rows "
                             f"{padded[:5]} start or end with pad_token_id={pad} (pass the tokenizer's "
                             "attention_mask, all ones if nothing is padded)")

    for i, r in enumerate(rows):
        if not r:
            raise ValueError(f"input_ids[{i}]: expected at least one token"
                             f"{' after the attention_mask' if attention_mask is not None else ''}, got none")
        if min(r) < 0 or max(r) >= vocab:
            bad = next(j for j, t in enumerate(r) if not 0 <= t < vocab)
            raise ValueError(f"input_ids[{i}][{bad}]: expected a token id in [0, {vocab}), got {r[bad]}")
    return rows


# -- generation arguments ----------------------------------------------------------------------


def eos_ids(value: Any, vocab_size: Any, *, max_ids: int = 8) -> List[int]:
    """The stop ids: None -> ``[]``; an int or a list / tuple / 1-D tensor of ints.

    Each id must lie in ``[0, vocab_size)``; duplicates are dropped keeping the first; at most
    ``max_ids`` distinct ids. Bools, floats (``2.0``) and strings are refused.
    """
    vocab = check_int("vocab_size", vocab_size, lo=1)
    if value is None:
        return []
    if isinstance(value, (str, bytes)):
        raise ValueError(f"eos_token_id: expected None, an int or a list of ints, got {_typed(value)}")
    if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim > 0:
        if value.ndim > 1:
            raise ValueError("eos_token_id: expected an int or a 1-D list of ints, "
                             f"got shape {tuple(value.shape)}")
        integral = value.dtype in _INT_DTYPES if isinstance(value, torch.Tensor) else value.dtype.kind in "iu"
        if not integral:
            raise ValueError(f"eos_token_id: expected integer ids, got {_typed(value)}")
        items = value.tolist()
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        items = None
    if items is None:
        ids = [check_int("eos_token_id", value, lo=0, hi=vocab - 1)]
    else:
        ids = [check_int(f"eos_token_id[{i}]", t, lo=0, hi=vocab - 1) for i, t in enumerate(items)]
    unique = list(dict.fromkeys(ids))
    if len(unique) > max_ids:
        raise ValueError(f"eos_token_id: expected at most {max_ids} distinct ids, got {len(unique)}")
    return unique


# How the next token is chosen, validated (``graphs.sampling.Sampling``): the neutral value where
# a knob is off; ``repetition_penalty`` applies in both modes (as HF).
SamplingParams = Sampling


def sampling_params(*, do_sample: Any, temperature: Any, top_k: Any, top_p: Any,
                    repetition_penalty: Any, seed: Any, vocab_size: Any) -> SamplingParams:
    """Validate HF's sampling arguments once.

    ``temperature``: None (1.0) or >= ``MIN_TEMPERATURE`` when sampling; ``top_k``: None or 0
    (off, HF's reading) or an int in ``[1, vocab_size]``; ``top_p``: None or in ``(0, 1]``;
    ``repetition_penalty``: None or in ``[MIN_PENALTY, FP32_MAX]`` (1.0 is off); ``seed``: None
    or in ``[0, 2**63 - 1]``; every float one that fp32, the sampling step's dtype, holds.
    With ``do_sample=False`` temperature, top-k and top-p are checked for type only and have no
    effect (HF warns), so ``temperature=0`` with greedy is accepted.
    """
    vocab = check_int("vocab_size", vocab_size, lo=1)
    greedy = not check_bool("do_sample", do_sample)
    penalty = 1.0 if repetition_penalty is None else check_float(
        "repetition_penalty", repetition_penalty, lo=MIN_PENALTY, hi=FP32_MAX)
    seed = None if seed is None else check_int("seed", seed, lo=0, hi=2**63 - 1)
    if greedy:
        for name, value in (("temperature", temperature), ("top_p", top_p)):
            if value is not None:
                check_float(name, value)
        if top_k is not None:
            check_int("top_k", top_k)
        return SamplingParams(greedy=True, temperature=1.0, top_k=vocab, top_p=1.0,
                              repetition_penalty=penalty, seed=seed)
    temp = 1.0 if temperature is None else check_float("temperature", temperature, lo=0, lo_open=True)
    if temp < MIN_TEMPERATURE:
        raise ValueError(f"temperature: expected >= {MIN_TEMPERATURE} when sampling (lower overflows "
                         "logits / temperature in fp32; use do_sample=False for greedy), "
                         f"got {temperature!r}")
    check_float("temperature", temp, lo=0, lo_open=True, fp32=True)  # above fp32's max
    k = 0 if top_k is None else check_int("top_k", top_k, lo=0, hi=vocab)
    p = 1.0 if top_p is None else check_float("top_p", top_p, lo=0, hi=1, lo_open=True, fp32=True)
    return SamplingParams(greedy=False, temperature=temp, top_k=k or vocab, top_p=p,
                          repetition_penalty=penalty, seed=seed)
