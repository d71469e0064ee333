"""Decode attention as the server runs it: a bucket of slots, some empty, the live ones holding
fewer tokens than the capacity the plan was chosen for. Which split count is fastest?

    python perf/experiments/serving_splits.py --out FILE.json [--cases 32:24:4096:16896,...]

A case is ``bucket:live:kept:capacity`` (Llama-3.1-8B attention: 32 / 8 heads, D 128, bf16,
2-bit group 16, 64 ring tokens a live slot). The serving benchmark's engine (64 slots, 32k
prompts, 512 new tokens, 50% kept) has a capacity of ~16.9k quantized tokens, while its streams
hold 1-8k of them; ``_plan`` splits by the capacity, the kernels by each slot's own length. Each
case times the default plan, then both kernels at a sweep of split counts, every call a CUDA
graph replay cycling cache copies so that reads come from HBM (``measure.graph_ms``).
"""
from __future__ import annotations

import argparse
import json

import torch

from minikv_compile.ops import attention_decode as da
from minikv_compile.ops._checks import sm_count
from minikv_compile.perf import bench_decode_attention as bda
from minikv_compile.perf.measure import graph_ms, replicas, row_environment

SPLITS = (1, 2, 3, 4, 5, 6, 8, 10, 13, 16, 20, 26, 32)


def _case(text: str):
    bucket, live, kept, capacity = (int(x) for x in text.split(":"))
    return bucket, live, kept, capacity


def run_case(bucket: int, live: int, kept: int, capacity: int) -> dict:
    cfg = bda.ExperimentConfig(bucket, capacity)
    ring = 64
    live_cfg = bda.ExperimentConfig(live, kept, ring=ring)
    nbytes = bda.bytes_read(live_cfg)                       # what the live slots make it read
    copies = replicas(nbytes)
    lens = torch.tensor([[kept, ring]] * live + [[0, 0]] * (bucket - live), dtype=torch.int32,
                        device="cuda")
    caches = []
    for _ in range(copies):
        c = bda._cache(cfg)
        c[8] = lens
        caches.append(c)
    q = torch.randn(bucket, cfg.H_q, cfg.D, dtype=torch.bfloat16, device="cuda")
    scale = cfg.D ** -0.5
    dev = torch.device("cuda")
    sms = sm_count(dev)

    def plan_for(kernel=None, splits=None):
        p = da._plan(dev, torch.bfloat16, 2, 16, cfg.D, bucket, cfg.H_q, cfg.H_kv, capacity, sms,
                     kernel)
        return p if splits is None else p._replace(num_splits=splits)

    ref = da._decode_attention_triton(q, *caches[0], scale, 2, 16, plan_for(da.SPLIT))

    def timed(plan):
        out = da._decode_attention_triton(q, *caches[0], scale, 2, 16, plan)
        ok = torch.allclose(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
        ms = graph_ms([lambda c=c: da._decode_attention_triton(q, *c, scale, 2, 16, plan)
                       for c in caches])
        return {"kernel": plan.kernel, "splits": plan.num_splits, "ms": round(ms, 4),
                "tb_s": round(nbytes / ms / 1e9, 3), "matches": ok}

    default = plan_for()
    rows = [dict(timed(default), default=True)]
    for kernel in (da.FRAGMENTS, da.SPLIT):
        for s in SPLITS:
            rows.append(timed(plan_for(kernel, s)))
    best = min(rows, key=lambda r: r["ms"])
    print(f"B{bucket} live {live} x {kept} cap {capacity}: default {default.kernel} "
          f"{default.num_splits} splits {rows[0]['ms']:.3f} ms ({rows[0]['tb_s']} TB/s); best "
          f"{best['kernel']} {best['splits']} {best['ms']:.3f} ms ({best['tb_s']} TB/s)",
          flush=True)
    for r in rows[1:]:
        print(f"   {r['kernel']:9s} {r['splits']:3d} {r['ms']:.3f} {r['tb_s']:.2f}"
              f"{'' if r['matches'] else '  MISMATCH'}")
    return {"bucket": bucket, "live": live, "kept": kept, "capacity": capacity,
            "bytes": nbytes, "copies": copies, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--cases", default="32:24:4096:5120,32:24:4096:16896,32:24:8192:16896,"
                                       "16:12:8192:16896,64:48:2048:16896,64:48:1024:16896")
    a = p.parse_args()
    results = [run_case(*_case(c)) for c in a.cases.split(",")]
    with open(a.out, "w") as f:
        json.dump({"environment": row_environment(), "cases": results}, f, indent=1)


if __name__ == "__main__":
    main()
