"""Per-slot decode state and the fixed-shape decode step over the slots of one bucket.

One step for the slots ``[0, B)`` of a bucket ``B``::

    tokens -> minikv::cache_begin_step (every layer: per-slot flush every n_r, counters; live
              slots only)
           -> embed -> per layer: q/k/v + RoPE at each slot's logical position
           -> minikv::cache_write_ring (the new k/v into the ring)
           -> minikv::decode_attention (compressed cache + ring) -> o_proj, MLP
    -> norm, lm_head                                                  (``decode_logits``)
    -> each slot's next token (greedy, sampled or forced), written at its own column;
       counters and finished flags advance for live slots              (``decode_choose``)

A slot is *live* while it is admitted and not finished. Slots that are not live go through the
same arithmetic (their share of the launch) but change nothing: the cache is not touched, their
counters stay, and their token is written to a scratch column. Every input and output is a
preallocated buffer of ``SlotState``, so a replay needs no host synchronization.
"""
from __future__ import annotations

from typing import Optional

import torch

from minikv_compile import ops

from .cache import StaticKVCache
from .sampling import argmax_rows, choose_tokens

MAX_EOS_IDS = 8  # eos ids per slot (Llama 3 has several); padded with -1
MODES = ("greedy", "sample", "teacher")


class SlotState:
    """The device state of ``Bmax`` slots (``N`` = max new tokens, ``V`` = vocabulary)::

        tokens      (Bmax,)       int64  the token each slot feeds next
        positions   (Bmax,)       int64  its logical position (prompt length + tokens fed so far)
        count       (Bmax,)       int64  tokens the slot has generated (its next column)
        limit       (Bmax,)       int64  its max_new_tokens
        minimum     (Bmax,)       int64  its min_new_tokens: eos ids are banned before
        active      (Bmax,)       bool   admitted (set once its first token is chosen), not
                                         released
        done        (Bmax,)       bool   finished: an eos id, or ``count == limit``
        eos_ids     (Bmax, 8)     int64  its eos ids, -1 padded
        greedy      (Bmax,)       bool   and temperature, top_p, penalty (Bmax,) fp32,
        top_k       (Bmax,)       int64  seed (Bmax,) int64: its sampling parameters
        seen        (Bmax, V)     bool   tokens of its prompt and output (repetition penalty)
        generated   (Bmax, N + 1) int64  column ``count`` gets the next token; column N is
                                         the scratch column of slots that are not live
        forced      (Bmax, N)     int64  teacher mode: the tokens to feed instead of choosing
        logprobs    (Bmax, N + 1) fp32   teacher mode: log-prob of the forced token per column;
                                         column N is the scratch column again
    """

    def __init__(self, max_batch_size: int, max_new_tokens: int, vocab_size: int,
                 device: torch.device):
        B, N, V, dev = max_batch_size, max_new_tokens, vocab_size, device
        i64 = dict(dtype=torch.int64, device=dev)
        f32 = dict(dtype=torch.float32, device=dev)
        self.max_new_tokens, self.vocab_size = N, V
        self.tokens = torch.zeros(B, **i64)
        self.positions = torch.zeros(B, **i64)
        self.count = torch.zeros(B, **i64)
        self.limit = torch.zeros(B, **i64)
        self.minimum = torch.zeros(B, **i64)
        self.active = torch.zeros(B, dtype=torch.bool, device=dev)
        self.done = torch.zeros(B, dtype=torch.bool, device=dev)
        self.eos_ids = torch.full((B, MAX_EOS_IDS), -1, **i64)
        self.greedy = torch.ones(B, dtype=torch.bool, device=dev)
        self.temperature = torch.ones(B, **f32)
        self.top_k = torch.full((B,), V, **i64)
        self.top_p = torch.ones(B, **f32)
        self.penalty = torch.ones(B, **f32)
        self.seed = torch.zeros(B, **i64)
        self.seen = torch.zeros(B, V, dtype=torch.bool, device=dev)
        self.generated = torch.zeros(B, N + 1, **i64)
        self.forced = torch.zeros(B, N, **i64)
        self.logprobs = torch.zeros(B, N + 1, **f32)

    def buffers(self) -> list:
        """Every buffer (what a graph's warm-up must leave as it found)."""
        return [self.tokens, self.positions, self.count, self.limit, self.minimum, self.active,
                self.done,
                self.eos_ids, self.greedy, self.temperature, self.top_k, self.top_p, self.penalty,
                self.seed, self.seen, self.generated, self.forced, self.logprobs]

    def choose(self, logits: torch.Tensor, rows: slice, mode: str, live: torch.Tensor
               ) -> torch.Tensor:
        """The next token of slots ``rows`` from their logits (B, V) fp32 -> (B,) int64.

        The one rule of the project: the decode step calls it for its bucket, admission for the
        first token of one slot. Teacher mode feeds ``forced`` and records its log-probability
        (live rows at their column, the others in the scratch column).
        """
        count = self.count[rows]
        if mode == "greedy":
            return argmax_rows(logits)
        if mode == "sample":
            eos = self.eos_ids[rows]                                # (B, 8), -1 padded
            is_eos = torch.zeros_like(logits, dtype=torch.int32).scatter_add_(
                1, eos.clamp(min=0), (eos >= 0).int()) > 0          # (B, V)
            banned = is_eos & (count < self.minimum[rows])[:, None]
            logits = logits.masked_fill(banned, float("-inf"))
            return choose_tokens(logits, greedy=self.greedy[rows],
                                 temperature=self.temperature[rows], top_k=self.top_k[rows],
                                 top_p=self.top_p[rows], penalty=self.penalty[rows],
                                 seen=self.seen[rows], seed=self.seed[rows], counter=count)
        forced = self.forced[rows].gather(1, count.clamp(max=self.max_new_tokens - 1)[:, None])
        col = torch.where(live, count, self.max_new_tokens)[:, None]
        self.logprobs[rows].scatter_(1, col, logits.log_softmax(dim=-1).gather(1, forced))
        return forced[:, 0]

    def record(self, nxt: torch.Tensor, rows: slice, live: torch.Tensor) -> None:
        """Store each live slot's new token ``nxt`` (B,) at its column, advance its counters and
        set its finished flag; slots that are not live keep everything but the scratch column."""
        count, done = self.count[rows], self.done[rows]
        nxt = torch.where(live, nxt, self.tokens[rows])
        col = torch.where(live, count, self.max_new_tokens)[:, None]
        self.generated[rows].scatter_(1, col, nxt[:, None])
        seen = self.seen[rows]  # (a slot that is not live writes back what it held)
        seen.scatter_(1, nxt[:, None], live[:, None] | seen.gather(1, nxt[:, None]))
        count.add_(live.long())
        self.positions[rows].add_(live.long())
        eos = (nxt[:, None] == self.eos_ids[rows]).any(dim=-1)
        done.logical_or_(live & (eos | (count >= self.limit[rows])))
        self.tokens[rows].copy_(nxt)


def decode_logits(adapter, cache: StaticKVCache, state: SlotState, slots: torch.Tensor
                  ) -> torch.Tensor:
    """The layers of one decode step of the slots ``[0, B)`` of a bucket: each slot's token in,
    the next token's logits ``(B, V)`` fp32 out; writes the cache of live slots only.

    slots: ``state.active[:B]``. The bucket's size is read from its length, so that a compiler
    sees it as a dimension: one compiled graph serves every bucket with the same ``DecodePlan``,
    and every mode (the choice of the token is ``decode_choose``).
    """
    a, batch = adapter, slots.shape[0]
    rows = slice(0, batch)
    live = slots & ~state.done[rows]
    h = a.embed(state.tokens[rows, None])                      # (B, 1, hidden)
    cos, sin = a.rope(h, state.positions[rows, None])         # (B, 1, D)
    # Every layer's flushes and counters at once; each layer then only writes its new k/v.
    ring_index = ops.cache_begin_step(cache.layout, batch, live)  # (L, B)
    normed: Optional[tuple] = None  # the next input norm's share done by the launch before
    for layer, lc in enumerate(cache.layers):
        q, k, v = a.qkv(layer, h, cos, sin, normed)  # q (B, H_q, 1, D), k/v (B, H_kv, 1, D)
        # Views into the q/k/v projection's output, read in place by both ops (a copy would be
        # one more kernel per tensor and layer).
        ops.cache_write_ring(k[:, :, 0], v[:, :, 0], lc.k_ring, lc.v_ring, ring_index[layer])
        o = ops.decode_attention(q[:, :, 0], *lc, a.scale, cache.bits, cache.group_size)
        h, normed = a.finish_layer_normed(layer, h, o.reshape(batch, 1, -1))  # o (B, H_q, D)
    return a.logits(h[:, 0])                                   # (B, V) fp32


def decode_choose(state: SlotState, slots: torch.Tensor, logits: torch.Tensor, mode: str
                  ) -> None:
    """The rest of the step: each live slot's next token from ``logits (B, V)`` by ``mode``'s
    rule, recorded at its column (``SlotState.choose`` and ``record``)."""
    rows = slice(0, slots.shape[0])
    live = slots & ~state.done[rows]
    state.record(state.choose(logits, rows, mode, live), rows, live)
