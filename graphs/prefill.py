"""Eager prefill of one or several requests: selective attention, persistent selection, write
into their slots.

docs/algorithm.md, "Prefill" to "Quantization". Runs once per admission, outside any graph;
everything here is allowed to allocate. Memory stays linear in the prompts: attention never
materializes L x L, and only each prompt's last position goes through the LM head.

Several prompts are prefilled in one varlen pass: concatenated into one ``(1, N)`` sequence
(``N = sum L_i``) for everything that works position by position (embedding, norms, the q/k/v,
o and MLP projections, RoPE at each prompt's own positions ``0 .. L_i - 1``), so each weight is
read once for all of them; attention, the token scores, the selection (each prompt's own ``L_i``
and budgets) and the cache write run per prompt, on its slice. One prompt is the same pass with
``N = L``: there is no second path.
"""
from __future__ import annotations

from typing import Generator, Protocol, Sequence

import torch

from minikv_compile import ops

from . import budget
from .cache import StaticKVCache
from .selection import CUMULATIVE_RULES, select_tokens, token_scores


class Adapter(Protocol):  # what prefill and decode need of a model (see models/)
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    tp: object  # its ranks (models/parallel.py): check_same and from_rank0 at admission

    vocab_size: int

    def embed(self, input_ids): ...
    def rope(self, h, positions): ...
    def layer_weights(self, layer): ...  # what qkv / finish_layer* take instead of an index
    def qkv(self, layer, h, cos, sin, normed=None, path=None): ...  # path: the step's plan
    def finish_layer(self, layer, h, attn_out, overwrite=False): ...  # h consumed
    def finish_layer_normed(self, layer, h, attn_out, path): ...  # (h, normed for the next qkv)
    def logits(self, h): ...


def prefill(adapter: Adapter, cache: StaticKVCache, configs: Sequence, slots: Sequence[int],
            prompts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Prefill ``prompts[i]`` into cache slot ``slots[i]``, selecting its tokens under
    ``configs[i]`` (a ``MiniKVConfig``: its budgets and selection rule); returns the logits of
    each prompt's last position, ``(n, V)`` fp32.

    prompts: n tensors ``(L_i,)`` int64 on the model's device, ``1 <= L_i <= max_prompt_len``;
    slots: n distinct slots of the cache.
    """
    pieces = prefill_pieces(adapter, cache, configs, slots, prompts, adapter.num_layers)
    while True:
        try:
            next(pieces)
        except StopIteration as done:
            return done.value


def prefill_pieces(adapter: Adapter, cache: StaticKVCache, configs: Sequence,
                   slots: Sequence[int], prompts: Sequence[torch.Tensor], layers_per_piece: int
                   ) -> Generator[None, None, torch.Tensor]:
    """``prefill`` in pieces of ``layers_per_piece`` layers: a generator that yields after each
    piece but the last and returns the logits ``(n, V)`` fp32, so that a scheduler can run
    decode steps of other slots between the pieces (the slots' counters are written layer by
    layer; their state is set by the caller once the whole prompts are in)."""
    if not len(configs) == len(slots) == len(prompts) >= 1:
        raise ValueError(f"prompts: expected one config and one slot per prompt, got "
                         f"{len(prompts)} prompts, {len(slots)} slots, {len(configs)} configs")
    lengths = [p.shape[0] for p in prompts]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    n_layers = adapter.num_layers
    ids = torch.cat(list(prompts))[None]                   # (1, N)
    h = adapter.embed(ids)                                 # (1, N, hidden)
    # RoPE per prompt (each from position 0): a rope whose frequencies depend on the longest
    # position it is given (HF's "dynamic" scaling) sees each prompt's own length, as alone.
    rope = [adapter.rope(h[:, s: s + L], torch.arange(L, device=ids.device)[None])
            for s, L in zip(starts, lengths)]
    cos = torch.cat([c for c, _ in rope], dim=1)           # (1, N, D)
    sin = torch.cat([s for _, s in rope], dim=1)
    for layer, lc in enumerate(cache.layers):
        q, k, v = adapter.qkv(layer, h, cos, sin)          # q (1, H_q, N, D), k/v (1, H_kv, N, D)
        attn = h.new_empty(1, h.shape[1], adapter.num_q_heads, adapter.head_dim)  # (1, N, H_q, D)
        for config, slot, s, L in zip(configs, slots, starts, lengths):
            rows = slice(s, s + L)
            out = _attend_and_store(adapter, cache, lc, config, layer, slot,
                                    q[:, :, rows], k[:, :, rows], v[:, :, rows])
            attn[:, rows] = out.transpose(1, 2)            # (1, L, H_q, D)
        del q, k, v, out  # before the MLP's chunks: 1.3 GiB a rank at 131k on the 70B shape
        h = adapter.finish_layer(layer, h, attn.view(1, h.shape[1], -1), overwrite=True)
        if (layer + 1) % layers_per_piece == 0 and layer + 1 < n_layers:
            yield
    # each prompt's last position by slicing: an index tensor from the host would wait for
    # the GPU to finish the pass (a stall of every stream in a scheduler)
    last = torch.cat([h[0, s + L - 1: s + L] for s, L in zip(starts, lengths)])
    return adapter.logits(last)                            # (n, V)


def _attend_and_store(adapter: Adapter, cache: StaticKVCache, lc, config, layer: int, slot: int,
                      q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One prompt's causal attention in one layer, and its kept tokens written to ``slot``.

    q (1, H_q, L, D), k/v (1, H_kv, L, D), keys after RoPE (views into the pass's tensors)
    -> the attention output (1, H_q, L, D).
    """
    L = q.shape[2]
    n_recent, n_heavy = budget.kept_tokens(config, L, layer, adapter.num_layers)
    if n_recent + n_heavy >= L:
        # Nothing is evicted: no scores needed.
        out = ops.causal_attention(q, k, v, scale=adapter.scale)
        k_sel, v_sel = k[0], v[0]
    else:
        if config.selection in CUMULATIVE_RULES:
            out, cumulative = ops.selective_attention(q, k, v, scale=adapter.scale)
        else:
            out, cumulative = ops.causal_attention(q, k, v, scale=adapter.scale), None
        scores = token_scores(config, q, k, cumulative, adapter.scale, n_recent)
        idx = select_tokens(scores, n_recent, n_heavy)     # (H_kv, n)
        idx = idx[..., None].expand(-1, -1, adapter.head_dim)
        k_sel, v_sel = k[0].gather(1, idx), v[0].gather(1, idx)
    # the kept tokens' last ones stay in the full-precision ring: all of them when they fit
    ops.cache_write_prefill(k_sel.contiguous(), v_sel.contiguous(), slot, lc, cache.bits,
                            cache.group_size, budget.prefill_ring_tokens(config, k_sel.shape[1]))
    if cache.recall is not None:
        # SpeCache's host copy: row t = the token at quantized position t (the order of k_sel;
        # its ring tail takes the next positions when flushed), stored by a kernel on the stream:
        # a copy_ into the slot's strided rows staged through pageable memory, 3.3 s of a 32k
        # prefill's 5.3 (H100, 8B shape)
        store = cache.recall.stores[layer]
        ops.recall_store_rows(store.k[slot], store.v[slot], k_sel, v_sel, 0)
    return out
