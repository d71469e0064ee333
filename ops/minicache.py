"""MiniCache: one KV state for two adjacent layers, in plain PyTorch (the method's reference).

For a layer pair ``(l, l+1)``, per sequence ``b``, KV head ``h`` and token ``t`` (keys and values
are merged separately, each with its own call)::

    u = x_l / |x_l|,  w = x_{l+1} / |x_{l+1}|,  Omega = angle(u, w)
    e = sin((1 - t) Omega) / sin(Omega) * u + sin(t Omega) / sin(Omega) * w     (SLERP)
    x_hat_l = |x_l| e,   x_hat_{l+1} = |x_{l+1}| e                                (|x| kept in fp16)

and the ``R = ceil(retain * T)`` tokens of each ``(b, h)`` with the largest ``Omega`` are not
merged: both layers keep their original vectors there (token retention). Keys are merged as
cached, after RoPE: both layers rotate a token's key by the same position, and a rotation keeps
angles and commutes with SLERP, so merging before or after RoPE gives the same cache.

Degenerate cases (where the formula is 0/0), decided so that restoring stays finite and exact
wherever it can be:
- a zero vector has no direction: the shared direction is the other layer's unit direction
  (both zero: the zero vector), and its own magnitude 0 restores it exactly; such a token's
  distance is 0 (the merge loses nothing there), so it is never retained before a real one;
- ``Omega < EPS`` (parallel): normalized linear interpolation, which differs from SLERP by
  O(Omega^3) (< 1e-9 at EPS = 1e-3);
- ``Omega > pi - EPS`` (opposite): SLERP has no defined plane; the endpoint nearer in ``t``
  (layer ``l``'s direction when ``t <= 1/2``, else layer ``l+1``'s), so one layer stays exact.
  Such tokens have the largest distance and are the first retained.

The angle is ``2 atan2(|u - w|, |u + w|)``, accurate over the whole range ``[0, pi]`` (``acos``
of the dot product loses half the digits near 0 and pi). Everything is computed in fp32 (fp64
for fp64 inputs).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Tuple

import torch

from ._checks import FLOAT_DTYPES, check_tensor

__all__ = ["MergedPair", "shared_direction", "merge_pair", "restore", "retained_count"]

# Below this angle (rad) from 0 or pi the SLERP weights are 0/0-like; see the module docstring.
EPS = 1e-3
_FP16_MAX = 65504.0


class MergedPair(NamedTuple):
    """One layer pair's merged state for keys or for values (``M = T - R`` merged tokens).

    direction: ``(B, H, M, D)`` unit shared directions of the merged tokens, in position order
        (the input dtype).
    magnitude: ``(2, B, H, M)`` fp16, ``|x_l|`` and ``|x_{l+1}|`` of those tokens.
    retained_index: ``(B, H, R)`` int64, the retained positions, ascending.
    retained: ``(2, B, H, R, D)`` the retained tokens' original vectors of layer ``l`` and ``l+1``
        (the input dtype).
    """

    direction: torch.Tensor
    magnitude: torch.Tensor
    retained_index: torch.Tensor
    retained: torch.Tensor


def retained_count(tokens: int, retain: float) -> int:
    """``R = ceil(retain * tokens)``: tokens kept unmerged per ``(b, h)``; 0 <= R <= tokens."""
    if not isinstance(retain, (int, float)) or isinstance(retain, bool) or not 0.0 <= retain <= 1.0:
        raise ValueError(f"retain: expected a fraction in [0, 1], got {retain!r}")
    return min(tokens, math.ceil(retain * tokens))


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def shared_direction(x_l: torch.Tensor, x_l1: torch.Tensor, t: float = 0.6
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """SLERP of the two layers' unit directions, with the degenerate cases above.

    Args:
        x_l, x_l1: ``(..., D)`` the two layers' vectors, same shape, fp16/bf16/fp32/fp64.
        t: interpolation weight in ``[0, 1]``; 0 gives layer ``l``'s direction, 1 layer ``l+1``'s.

    Returns:
        ``(e, omega)``: ``e (..., D)`` unit shared directions (zero where both inputs are zero) and
        ``omega (...)`` the angle between the two in ``[0, pi]`` (0 where either is zero), both
        in fp32 (fp64 for fp64 inputs).
    """
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0.0 <= t <= 1.0:
        raise ValueError(f"t: expected a float in [0, 1], got {t!r}")
    check_tensor("x_l", x_l, dtypes=FLOAT_DTYPES + (torch.float64,))
    check_tensor("x_l1", x_l1, shape=tuple(x_l.shape), dtypes=(x_l.dtype,), device=x_l.device)
    if x_l.dim() == 0:
        raise ValueError("x_l: expected at least 1 dim (..., D), got a scalar")
    dt = _compute_dtype(x_l)
    a, b = x_l.to(dt), x_l1.to(dt)
    na, nb = a.norm(dim=-1, keepdim=True), b.norm(dim=-1, keepdim=True)
    za, zb = na == 0, nb == 0
    u = torch.where(za, 0.0, a / torch.where(za, 1.0, na))
    w = torch.where(zb, 0.0, b / torch.where(zb, 1.0, nb))
    omega = 2 * torch.atan2((u - w).norm(dim=-1, keepdim=True), (u + w).norm(dim=-1, keepdim=True))
    omega = torch.where(za | zb, 0.0, omega)
    sin = torch.sin(omega)
    safe = torch.where(sin == 0, 1.0, sin)
    e = torch.sin((1 - t) * omega) / safe * u + torch.sin(t * omega) / safe * w
    lerp = (1 - t) * u + t * w
    lerp = lerp / torch.where(lerp.norm(dim=-1, keepdim=True) == 0, 1.0, lerp.norm(dim=-1, keepdim=True))
    e = torch.where(omega < EPS, lerp, e)
    e = torch.where(omega > math.pi - EPS, u if t <= 0.5 else w, e)
    # One zero vector: the other's direction (u or w is zero, so u + w is the nonzero one).
    e = torch.where(za | zb, u + w, e)
    return e, omega[..., 0]


def merge_pair(x_l: torch.Tensor, x_l1: torch.Tensor, t: float = 0.6, retain: float = 0.05
               ) -> MergedPair:
    """Merge one layer pair's keys (or values) into a shared direction and per-layer magnitudes.

    Args:
        x_l, x_l1: ``(B, H, T, D)`` layer ``l``'s and ``l+1``'s cached states (keys after RoPE, or
            values), same shape and dtype (fp16/bf16/fp32/fp64), any strides.
        t: SLERP weight in ``[0, 1]`` (0: layer ``l``'s direction).
        retain: fraction of each ``(b, h)``'s tokens kept unmerged: the ``R = ceil(retain * T)``
            with the largest angle between the layers; ``retain=1.0`` merges nothing.

    Returns:
        :class:`MergedPair`; magnitudes are rounded to fp16. Raises ``ValueError`` on bad input,
        including a magnitude beyond fp16's range (it would be stored as inf).
    """
    check_tensor("x_l", x_l, ndim=4, dtypes=FLOAT_DTYPES + (torch.float64,))
    check_tensor("x_l1", x_l1, shape=tuple(x_l.shape), dtypes=(x_l.dtype,), device=x_l.device)
    B, H, T, D = x_l.shape
    R = retained_count(T, retain)
    e, omega = shared_direction(x_l, x_l1, t)                      # (B, H, T, D), (B, H, T)
    dt = e.dtype
    mags = torch.stack([x_l.to(dt).norm(dim=-1), x_l1.to(dt).norm(dim=-1)])  # (2, B, H, T)
    if bool((mags > _FP16_MAX).any()):
        raise ValueError(f"x_l, x_l1: expected vector norms <= {_FP16_MAX} (fp16 magnitudes), "
                         f"got a norm of {float(mags.max()):.6g}")
    # Retained: the R largest angles; ties broken by position (a stable sort).
    order = torch.sort(omega, dim=-1, descending=True, stable=True).indices
    retained_index = order[..., :R].sort(dim=-1).values                        # (B, H, R)
    merged_index = order[..., R:].sort(dim=-1).values                          # (B, H, M)

    def gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:   # tokens idx (B, H, n) of x
        return x.gather(-2, idx[..., None].expand(*idx.shape, D))

    retained = torch.stack([gather(x_l, retained_index), gather(x_l1, retained_index)])
    direction = gather(e, merged_index).to(x_l.dtype)
    magnitude = mags.gather(-1, merged_index.expand(2, *merged_index.shape)).to(torch.float16)
    return MergedPair(direction, magnitude, retained_index, retained)


def restore(pair: MergedPair) -> Tuple[torch.Tensor, torch.Tensor]:
    """The two layers' states as a decode step reads them, back in position order.

    Args:
        pair: a :class:`MergedPair` (its ``direction`` may be a dequantized, no longer exactly
            unit, copy: it is scaled as given, as the decode kernel would).

    Returns:
        ``(x_hat_l, x_hat_l1)``, each ``(B, H, T, D)`` with ``T = M + R`` in ``direction``'s dtype:
        ``magnitude * direction`` at merged positions, the original vectors at retained ones.
    """
    direction, magnitude, index, retained = pair
    check_tensor("direction", direction, ndim=4)
    B, H, M, D = direction.shape
    check_tensor("magnitude", magnitude, shape=(2, B, H, M), dtypes=(torch.float16,))
    check_tensor("retained_index", index, ndim=3, dtypes=(torch.int64,))
    R = index.shape[-1]
    check_tensor("retained_index", index, shape=(B, H, R))
    check_tensor("retained", retained, shape=(2, B, H, R, D))
    T = M + R
    is_retained = torch.zeros(B, H, T, dtype=torch.bool, device=direction.device)
    is_retained.scatter_(-1, index, True)
    if int(is_retained.sum()) != B * H * R:
        raise ValueError("retained_index: expected distinct positions per (b, h) in [0, T), "
                         "got repeated ones")
    # Merged positions, ascending: the complement of the retained ones.
    merged_index = torch.sort((~is_retained).to(torch.int8), dim=-1, descending=True,
                              stable=True).indices[..., :M]
    out = []
    for layer in range(2):
        x = direction.new_empty(B, H, T, D)
        x.scatter_(-2, merged_index[..., None].expand(B, H, M, D),
                   magnitude[layer].to(direction.dtype)[..., None] * direction)
        x.scatter_(-2, index[..., None].expand(B, H, R, D), retained[layer].to(direction.dtype))
        out.append(x)
    return out[0], out[1]
