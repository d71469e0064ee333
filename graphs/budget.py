"""Budget arithmetic: tokens kept per layer, the cache's capacity, and KV bytes.

The one place these numbers are computed (docs/algorithm.md, "Budgets" and "KV bytes");
prefill, allocation, ``kv_memory()`` and ``perf`` all call it. ``config`` is a ``MiniKVConfig``
(read only: ``heavy_budget``, ``recent_budget``, ``budget_policy``, ``pyramid_depth``,
``kept_floor``, ``residual_length``, ``max_prompt_len``, ``max_new_tokens``, ``bits``,
``group_size``).
"""
from __future__ import annotations

import math
from typing import List, Tuple

from minikv_compile.ops.cache_layout import value_group


def heavy_fraction(config, layer: int, num_layers: int) -> float:
    """``a_HH(l)``: the heavy-hitter fraction of layer ``layer`` (0 = bottom).

    Uniform: ``heavy_budget`` everywhere. Pyramid of depth ``d``: linear from
    ``heavy_budget * (2 - 1/d)`` at the bottom to ``heavy_budget / d`` at the top (mean
    ``heavy_budget``), more in the lower layers.
    """
    if config.budget_policy == "uniform" or num_layers == 1:
        return config.heavy_budget
    d = config.pyramid_depth
    bottom, top = config.heavy_budget * (2.0 - 1.0 / d), config.heavy_budget / d
    return bottom + (top - bottom) * layer / (num_layers - 1)


def kept_tokens(config, prompt_len: int, layer: int, num_layers: int) -> Tuple[int, int]:
    """``(n_RW, n_HH(l))`` for a prompt of ``prompt_len`` tokens; their sum is capped at L and
    floored at ``min(L, kept_floor)``.

    ``n_RW = ceil(recent_budget * L)`` (the 1e-9 keeps 0.25 * 4096 from rounding up to 1025),
    ``n_HH = round(a_HH(l) * L)``. Where their sum falls below the floor, the floor's tokens are
    shared in the budgets' ratio (the recent window's share rounded up; all recent when both
    budgets are 0): a prompt of at most ``kept_floor`` tokens keeps every token, a longer one at
    least ``kept_floor``. The sum is non-decreasing in L, which ``capacities`` relies on.
    """
    n_rw = min(prompt_len, math.ceil(config.recent_budget * prompt_len - 1e-9))
    n_hh = round(heavy_fraction(config, layer, num_layers) * prompt_len)
    n_hh = max(0, min(n_hh, prompt_len - n_rw))
    floor = min(prompt_len, config.kept_floor)
    if n_rw + n_hh >= floor:
        return n_rw, n_hh
    a_rw, a_hh = config.recent_budget, heavy_fraction(config, layer, num_layers)
    share = a_rw / (a_rw + a_hh) if a_rw + a_hh > 0 else 1.0
    n_rw = min(floor, math.ceil(share * floor - 1e-9))
    return n_rw, floor - n_rw


def prefill_ring_tokens(config, kept: int) -> int:
    """Of a layer's ``kept`` prompt tokens (in position order), how many prefill leaves in the
    full-precision ring: the last ones, the others quantized from region token 0.

    All of them when they fit (``kept <= residual_length``): nothing quantized until the ring
    fills with generated tokens. Otherwise the last ``t`` with ``T <= t < T + G`` and
    ``kept - t`` a whole number of groups, ``T`` = half the ring rounded down to whole groups
    (64 of 128 at G = 16; 0 when the ring is one group, the last ``kept mod G`` as before):
    the prompt's tail stays exact for the first ``R - t`` generated tokens, the flush comes
    when the ring is full, and ``t * (R - t)`` (tail tokens times the steps they last) is
    largest at ``t = R / 2``.
    """
    R, G = config.residual_length, config.group_size
    if kept <= R:
        return kept
    tail = R // (2 * G) * G
    return tail + (kept - tail) % G


def ring_tokens_after(config, kept: int, written: int) -> int:
    """Tokens in the ring after ``written`` decode writes following a prefill that kept
    ``kept`` prompt tokens: a full ring is flushed whole just before the next write (lazily,
    so a ring that has just filled still holds ``residual_length``)."""
    R, t = config.residual_length, prefill_ring_tokens(config, kept) + written
    return t if t <= R else (t - 1) % R + 1


def kept_per_layer(config, prompt_len: int, num_layers: int) -> List[int]:
    """Prompt tokens each layer keeps of a prompt of ``prompt_len`` tokens."""
    return [sum(kept_tokens(config, prompt_len, layer, num_layers)) for layer in range(num_layers)]


def capacities(config, num_layers: int) -> List[int]:
    """``T_cap`` per layer: the most tokens a slot of that layer holds in its quantized region.

    The kept count of the longest prompt (it grows with ``L``: ``kept_tokens``) plus every
    generated token, rounded up to a whole group (the report's padding). Wherever prefill splits
    the kept tokens between region and ring (``prefill_ring_tokens``), the region only ever
    holds whole groups of tokens already counted here.
    """
    G = config.group_size
    return [math.ceil((kept + config.max_new_tokens) / G) * G
            for kept in kept_per_layer(config, config.max_prompt_len, num_layers)]


def bytes_per_kv_value(bits: int, group_size: int, head_dim: int, dtype_bytes: int = 2) -> float:
    """Bytes one cached value costs, the mean of a K and a V value: ``bits / 8`` plus an fp16
    scale and zero per key group (``group_size`` tokens of a channel) and per value group
    (``min(group_size, head_dim)`` channels of a token); ``dtype_bytes`` when unquantized."""
    if bits == 16:
        return float(dtype_bytes)
    return bits / 8 + 2 / group_size + 2 / value_group(group_size, head_dim)


def formula_kv_bytes(*, bits: int, group_size: int, kv_width: int, head_dim: int, kept: List[int],
                     new_tokens: int, batch: int, dtype_bytes: int = 2) -> int:
    """The compressed cache's KV bytes by formula: K and V of ``kept[l] + new_tokens`` tokens per
    layer, ``kv_width`` (KV heads x ``head_dim``) values each, at ``bytes_per_kv_value``; the
    residual ring and any padding are on top (the paper's Appendix I count at 2 bits)."""
    per_value = bytes_per_kv_value(bits, group_size, head_dim, dtype_bytes)
    return int(sum(2 * kv_width * (k + new_tokens) * per_value for k in kept) * batch)


def full_kv_bytes(*, num_layers: int, kv_width: int, tokens: int, batch: int,
                  dtype_bytes: int) -> int:
    """An uncompressed cache of ``tokens`` tokens per sequence in a ``dtype_bytes`` dtype."""
    return 2 * num_layers * kv_width * tokens * dtype_bytes * batch
