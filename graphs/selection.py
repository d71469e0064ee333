"""Which prompt tokens a layer keeps: scoring rules and the persistent selection.

DESIGN.md section 2, step 4. Each rule maps one layer's prefill attention to a score per
(KV head, position); the kept set is the recent window plus the highest-scoring older positions,
in position order, fixed for the whole generation.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


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


def token_scores(config, q: torch.Tensor, k: torch.Tensor, cumulative: torch.Tensor, scale: float
                 ) -> torch.Tensor:
    """The score of every prompt position under ``config.selection``.

    q (1, H_q, L, D), k (1, H_kv, L, D); cumulative (1, H_kv, L) fp32 from selective attention
    (column sums of the normalized causal attention) -> (H_kv, L) fp32.
    """
    if config.selection == "h2o":
        return cumulative[0]
    if config.selection == "snapkv":
        return snapkv_scores(q, k, scale, config.snapkv_window, config.snapkv_kernel)
    raise ValueError(f"selection: expected one of ('h2o', 'snapkv'), got {config.selection!r}")
