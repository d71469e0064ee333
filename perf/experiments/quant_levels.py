"""Would other quantization levels serve attention better than the range rules of ``ops/quant.py``?

    MINIKV_QUANT_LEVELS=RULE python perf/experiments/quant_levels.py [accuracy harness arguments]

Runs ``python -m minikv_compile.perf.accuracy`` with the CPU reference quantizer's per-group
levels replaced (the CPU engine quantizes through ``ops.quant._quantize_groups_ref`` only, at
prefill and at every ring flush; run it with ``--device cpu``). RULE:

- ``range``: the library's rule, unchanged (2 and 4 bits: the levels span min..max; 1 bit:
  SpeCache's levels at the midpoints of the range's halves).
- ``mse``: the levels that minimize each group's squared error: for 2 and 4 bits the range
  shrunk about its middle by the best of 1.0, 0.95, ..., 0.5; for 1 bit two means
  (Lloyd's iteration from the midpoint, 4 rounds).
- ``fracF``: 1 bit at ``min + F * span`` and ``max - F * span`` (F 0.25 is SpeCache's rule, F 0
  the range's ends); 2 and 4 bits as the library.

Levels are stored and encoded exactly as the library does (fp16 scale and zero, codes from the
stored values), so only the choice of levels differs.
"""
from __future__ import annotations

import os
import sys

import torch

from minikv_compile.ops import quant

RULE = os.environ.get("MINIKV_QUANT_LEVELS", "range")
LIBRARY = quant._quantize_groups_ref
SHRINK = [1.0 - 0.05 * i for i in range(11)]


def _stored(x, lo, hi, bits):
    """Levels ``lo`` .. ``hi`` stored and encoded as the library does (``quant._encode_ref``)."""
    scale_h = ((hi - lo) / torch.full_like(hi, (1 << bits) - 1)).to(torch.float16)
    zero_h = lo.to(torch.float16)
    return quant._encode_ref(x, scale_h, zero_h, bits), scale_h, zero_h


def _two_means(x, dim, mn, mx, rounds=4):
    lo, hi = mn + (mx - mn) * 0.25, mx - (mx - mn) * 0.25
    for _ in range(rounds):
        above = x >= (lo + hi) / 2
        n_hi = above.sum(dim, keepdim=True)
        n_lo = x.shape[dim] - n_hi
        hi = torch.where(n_hi > 0, (x * above).sum(dim, keepdim=True) / n_hi.clamp(min=1), mx)
        lo = torch.where(n_lo > 0, (x * ~above).sum(dim, keepdim=True) / n_lo.clamp(min=1), mn)
    return lo, hi


def levels(x: torch.Tensor, dim: int, bits: int):
    """``_quantize_groups_ref``'s contract: x fp32, the G members of each group along ``dim``."""
    mn, mx = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    if bits == 1:
        if RULE.startswith("frac"):
            f = float(RULE[4:])
            return _stored(x, mn + (mx - mn) * f, mx - (mx - mn) * f, bits)
        return _stored(x, *_two_means(x, dim, mn, mx), bits)
    if RULE != "mse":
        return LIBRARY(x, dim, bits)
    mid, half = (mx + mn) / 2, (mx - mn) / 2
    best = None
    for a in SHRINK:
        codes, scale_h, zero_h = _stored(x, mid - a * half, mid + a * half, bits)
        err = ((codes.float() * scale_h.float() + zero_h.float() - x) ** 2).sum(dim, keepdim=True)
        if best is None:
            best = [err, codes, scale_h, zero_h]
            continue
        take = err < best[0]
        best = [torch.where(take, new, old)
                for new, old in zip((err, codes, scale_h, zero_h), best)]
    return best[1], best[2], best[3]


def main() -> int:
    if RULE not in ("range", "mse") and not RULE.startswith("frac"):
        raise SystemExit(f"MINIKV_QUANT_LEVELS: expected range, mse or fracF, got {RULE!r}")
    if RULE != "range":
        quant._quantize_groups_ref = levels
    from minikv_compile.perf.accuracy.__main__ import main as accuracy
    return accuracy(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
