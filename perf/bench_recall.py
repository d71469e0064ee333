"""Benchmark SpeCache's host link: what one decode step's recall costs on its own.

    python -m minikv_compile.perf.bench_recall [--out recall.json]

Shapes are Llama-3.1-8B's KV (32 layers, 8 KV heads, D = 128, bf16). Per case (batch, tokens
held per slot, K recalled per KV head), timed as a CUDA-graph replay (``measure.graph_ms``):

* ``gather``: one layer's ``recall_gather`` (K rows of k and v per slot and KV head from the
  pinned host copy), and the rate it reads host memory at;
* ``step``: a whole step's host traffic, every layer's ``recall_store`` (the new token to the host
  copy) and ``recall_gather`` in a row, with nothing to hide behind: the most the recall can add
  to a step;

beside the pinned-memory bandwidths measured in the same run: a plain pinned host-to-device copy
of 256 MiB (``copy_``) and one gather of 16k rows of 256 bytes, the kernel's own best rate. The
engine's step (``engine-vs-hf --methods kivi,kivi-specache``) then says how much of ``step`` its
side stream hid: ``1 - (specache ms - no-recall ms) / step ms``, a lower bound (the overhead also
holds the second row's compute).
"""
from __future__ import annotations

import argparse
import sys
from typing import List

import torch

from minikv_compile.ops import HostStore, recall_gather, recall_store
from minikv_compile.perf.measure import graph_ms, median_ms, row_environment, write_json

LAYERS, H_KV, D, RING = 32, 8, 128, 129
CASES = [(1, 32768, 64), (8, 4096, 64), (1, 32768, 256), (8, 4096, 16)]  # (B, tokens, K)
DTYPE = torch.bfloat16


def _case(B: int, tokens: int, K: int, layers: int):
    dev = torch.device("cuda")
    stores = [HostStore.allocate(max_batch_size=B, num_kv_heads=H_KV, capacity=tokens,
                                 head_dim=D, dtype=DTYPE, device=dev) for _ in range(layers)]
    g = torch.Generator(device=dev).manual_seed(0)
    idx = torch.stack([torch.randperm(tokens, generator=g, device=dev)[:K]
                       for _ in range(B * H_KV)]).view(B, H_KV, K).to(torch.int32)
    rk = torch.empty(B, H_KV, K, D, dtype=DTYPE, device=dev)
    rv = torch.empty_like(rk)
    ring = torch.randn(B, H_KV, RING, D, dtype=DTYPE, device=dev)
    lens = torch.tensor([[tokens - RING, 5]] * B, dtype=torch.int32, device=dev)
    ring_index = torch.full((B,), 5, dtype=torch.int32, device=dev)
    return stores, idx, rk, rv, ring, lens, ring_index


def pinned_bandwidths() -> dict:
    dev = torch.device("cuda")
    n = 256 * 2**20
    src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    copy_ms = median_ms(lambda: dst.copy_(src, non_blocking=True), warmup=3, rep=20)
    stores, idx, rk, rv, *_ = _case(1, 65536, 2048, 1)
    gather_ms = graph_ms([lambda: recall_gather(stores[0], idx, rk, rv)])
    gather_bytes = 2 * idx.numel() * D * DTYPE.itemsize
    return {"h2d_copy_gbps": n / copy_ms / 1e6, "gather_best_gbps": gather_bytes / gather_ms / 1e6}


def bench(cases) -> List[dict]:
    rows = []
    for B, tokens, K in cases:
        stores, idx, rk, rv, ring, lens, ring_index = _case(B, tokens, K, LAYERS)
        one = graph_ms([lambda: recall_gather(stores[0], idx, rk, rv)])
        calls = []
        for store in stores:
            calls.append(lambda s=store: recall_store(s, ring, ring, lens, ring_index))
            calls.append(lambda s=store: recall_gather(s, idx, rk, rv))
        step = graph_ms([lambda: [c() for c in calls]])
        layer_bytes = 2 * B * H_KV * K * D * DTYPE.itemsize
        rows.append({"batch": B, "tokens": tokens, "k": K, "gather_layer_ms": one,
                     "gather_gbps": layer_bytes / one / 1e6,
                     "host_bytes_per_step": LAYERS * (layer_bytes + 2 * B * H_KV * D * 2),
                     "recall_step_ms": step})
        del stores
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minikv_compile.perf.bench_recall")
    ap.add_argument("--out", default=None, help="JSON file for the rows")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_recall: needs a CUDA device", file=sys.stderr)
        return 2
    bw = pinned_bandwidths()
    rows = bench(CASES)
    print(f"pinned host -> GPU: copy_ {bw['h2d_copy_gbps']:.1f} GB/s, gather kernel best "
          f"{bw['gather_best_gbps']:.1f} GB/s")
    print(f"{'B':>3} {'tokens':>7} {'K':>4} {'gather/layer us':>16} {'GB/s':>6} "
          f"{'host MB/step':>13} {'recall/step ms':>15}")
    for r in rows:
        print(f"{r['batch']:>3} {r['tokens']:>7} {r['k']:>4} {1e3 * r['gather_layer_ms']:>16.1f} "
              f"{r['gather_gbps']:>6.1f} {r['host_bytes_per_step'] / 1e6:>13.2f} "
              f"{r['recall_step_ms']:>15.3f}")
    if args.out:
        write_json(args.out, {"environment": row_environment(), "pinned": bw, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
