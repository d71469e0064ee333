"""Device experiment: the "fragments" decode-attention kernel over register caps x NUM_SPLITS,
each beside the default "half2" Triton kernel on the same caches (bf16, bits 2, full ring).

    cd /tmp/run && python /path/to/perf/gpu/fragments_sweep.py            # after perf/gpu/check.sh
    python fragments_sweep.py --cases 1x16384,8x2048 --splits auto,64,128 --caps 224

``--cases`` are BATCHxQUANTIZED_TOKENS; ``--splits`` entries are numbers or "auto" (the launcher's
rule), "half", "double" (of auto); ``--caps`` are register caps, 0 = none. Prints one line per
(case, cap, splits); ``--profile`` adds each kernel's mean duration (``torch.profiler``, 24 eager
calls) for half2 and fragments at the default splits. Results under ``perf/results/h200/fragments_sweep_*.txt``.
"""
import argparse
import importlib
import json

import torch

from minikv_compile.perf._bench import kernel_times
from minikv_compile.perf.bench_decode_attention import (
    ExperimentConfig, _cache, _graph_ms, _replicas, bytes_read)

da = importlib.import_module("minikv_compile.ops.decode_attention")

CASES = "8x16384,1x16384,1x131072,8x4096,32x16384,64x16384"


def _split_values(spec: str, auto: int) -> list:
    named = {"auto": auto, "half": max(1, auto // 2), "double": min(128, 2 * auto)}
    return sorted({named[s] if s in named else int(s) for s in spec.split(",")})


def _kernel_us(fns, calls: int = 24) -> str:
    """Mean device time per call of each kernel the calls launch, as 'name us, ...'; ``fns``
    (one per cache copy) are called in turn, so that each reads from HBM."""
    fns[0]()
    torch.cuda.synchronize()
    totals, _ = kernel_times(lambda: [fns[i % len(fns)]() for i in range(calls)], 40)
    return ", ".join(f"{name} {t / calls:.1f} us" for name, t in totals.items())


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=CASES)
    p.add_argument("--splits", default="half,auto,double")
    p.add_argument("--caps", default="0,200,168")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--kw", default="{}", help="JSON: more keyword arguments of the fragments calls")
    args = p.parse_args()
    extra = json.loads(args.kw)
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    for case in args.cases.split(","):
        batch, tokens = (int(x) for x in case.split("x"))
        cfg = ExperimentConfig(batch, tokens, 2)
        nbytes = bytes_read(cfg)
        caches = [_cache(cfg) for _ in range(_replicas(nbytes))]
        q = torch.randn(cfg.B, cfg.H_q, cfg.D, dtype=torch.bfloat16, device="cuda")
        scale = cfg.D ** -0.5

        def run(c, **kw):
            return da._decode_attention_triton(q, *c, scale, 2, 16, **kw)

        def time(**kw):
            calls = [lambda c=c: run(c, **kw) for c in caches]
            calls[0]()
            torch.cuda.synchronize()
            return _graph_ms(calls)

        base = time(dequant="half2")
        ref = run(caches[0], dequant="half2").float()
        auto = da._splits(True, cfg.B, cfg.H_kv, cfg.n_quant, 64, sm)
        print(f"{cfg.name}: half2 {base * 1e3:.1f} us; fragments {extra}, default splits {auto}:",
              flush=True)
        for cap in (int(c) for c in args.caps.split(",")):
            for n in _split_values(args.splits, auto):
                ms = time(dequant="fragments", num_splits=n, maxnreg=cap, **extra)
                out = run(caches[0], dequant="fragments", num_splits=n, maxnreg=cap,
                          **extra).float()
                print(f"   maxnreg {cap or None} splits {n:3d}: {ms * 1e3:7.1f} us  {base / ms:.2f}x "
                      f"half2  {nbytes / (ms * 1e-3) / 1e12:.2f} TB/s  "
                      f"max |out - half2| {(out - ref).abs().max().item():.1e}", flush=True)
        if args.profile:
            for dequant in ("half2", "fragments"):
                print(f"   kernels ({dequant}): {_kernel_us([lambda c=c: run(c, dequant=dequant) for c in caches])}")
        del caches
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
