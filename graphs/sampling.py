"""On-device token choice: one rule for the first token (after prefill) and every later one.

The rule follows HF's logits processors, in HF's order: repetition penalty on the raw logits,
then temperature, top-k, and top-p over the renormalized top-k tokens; greedy rows take the
first maximum of the penalized logits. The random draw is the exponential race (``argmax_i p_i
/ E_i`` with ``E_i ~ Exp(1)`` picks ``i`` with probability ``p_i``), and ``E`` comes from a
counter-based hash of (the slot's seed, its own token count, the token id): no generator state,
no host sync, and a seeded request draws the same noise alone or in any batch, in any slot.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

_MIX = 0x45D9F3B           # < 2**27: a product with a 32-bit value stays below 2**59 (int64-safe)
_WEYL = 0x9E3779B9         # golden-ratio increment: spreads consecutive token ids over 32 bits
_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class Sampling:
    """How one request chooses its tokens (validated at the public boundary).

    ``greedy``: argmax (temperature, top_k, top_p unused). ``top_k``: None = the whole
    vocabulary. ``top_p``: 1.0 = off. ``repetition_penalty``: 1.0 = off (HF's rule: a seen
    token's positive logit is divided by it, a negative one multiplied). ``seed``: the draws of
    the request; None draws one from torch's global generator at admission.
    """

    greedy: bool = True
    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: Optional[int] = None

    @property
    def needs_sampling_step(self) -> bool:
        """Whether the decode step must run the general rule (not the greedy fast path)."""
        return not self.greedy or self.repetition_penalty != 1.0


def argmax_rows(x: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for ``x (B, V)`` (the first index of the maximum), in two reductions.

    Compiled, a plain argmax over a 128k vocabulary at batch 1 is one reduction kernel with one
    program per row: 29 us per step on the H200. Maxima of ``chunk``-wide slices first (``V /
    chunk`` programs per row), then the first slice holding the maximum.
    """
    vals, idx = _slices(x, chunk, float("-inf")).max(dim=-1)  # first maximum within each slice
    best = vals.argmax(dim=-1, keepdim=True)                  # first slice with the maximum
    return (best * chunk + idx.gather(1, best))[:, 0]


def cumsum_rows(x: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """``x.cumsum(dim=-1)`` for ``x (B, V)`` fp32, as sums within ``chunk``-wide slices plus the
    slices' running totals (fp32 rounding differs from one long scan in the last bits).

    Compiled on CUDA, one scan over a 128k vocabulary at small B is split across programs, and
    torch 2.11's inductor then fused the following argmax into that split scan and failed
    ("NYI TritonSplitDimKernel reductions"); two short scans are never split.
    """
    B, V = x.shape
    inner = _slices(x, chunk, 0.0).cumsum(dim=-1)              # (B, ceil(V / chunk), chunk)
    totals = inner[..., -1]
    before = totals.cumsum(dim=-1) - totals                     # mass of the slices before
    return (inner + before[..., None]).view(B, -1)[:, :V]


def _slices(x: torch.Tensor, chunk: int, fill: float) -> torch.Tensor:
    """``x (B, V)`` as ``(B, ceil(V / chunk), chunk)``, the last slice padded with ``fill``."""
    pad = (-x.shape[1]) % chunk
    if pad:
        x = torch.nn.functional.pad(x, (0, pad), value=fill)
    return x.view(x.shape[0], -1, chunk)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of int64 values in [0, 2**32), in int64 arithmetic."""
    x = ((x >> 16) ^ x) * _MIX & _MASK32
    x = ((x >> 16) ^ x) * _MIX & _MASK32
    return (x >> 16) ^ x


def exponential_noise(seed: torch.Tensor, counter: torch.Tensor, token_ids: torch.Tensor
                      ) -> torch.Tensor:
    """``Exp(1)`` draws, a pure function of (seed, counter, token id).

    seed, counter: (B,) int64 (seed >= 0); token_ids: (B, V) int64. Returns (B, V) fp32 > 0.
    """
    key = _mix32(seed & _MASK32 ^ _mix32((seed >> 32) & _MASK32 ^ _mix32(counter & _MASK32)))
    x = _mix32(_mix32((key[:, None] + token_ids * _WEYL) & _MASK32))
    return exponential_from_bits(x >> 8)


def exponential_from_bits(k: torch.Tensor) -> torch.Tensor:
    """``-log(u)`` for ``u = (k + 1/2) / 2**24``, ``k`` int64 in ``[0, 2**24)``: fp32, in
    ``[2.9e-8, 17.3]``, strictly positive and finite for every ``k``.

    ``k + 1/2`` near ``2**24`` needs 25 bits, so fp32 would round ``u`` to 1 and the noise to 0
    (one id in 2**24: a removed token then won as ``0 / 0``). Both halves are computed from
    their distance to the nearer end, ``(m + 1/2) / 2**24`` with ``m < 2**23``, which is exact:
    ``-log(t)`` below one half, ``-log1p(-t)`` above it.
    """
    upper = k >= 2**23
    m = torch.where(upper, 2**24 - 1 - k, k)
    t = (m.to(torch.float32) + 0.5) * (1.0 / 2**24)            # exact, in (0, 1/2)
    return torch.where(upper, -torch.log1p(-t), -torch.log(t))


def choose_tokens(logits: torch.Tensor, *, greedy: torch.Tensor, temperature: torch.Tensor,
                  top_k: torch.Tensor, top_p: torch.Tensor, penalty: torch.Tensor,
                  seen: torch.Tensor, seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """The next token of each row under its own sampling parameters.

    logits (B, V) fp32; greedy (B,) bool; temperature, top_p, penalty (B,) fp32; top_k (B,)
    int64 (V = off); seen (B, V) bool (tokens of the prompt and of the output so far); seed,
    counter (B,) int64 (counter: tokens the row generated before this one). Returns (B,) int64.
    """
    V = logits.shape[-1]
    pen = penalty[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / pen, logits * pen), logits)
    # Stable: among equal logits the lowest id comes first, as argmax and HF's greedy choose.
    sorted_logits, order = (logits / temperature[:, None]).sort(dim=-1, descending=True,
                                                                stable=True)
    rank = torch.arange(V, device=logits.device)
    sorted_logits = sorted_logits.masked_fill(rank[None, :] >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)                     # renormalized over the top k
    # Keep a token while the mass *before* it is below top_p (so the first token always stays).
    probs = probs.masked_fill((cumsum_rows(probs) - probs) >= top_p[:, None], 0.0)
    noise = exponential_noise(seed, counter, order)
    noise = torch.where(greedy[:, None], torch.ones_like(noise), noise)
    # A removed token (probability 0) scores -1 whatever its noise: it can never win the race.
    choice = argmax_rows(torch.where(probs > 0, probs / noise, -1.0))
    return order.gather(-1, choice[:, None])[:, 0]
