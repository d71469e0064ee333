"""Is the bucket-32 decode step faster on ``fused_linear`` (tiles of 32 rows) than on the GEMM plan?

    python perf/experiments/fused_rows.py --out FILE.json [--fused-max-rows 32]
        [--live 24 --context 8192 --slots 32]

While 32k prompts are admitted the serving benchmark's streams run at buckets 16-32 with 8-16k
token contexts, and the long phase's ITL median is those steps (``perf/NOTES.md``, "Serving on
the H100"). Steps of up to ``graphs.step_plan.FUSED_MAX_ROWS`` rows run each projection as one
``fused_linear`` launch; above it, cuBLAS GEMMs with inductor's kernels around them. This builds
the Llama-3.1-8B shape (random bf16), admits ``--live`` slots of ``--context`` tokens into an
engine of ``--slots`` slots and times the replayed step of their bucket by CUDA events, with
``FUSED_MAX_ROWS`` set to ``--fused-max-rows`` before the engine is built (``--recall K``:
SpeCache's step, two rows a slot). Run each value in a
process of its own with its own ``TORCHINDUCTOR_CACHE_DIR`` (the saved compiled layer of one plan
must not be loaded by the other).
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="llama3.1-8b")
    p.add_argument("--live", type=int, default=24)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--fused-max-rows", type=int, default=None)
    p.add_argument("--profile", action="store_true", help="also the step's kernels by time")
    p.add_argument("--recall", type=int, default=0,
                   help="SpeCache's recall_top_k on KIVI's cache (two rows a slot); 0: off")
    a = p.parse_args()

    from minikv_compile import MiniKVConfig, minikv_compile
    from minikv_compile.graphs.runtime import Request, engine_mode
    from minikv_compile.graphs import step_plan
    from minikv_compile.perf import harness as H

    if a.fused_max_rows is not None:
        step_plan.FUSED_MAX_ROWS = a.fused_max_rows
    dev = torch.device("cuda")
    model = H.build_model(a.model, dev, torch.bfloat16)
    recall = (dict(heavy_budget=1.0, recent_budget=1.0, recall_top_k=a.recall) if a.recall
              else {})
    cfg = MiniKVConfig.preset("snapkv", max_batch_size=a.slots, max_prompt_len=a.context, max_new_tokens=1024,
                       **recall)
    engine = minikv_compile(model, cfg)
    rt = engine.runtime
    with engine_mode():
        for slot, prompt in enumerate(H.make_prompts(a.live, a.context, model.config.vocab_size)):
            rt.admit(slot, Request(prompt.tolist(), 1024))
        key = rt.step_key()
        bucket = key[0]
        rt.prepare(*key)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(a.steps)]
        for _ in range(10):
            rt.runner.run(key)
        torch.cuda.synchronize()
        for e0, e1 in events:
            e0.record()
            rt.runner.run(key)
            e1.record()
        torch.cuda.synchronize()
        kernels = None
        if a.profile:
            from minikv_compile.perf.measure import kernel_times

            totals, counts = kernel_times(lambda: [rt.runner.run(key) for _ in range(20)])
            kernels = [(round(t / 20, 1), counts[n] / 20, n[:120])
                       for n, t in sorted(totals.items(), key=lambda kv: -kv[1])[:25]]
    times = sorted(e0.elapsed_time(e1) for e0, e1 in events)
    stats = engine.stats
    result = {"model": a.model, "live": a.live, "context": a.context, "slots": a.slots,
              "bucket": bucket, "recall_top_k": a.recall,
              "fused_max_rows": step_plan.FUSED_MAX_ROWS,
              "plan": stats["kernels"][key], "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__,
              "step_ms": {"p50": round(statistics.median(times), 3),
                          "p10": round(times[len(times) // 10], 3),
                          "p90": round(times[9 * len(times) // 10], 3)},
              "compiles": stats["compiles"], "replays": stats["replays"],
              "kernels_us_per_step": kernels}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
