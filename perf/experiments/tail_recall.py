"""Would recall in the tail prefill give back the needles that context first loses (issue 47)?

    python perf/experiments/tail_recall.py --tail {baseline,oracle,topk} [--tail-k K] \
        [accuracy harness arguments]

Runs ``python -m minikv_compile.perf.accuracy`` in this process with the tail prefill's
attention (``graphs/tail.py``, ``TailPrefill.layer``, which calls ``minikv::tail_attention``)
replaced, for a configuration with recall (``recall_top_k > 0``: the host copy exists). Eager
only (``--device cpu``: the engine does not compile the tail there), fp32 as the reference op.
``--tail``:

- ``baseline``: nothing patched (the product's tail: when these runs were made, the question's
  rows attended to the 2-bit region with no recalled rows; see the note below).
- ``oracle``: every quantized position takes its full-precision K/V from recall's host copy
  (``cache.recall.stores[i].k/v[slot, :, :n_quant]``, the rows the prefill, the ring flushes and
  the tail itself write in quantized order): the upper bound of any recall in the tail.
- ``topk``: per chunk, layer and KV head, the K quantized positions with the most attention mass
  from the chunk, scored against the dequantized (2-bit) keys as the decode step's ranking is
  (softmax over region and ring per query row, the probabilities summed over the chunk's T rows
  and the GQA query heads of the KV head), take their host rows; the attention is then redone
  with them. K is ``--tail-k`` (decode recalls 64).

The attention itself is ``ops.attention_tail.tail_attention_ref``'s (fp32 softmax per row and
head, the ring causal). At exit the script prints two checks: the relative error of the 2-bit
region against the host rows (about 0.1-0.3 if the rows are aligned; ~1.4 if the host row of a
position were another token's) and, for ``topk``, the share of the region's attention mass that
the K chosen positions hold. The product is untouched: the patch lives in this process only.
Since the product's tail recalls (``ops.tail_attention_recall``, the ``topk`` rule at the
config's ``recall_top_k``), ``baseline`` runs that; the runs of ``tail_recall_cpu/`` predate it.
"""
from __future__ import annotations

import argparse
import atexit
import sys

import torch

from minikv_compile.graphs.tail import TailPrefill
from minikv_compile.ops.attention_decode import _region_ref

STATS = {"calls": 0, "rel_err_sum": 0.0, "mass_share_sum": 0.0, "mass_calls": 0}


def _where(cache, kv):
    """(layer index, slot) of ``kv``, a slot's ``(1, ...)`` views of one layer's buffers."""
    ptr = kv.k_ring.data_ptr()
    for i, layer in enumerate(cache.layers):
        base, step = layer.k_ring.data_ptr(), layer.k_ring.stride(0) * layer.k_ring.element_size()
        off = ptr - base
        if 0 <= off < layer.k_ring.numel() * layer.k_ring.element_size() and off % step == 0:
            return i, off // step
    raise RuntimeError("tail_recall: the ring view matches no layer's buffers")


def attend(q, kv, scale, bits, group_size, host_k, host_v, how: str, top_k: int):
    """``tail_attention_ref`` for one slot (B = 1) with the region's rows taken from the host
    copy: all of them (``oracle``) or the top ``top_k`` by the chunk's mass (``topk``).
    q ``(1, T, H_q, D)``; host_k/v ``(H_kv, >= n_quant, D)``. Returns ``(1, T, H_q, D)``."""
    _, rows, h_q, d = q.shape
    h_kv = kv.k_ring.shape[1]
    gqa = h_q // h_kv
    n_quant, n_ring = kv.lens[0].tolist()
    k, v = _region_ref(*kv[:6], 0, n_quant, bits, group_size)                # (H_kv, n_quant, D)
    hk, hv = host_k[:, :n_quant].float(), host_v[:, :n_quant].float()
    if n_quant:
        STATS["rel_err_sum"] += float((k - hk).norm() / hk.norm())
        STATS["calls"] += 1
    seen = n_ring + rows - 1
    ring_k, ring_v = kv.k_ring[0, :, :seen].float(), kv.v_ring[0, :, :seen].float()
    qb = q[0].float().reshape(rows, h_kv, gqa, d).transpose(0, 1).reshape(h_kv, rows * gqa, d)
    last = n_quant + n_ring + torch.arange(rows).repeat_interleave(gqa)
    hidden = torch.arange(n_quant + seen)[None, :] >= last[:, None]          # (T * gqa, T_b)

    def probs_of(kk):
        scores = qb @ torch.cat([kk, ring_k], 1).transpose(1, 2) * scale       # (H_kv, T*gqa, T_b)
        return torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)

    if how == "oracle":
        k, v = hk, hv
    elif how == "topk" and n_quant:
        mass = probs_of(k)[:, :, :n_quant].sum(1)                             # (H_kv, n_quant)
        idx = mass.topk(min(top_k, n_quant), dim=1).indices                   # (H_kv, K)
        STATS["mass_share_sum"] += float((mass.gather(1, idx).sum(1) / mass.sum(1)).mean())
        STATS["mass_calls"] += 1
        k, v = k.clone(), v.clone()
        k.scatter_(1, idx[..., None].expand(-1, -1, d), hk.gather(1, idx[..., None].expand(-1, -1, d)))
        v.scatter_(1, idx[..., None].expand(-1, -1, d), hv.gather(1, idx[..., None].expand(-1, -1, d)))
    ob = (probs_of(k) @ torch.cat([v, ring_v], 1)).view(h_kv, rows, gqa, d).transpose(0, 1)
    return ob.reshape(1, rows, h_q, d).to(q.dtype)


def patch(how: str, top_k: int) -> None:
    """``TailPrefill.layer`` replaced by the product's code with ``attend`` for the op."""

    def layer(self, weights, kv, first, h, cos, sin, recall=None):
        a, T = self.adapter, h.shape[1]
        q, k, v = a.qkv(weights, h, cos, sin)
        rows = first + torch.arange(T, device=h.device)
        kv.k_ring.index_copy_(2, rows, k)
        kv.v_ring.index_copy_(2, rows, v)
        cache = self.cache
        if cache.recall is None:
            raise SystemExit("tail_recall: the method has no recall (recall_top_k 0): no host copy")
        i, slot = _where(cache, kv)
        store = cache.recall.stores[i]
        o = attend(q.transpose(1, 2), kv, a.scale, cache.bits, cache.group_size,
                   store.k[slot], store.v[slot], how, top_k)
        return a.finish_layer(weights, h, o.reshape(1, T, -1)), k, v

    TailPrefill.layer = layer


def report() -> None:
    if STATS["calls"]:
        print(f"tail_recall: {STATS['calls']} layer chunks, region vs host rows relative error "
              f"{STATS['rel_err_sum'] / STATS['calls']:.3f}", flush=True)
    if STATS["mass_calls"]:
        print(f"tail_recall: top-k rows hold {100 * STATS['mass_share_sum'] / STATS['mass_calls']:.1f}% "
              f"of the region's attention mass (mean over layer chunks and KV heads)", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tail", choices=("baseline", "oracle", "topk"), required=True)
    p.add_argument("--tail-k", type=int, default=64)
    args, rest = p.parse_known_args()
    if args.tail_k < 1:
        raise SystemExit(f"--tail-k: expected a positive number of positions, got {args.tail_k}")
    if args.tail != "baseline":
        patch(args.tail, args.tail_k)
        atexit.register(report)
    from minikv_compile.perf.accuracy.__main__ import main as accuracy
    return accuracy(rest)


if __name__ == "__main__":
    sys.exit(main())
