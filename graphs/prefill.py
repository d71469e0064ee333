"""Eager prefill of one request: selective attention, persistent selection, write into a slot.

docs/algorithm.md, "Prefill" to "Quantization". Runs once per request, outside any graph;
everything here is allowed to allocate. Memory stays linear in the prompt: attention never
materializes L x L, and only the last position goes through the LM head.
"""
from __future__ import annotations

from typing import Generator, Protocol

import torch
import torch.nn.functional as F

from minikv_compile import ops

from . import budget
from .cache import StaticKVCache
from .selection import select_tokens, token_scores


class Adapter(Protocol):  # what prefill and decode need of a model (see models/)
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float

    def embed(self, input_ids): ...
    def rope(self, h, positions): ...
    def qkv(self, layer, h, cos, sin, normed=None): ...
    def finish_layer(self, layer, h, attn_out): ...
    def finish_layer_normed(self, layer, h, attn_out): ...  # (h, normed for the next qkv)
    def logits(self, h): ...


def prefill(adapter: Adapter, cache: StaticKVCache, config, slot: int, input_ids: torch.Tensor
            ) -> torch.Tensor:
    """Prefill one prompt into cache slot ``slot``; returns the last position's logits (V,) fp32.

    input_ids: (L,) int64 on the model's device, 1 <= L <= config.max_prompt_len.
    """
    pieces = prefill_pieces(adapter, cache, config, slot, input_ids, adapter.num_layers)
    while True:
        try:
            next(pieces)
        except StopIteration as done:
            return done.value


def prefill_pieces(adapter: Adapter, cache: StaticKVCache, config, slot: int,
                   input_ids: torch.Tensor, layers_per_piece: int
                   ) -> Generator[None, None, torch.Tensor]:
    """``prefill`` in pieces of ``layers_per_piece`` layers: a generator that yields after each
    piece but the last and returns the logits, so that a scheduler can run decode steps of
    other slots between the pieces (the slot's own counters are written layer by layer; its
    state is set only once the whole prompt is in)."""
    L = input_ids.shape[0]
    n_layers = adapter.num_layers
    positions = torch.arange(L, device=input_ids.device)[None]
    h = adapter.embed(input_ids[None])
    cos, sin = adapter.rope(h, positions)
    for layer, lc in enumerate(cache.layers):
        q, k, v = adapter.qkv(layer, h, cos, sin)          # q (1, H_q, L, D), k/v (1, H_kv, L, D)
        n_recent, n_heavy = budget.kept_tokens(config, L, layer, n_layers)
        if n_recent + n_heavy >= L:
            # Nothing is evicted: no scores needed, so use the fastest exact attention there is.
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=adapter.scale,
                                                 enable_gqa=q.shape[1] != k.shape[1])
            k_sel, v_sel = k[0], v[0]
        else:
            out, cumulative = ops.selective_attention(q, k, v, scale=adapter.scale)
            scores = token_scores(config, q, k, cumulative, adapter.scale, n_recent)
            idx = select_tokens(scores, n_recent, n_heavy)  # (H_kv, n)
            idx = idx[..., None].expand(-1, -1, adapter.head_dim)
            k_sel, v_sel = k[0].gather(1, idx), v[0].gather(1, idx)
        ops.cache_write_prefill(k_sel.contiguous(), v_sel.contiguous(), slot, lc, cache.bits,
                                cache.group_size)
        h = adapter.finish_layer(layer, h, out.transpose(1, 2).reshape(1, L, -1))
        if (layer + 1) % layers_per_piece == 0 and layer + 1 < n_layers:
            yield
    return adapter.logits(h[:, -1])[0]

