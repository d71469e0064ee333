"""Device experiment: the "fragments" decode-attention kernel at register caps (none, 200, 168)
x NUM_SPLITS halved, default and doubled, each beside the default "half2" Triton kernel on the
same caches (bf16, bits 2).

    cd /tmp/run && python /path/to/perf/gpu/fragments_sweep.py   # after perf/gpu/check.sh

Prints one line per (case, splits); results under ``perf/results/h200/fragments_sweep_*.txt``.
"""
import importlib

import torch

from minikv_compile.perf.bench_decode_attention import (
    ExperimentConfig, _cache, _graph_ms, _replicas, bytes_read)

da = importlib.import_module("minikv_compile.ops.decode_attention")

CASES = [ExperimentConfig(8, 16384, 2), ExperimentConfig(1, 16384, 2),
         ExperimentConfig(1, 131072, 2), ExperimentConfig(8, 4096, 2),
         ExperimentConfig(32, 16384, 2), ExperimentConfig(64, 16384, 2)]


def main():
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    for cfg in CASES:
        nbytes = bytes_read(cfg)
        caches = [_cache(cfg) for _ in range(_replicas(nbytes))]
        q = torch.randn(cfg.B, cfg.H_q, cfg.D, dtype=torch.bfloat16, device="cuda")
        scale = cfg.D ** -0.5

        def time(**kw):
            calls = [lambda c=c: da._decode_attention_triton(q, *c, scale, 2, 16, **kw)
                     for c in caches]
            calls[0]()
            torch.cuda.synchronize()
            return _graph_ms(calls)

        base = time(dequant="half2")
        ref = da._decode_attention_triton(q, *caches[0], scale, 2, 16).float()
        splits = da._splits(True, cfg.B, cfg.H_kv, cfg.n_quant, 64, sm)
        print(f"{cfg.name}: half2 {base * 1e3:.1f} us; fragments, default splits {splits}:",
              flush=True)
        for cap in (None, 200, 168):
            for n in sorted({max(1, splits // 2), splits, min(128, splits * 2)}):
                ms = time(dequant="fragments", num_splits=n, maxnreg=cap)
                out = da._decode_attention_triton(q, *caches[0], scale, 2, 16, dequant="fragments",
                                                  num_splits=n, maxnreg=cap).float()
                print(f"   maxnreg {cap} splits {n:3d}: {ms * 1e3:7.1f} us  {base / ms:.2f}x "
                      f"half2  {nbytes / (ms * 1e-3) / 1e12:.2f} TB/s  "
                      f"max |out - half2| {(out - ref).abs().max().item():.1e}", flush=True)
        del caches
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
