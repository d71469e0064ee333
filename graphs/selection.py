"""Which prompt tokens a layer keeps: scoring rules and the persistent selection.

docs/algorithm.md, "Selection". Each rule maps one layer's prefill attention to a score per
(KV head, position); the kept set is the recent window plus the highest-scoring older positions,
in position order, fixed for the whole generation.

The rules (``MiniKVConfig.selection``):

``"h2o"``
    The paper's rule: the cumulative attention every key receives from all prompt queries.
    Query-agnostic, and biased towards early keys, which more queries can see.
``"snapkv"``
    Attention from the last ``snapkv_window`` queries (the question, in a chat prompt),
    max-pooled over ``snapkv_kernel`` neighbouring positions.
``"h2o_mean"``
    The cumulative attention divided by the number of prompt queries that see the key
    (``L - t`` for position ``t``): the mean instead of the sum, so a late key that its few
    readers attend to strongly is not outvoted by an early key that many readers glance at.
``"snapkv_h2o"``
    Half of the heavy budget by each of ``"snapkv"`` and ``"h2o"``: the union of the two rankings
    (a position's score is its better rank of the two), so the question's evidence and the
    document's globally important tokens both survive.

Two refinements apply to any rule:

``selection_block > 1``
    Whole aligned blocks of positions are kept, ranked by their best position's score. With the
    block equal to ``group_size`` every 1/2/4-bit key group of the heavy hitters (one channel over
    16 consecutive *kept* tokens) covers 16 neighbouring positions, as in KIVI, instead of 16
    scattered ones: after RoPE, keys of distant positions differ widely in every channel, so a
    scattered group has a wide range and a coarse 2-bit step.
``sink_tokens > 0``
    The first positions (attention sinks) are kept whatever their score; they count against the
    heavy budget.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

# The rule names MiniKVConfig accepts (it validates against this tuple).
SELECTIONS = ("h2o", "snapkv", "h2o_mean", "snapkv_h2o")
# The rules that read the cumulative attention of every prompt query (selective attention's
# second output). "snapkv" reads its window's queries only: its prefill runs the attention
# without the scores' pass (ops.causal_attention).
CUMULATIVE_RULES = ("h2o", "h2o_mean", "snapkv_h2o")


def select_tokens(scores: torch.Tensor, n_recent: int, n_heavy: int) -> torch.Tensor:
    """Indices kept per KV head, in position order.

    scores: (H_kv, L) fp32 -> (H_kv, n_recent + n_heavy) int64: the last ``n_recent`` positions
    plus the ``n_heavy`` highest-scoring positions among ``[0, L - n_recent)``, sorted.
    """
    H, L = scores.shape
    recent = torch.arange(L - n_recent, L, device=scores.device).expand(H, n_recent)
    if n_heavy == 0:
        return recent
    heavy = scores[:, : L - n_recent].topk(n_heavy, dim=-1).indices
    return torch.cat([heavy, recent], dim=-1).sort(dim=-1).values


def snapkv_scores(q: torch.Tensor, k: torch.Tensor, scale: float, window: int, kernel: int) -> torch.Tensor:
    """SnapKV: attention of the last ``window`` queries, summed, max-pooled over positions.

    q: (1, H_q, L, D), k: (1, H_kv, L, D) -> (H_kv, L) fp32. Costs ``window x L`` per head.
    """
    _, Hq, L, D = q.shape
    Hkv = k.shape[1]
    w = min(window, L)
    qw = q[0, :, L - w:].float().view(Hkv, Hq // Hkv, w, D)
    logits = torch.einsum("hgwd,hld->hgwl", qw, k[0].float()) * scale
    # Causal within the window: window row i sits at position L - w + i.
    rows = torch.arange(L - w, L, device=q.device)[:, None]
    logits = logits.masked_fill(torch.arange(L, device=q.device)[None, :] > rows, float("-inf"))
    attn = logits.softmax(dim=-1).sum(dim=(1, 2))  # (H_kv, L)
    return F.max_pool1d(attn[:, None], kernel, stride=1, padding=kernel // 2)[:, 0]


def mean_attention_scores(cumulative: torch.Tensor) -> torch.Tensor:
    """Cumulative attention over the number of causal queries that see each key.

    cumulative: (H_kv, L) fp32 column sums -> (H_kv, L) fp32; position ``t`` is seen by the
    ``L - t`` queries at positions ``t .. L - 1`` (times the query heads of the group, a constant
    that does not change the ranking and is left out).
    """
    L = cumulative.shape[-1]
    seen_by = torch.arange(L, 0, -1, device=cumulative.device, dtype=torch.float32)  # L - t
    return cumulative.float() / seen_by


def rank_union_scores(a: torch.Tensor, b: torch.Tensor, n_candidates: int) -> torch.Tensor:
    """Scores whose top ``2m`` contain the top ``m`` of ``a`` and the top ``m`` of ``b``.

    a, b: (H_kv, L) fp32 -> (H_kv, L) fp32. Only positions ``[0, n_candidates)`` are ranked (the
    others get ``-inf``): the recent window is kept anyway and must not use up either half. A
    position's score is ``-(2 * r + tie)`` where ``r`` is its better rank (0 = best) in ``a`` or
    ``b`` and ``tie`` is 1 when that rank comes from ``b`` alone, so every score is distinct,
    ``top-k`` has no ties to break and the result is the same on every device. Stable sorts break
    ties inside ``a`` and ``b`` by position.
    """
    H, L = a.shape
    out = torch.full((H, L), float("-inf"), dtype=torch.float32, device=a.device)
    n = n_candidates
    if n <= 0:
        return out
    rank_a, rank_b = _ranks(a[:, :n]), _ranks(b[:, :n])  # (H_kv, n) int64, 0 = highest
    best = torch.minimum(rank_a, rank_b)
    out[:, :n] = -(2 * best + (rank_a != best).long()).float()
    return out


def block_scores(scores: torch.Tensor, block: int, n_candidates: int) -> torch.Tensor:
    """Scores that rank whole aligned blocks of ``block`` positions by their best position.

    scores: (H_kv, L) -> (H_kv, L) fp32. Positions ``[0, n_candidates)`` are cut into blocks
    ``[j * block, (j + 1) * block)`` (the last one may be shorter); a block's key is the maximum
    of its scores, and positions get distinct scores ordered by (block key descending, earlier
    block on ties, earlier position inside the block), so ``top-k`` takes whole blocks, best
    first, and at most one block in part. Others get ``-inf``.
    """
    H, L = scores.shape
    n = n_candidates
    out = torch.full((H, L), float("-inf"), dtype=torch.float32, device=scores.device)
    if n <= 0:
        return out
    nb = -(-n // block)
    padded = torch.full((H, nb * block), float("-inf"), dtype=torch.float32, device=scores.device)
    padded[:, :n] = scores[:, :n].float()
    block_rank = _ranks(padded.view(H, nb, block).amax(dim=-1))          # (H_kv, nb), 0 = best
    offset = torch.arange(n, device=scores.device) % block
    place = block_rank.repeat_interleave(block, dim=-1)[:, :n] * block + offset
    out[:, :n] = -place.float()
    return out


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """(H, n) -> (H, n) int64: each entry's place in its row sorted high to low (stable)."""
    order = x.sort(dim=-1, descending=True, stable=True).indices
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(x.shape[-1], device=x.device).expand_as(order))
    return ranks


def token_scores(config, q: torch.Tensor, k: torch.Tensor, cumulative: Optional[torch.Tensor],
                 scale: float, n_recent: int) -> torch.Tensor:
    """The score of every prompt position under ``config.selection``, then
    ``config.selection_block`` and ``config.sink_tokens``.

    q (1, H_q, L, D), k (1, H_kv, L, D); cumulative (1, H_kv, L) fp32 from selective attention
    (column sums of the normalized causal attention), None unless the rule is one of
    ``CUMULATIVE_RULES``; ``n_recent``: the recent window this layer
    keeps whatever the scores -> (H_kv, L) fp32. Only ``[0, L - n_recent)`` is ranked by the
    caller, so entries in the recent window are arbitrary.
    """
    L = q.shape[2]
    rule = config.selection
    if rule in CUMULATIVE_RULES and cumulative is None:
        raise ValueError(f"cumulative: rule {rule!r} needs selective attention's cumulative "
                         f"scores, got None")
    if rule == "h2o":
        scores = cumulative[0]
    elif rule == "snapkv":
        scores = snapkv_scores(q, k, scale, config.snapkv_window, config.snapkv_kernel)
    elif rule == "h2o_mean":
        scores = mean_attention_scores(cumulative[0])
    elif rule == "snapkv_h2o":
        snap = snapkv_scores(q, k, scale, config.snapkv_window, config.snapkv_kernel)
        scores = rank_union_scores(snap, cumulative[0].float(), L - n_recent)
    else:
        raise ValueError(f"selection: expected one of {SELECTIONS}, got {rule!r}")
    if config.selection_block > 1:
        scores = block_scores(scores, config.selection_block, L - n_recent)
    sinks = min(config.sink_tokens, L)
    if sinks:
        scores = scores.clone()
        scores[:, :sinks] = float("inf")
    return scores
