"""Device experiment: the "fragments" decode-attention kernel over register caps x NUM_SPLITS,
each beside the default "half2" Triton kernel on the same caches (bf16, bits 2).

    cd /tmp/run && python /path/to/perf/gpu/fragments_sweep.py   # after perf/gpu/check.sh

Wraps the Gluon kernel's launch to add ``maxnreg``; prints one line per (cap, splits). Results:
``perf/results/h200/fragments_sweep_maxnreg_splits.txt``.
"""
import importlib

import torch

from minikv_compile.perf.bench_decode_attention import (
    ExperimentConfig, _cache, _graph_ms, _replicas, bytes_read)

da = importlib.import_module("minikv_compile.ops.decode_attention")
dag = da.dag
kernel = dag._decode_attention_fragments_kernel


class Capped:
    """Stands in for the kernel: ``[grid](...)`` launches it with ``maxnreg`` added."""

    def __init__(self, maxnreg):
        self.maxnreg = maxnreg

    def __getitem__(self, grid):
        launch = kernel[grid]
        return lambda *a, **k: launch(*a, **({**k, "maxnreg": self.maxnreg}
                                             if self.maxnreg else k))


def main():
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    for cfg in [ExperimentConfig(8, 16384, 2), ExperimentConfig(1, 16384, 2),
                ExperimentConfig(1, 131072, 2), ExperimentConfig(64, 16384, 2)]:
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
        print(f"{cfg.name}: half2 {base * 1e3:.1f} us, default fragments splits {splits}",
              flush=True)
        for cap in (None, 168, 128):
            dag._decode_attention_fragments_kernel = Capped(cap)
            for n in sorted({max(1, splits // 2), splits, splits * 2, min(128, splits * 4)}):
                ms = time(dequant="fragments", num_splits=n)
                out = da._decode_attention_triton(q, *caches[0], scale, 2, 16,
                                                  dequant="fragments", num_splits=n).float()
                print(f"   maxnreg {cap} splits {n:3d}: {ms * 1e3:7.1f} us  {base / ms:.2f}x "
                      f"half2  {nbytes / (ms * 1e-3) / 1e12:.2f} TB/s  "
                      f"diff {(out - ref).abs().max().item():.1e}", flush=True)
            dag._decode_attention_fragments_kernel = kernel
        del caches
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
