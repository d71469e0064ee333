"""Device experiment: the "half2" Triton decode-attention kernel at the engine's short rows
(batch 8 x 2k and batch 1 x 16k quantized tokens: ~1000 blocks of 128 tokens each), over
programs of fewer warps and tokens x NUM_SPLITS, each beside the default launch on the same
caches (bf16, bits 2, full ring).

    cd /tmp/run && python /path/to/perf/gpu/short_rows_sweep.py         # after perf/gpu/check.sh

Why: at these rows the default (4 warps, 64 tokens a block, ~5 programs per SM, a handful of
blocks each) is issue-bound at ~35% of the issue slots (``ncu_decode_attention_b8_2k_*.txt``):
its softmax reduces over tokens across the 4 warps (shared memory, a barrier per block). One-
or two-warp programs reduce within a warp and fit more programs per SM.
"""
import argparse
import importlib

import torch

from minikv_compile.perf.bench_decode_attention import (
    ExperimentConfig, _cache, _graph_ms, _replicas, bytes_read)

da = importlib.import_module("minikv_compile.ops.decode_attention")

# (block_n, num_warps, maxnreg; 0 = none)
LAUNCHES = [(16, 1, 0), (32, 1, 0), (32, 2, 0), (64, 2, 0), (32, 1, 128), (64, 4, 96)]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="8x2048,1x16384")
    p.add_argument("--splits", default="8,16,32,48,64,96,128")
    p.add_argument("--launches", default=None,
                   help="BLOCK_NxWARPSxMAXNREG list (e.g. 64x4x96) instead of LAUNCHES")
    p.add_argument("--repeat", type=int, default=1, help="time each launch this many times")
    p.add_argument("--lens", default=None,
                   help="QUANT:RING list (e.g. 2048:128,2048:0,0:128): time the default launch "
                        "with every slot holding that many tokens (the capacity stays the case's)")
    args = p.parse_args()
    launches = ([tuple(int(v) for v in item.split("x")) for item in args.launches.split(",")]
                if args.launches else LAUNCHES)
    for case in args.cases.split(","):
        batch, tokens = (int(x) for x in case.split("x"))
        cfg = ExperimentConfig(batch, tokens, 2)
        caches = [_cache(cfg) for _ in range(_replicas(bytes_read(cfg)))]
        q = torch.randn(cfg.B, cfg.H_q, cfg.D, dtype=torch.bfloat16, device="cuda")
        scale = cfg.D ** -0.5

        def run(c, **kw):
            return da._decode_attention_triton(q, *c, scale, 2, 16, dequant="half2", **kw)

        def time(**kw):
            calls = [lambda c=c: run(c, **kw) for c in caches]
            calls[0]()
            torch.cuda.synchronize()
            return _graph_ms(calls)

        base = time()
        ref = run(caches[0]).float()
        print(f"{cfg.name}: default half2 {base * 1e3:.1f} us", flush=True)
        if args.lens:
            full = caches[0][-1].clone()
            for item in args.lens.split(","):
                n_quant, n_ring = (int(v) for v in item.split(":"))
                for c in caches:
                    c[-1].copy_(torch.tensor([n_quant, n_ring], dtype=torch.int32))
                print(f"   lens {n_quant}:{n_ring}: {time() * 1e3:6.1f} us", flush=True)
            for c in caches:
                c[-1].copy_(full)
            continue
        for block_n, warps, cap in launches:
            for n in [int(s) for s in args.splits.split(",")] * args.repeat:
                kw = dict(block_n=block_n, num_warps=warps, maxnreg=cap, num_splits=n)
                try:
                    ms = time(**kw)
                    diff = (run(caches[0], **kw).float() - ref).abs().max().item()
                except Exception as e:  # noqa: BLE001 - a launch that does not compile
                    print(f"   {kw}: failed {type(e).__name__}: {str(e)[:100]}", flush=True)
                    break
                print(f"   {kw}: {ms * 1e3:6.1f} us  {base / ms:.2f}x default  "
                      f"max |out - default| {diff:.1e}", flush=True)
        del caches
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
