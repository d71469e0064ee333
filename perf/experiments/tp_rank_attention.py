"""Is the decode attention of one tensor-parallel rank slow because its plan leaves SMs idle?

At 4 ranks the Llama-3.1-70B shape keeps 16 query / 2 KV heads a rank. The step account at
1 x 131000 (``perf/results/h200x4/tp4_123373e/``) has the step without collectives 2.61 ms longer
than at 1 x 32768 for ~0.1 ms more bytes: what grows with the context is the attention. With 2 KV
heads at batch 1, the Triton kernel's plan (``_num_splits``: at most 64 splits, each at least 4
blocks) runs 128 programs, one per SM. This times the op (CUDA graph, L2 defeated by cache
copies, as ``bench_decode_attention``) per rank shape under the default plan, more splits, 32-token
blocks and the Gluon kernel, each checked against the default's output, and prints one table
with the time per 80 layers.

    python perf/experiments/tp_rank_attention.py [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json

import torch
import triton

from minikv_compile.ops import attention_decode as da
from minikv_compile.perf.bench_decode_attention import (ExperimentConfig, _cache, _describe,
                                                        _plan, bytes_read)
from minikv_compile.perf.measure import copy_bandwidth, graph_ms, replicas, row_environment

# (name, config): 70B at 4 ranks (16 / 2 heads) and 2 ranks (32 / 4), MiniKV keeping half the
# prompt; the 8B shape on one GPU (32 / 8) as the check that a new rule costs it nothing.
CASES = [
    ("70B/4 1x32k", ExperimentConfig(1, 16384, H_q=16, H_kv=2)),
    ("70B/4 1x131k", ExperimentConfig(1, 65536, H_q=16, H_kv=2)),
    ("70B/4 8x4k", ExperimentConfig(8, 2048, H_q=16, H_kv=2)),
    ("70B/2 1x32k", ExperimentConfig(1, 16384, H_q=32, H_kv=4)),
    ("8B/1 1x32k", ExperimentConfig(1, 16384)),
    ("8B/1 8x4k", ExperimentConfig(8, 2048)),
]


def candidates(cfg: ExperimentConfig, sms: int):
    """(label, plan) pairs: the default, the Triton kernel at more splits (pieces of at least 2
    blocks, at most MAX_SPLITS), at 32-token blocks, and the Gluon kernel."""
    base = _plan(cfg, da.SPLIT)
    out = [("default " + _plan(cfg).kernel, _plan(cfg))]
    if out[0][1] != base:
        out.append(("split", base))
    planes = cfg.B * cfg.H_kv
    want = triton.cdiv(4 * sms, planes)
    for min_blocks in (2, 1):
        n = max(1, min(want, cfg.n_quant // (min_blocks * base.block_n), da.MAX_SPLITS))
        if n != base.num_splits:
            out.append((f"split >= {min_blocks} blocks", base._replace(num_splits=n)))
    n32 = max(1, min(want, cfg.n_quant // (2 * 32), da.MAX_SPLITS))
    out.append(("split block 32", base._replace(block_n=32, num_splits=n32)))
    try:
        out.append(("fragments", _plan(cfg, da.FRAGMENTS)))
    except ValueError:
        pass
    seen = set()
    return [(label, plan) for label, plan in out if not (plan in seen or seen.add(plan))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    copy_bps = copy_bandwidth(dev)["bytes_per_s"]
    rows = []
    for name, cfg in CASES:
        scale = cfg.D ** -0.5
        q = torch.randn(cfg.B, cfg.H_q, cfg.D, dtype=torch.bfloat16, device=dev)
        caches = [_cache(cfg) for _ in range(replicas(bytes_read(cfg)))]
        expected = da.decode_attention(q, *caches[0], scale, cfg.bits, cfg.group_size)
        floor_us = bytes_read(cfg) / copy_bps * 1e6
        for label, plan in candidates(cfg, sms):
            run = da._decode_attention_triton  # (either kernel, by the plan)
            try:
                out = run(q, *caches[0], scale, cfg.bits, cfg.group_size, plan)
                err = (out.float() - expected.float()).abs().max().item()
                us = 1e3 * graph_ms([lambda c=c: run(q, *c, scale, cfg.bits, cfg.group_size,
                                                     plan) for c in caches])
            except Exception as e:  # out of resources for this plan: say so, go on
                rows.append(dict(case=name, label=label, plan=_describe(plan), error=str(e)[:200]))
                print(f"{name:14s} {label:22s} error {str(e).splitlines()[0][:80]}", flush=True)
                continue
            rows.append(dict(case=name, label=label, plan=_describe(plan), us=us,
                             floor_us=floor_us, max_abs_diff=err))
            print(f"{name:14s} {label:22s} {us:8.2f} us  x{us / floor_us:5.2f} of bytes  "
                  f"80 layers {us * 80 / 1e3:6.3f} ms  diff {err:.1e}  {_describe(plan)}",
                  flush=True)
        del caches
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(env=row_environment(), copy_bytes_per_s=copy_bps, rows=rows), f,
                      indent=1)


if __name__ == "__main__":
    main()
