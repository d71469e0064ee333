"""Where a decode step's time goes: kernels of replayed steps, grouped, by total time (GPU).

    python perf/experiments/profile_decode.py [--batch 1] [--prompt 32768] [--steps 20]
        [--kivi] [--recall K] [--group-size G] [--rotation hadamard]

Builds the Llama-3.1-8B shape with random bf16 weights on the GPU, compiles MiniKV for one
request, prefills it, then profiles ``--steps`` CUDA-graph replays with ``torch.profiler`` and
prints the kernels grouped by name with their share of the step, beside the weight-read floor.
"""
from __future__ import annotations

import argparse
import sys

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=32768)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--kivi", action="store_true", help="budgets 1.0: nothing evicted")
    p.add_argument("--recall", type=int, default=0, help="SpeCache's recall_top_k (0: off)")
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--rotation", default="none", choices=("none", "hadamard"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_decode: needs CUDA", file=sys.stderr)
        return 1
    from transformers import AutoModelForCausalLM, LlamaConfig

    from minikv_compile import MiniKVConfig, minikv_compile
    from minikv_compile.ops import _gdc as gdc
    from minikv_compile.perf.measure import kernel_times

    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      max_position_embeddings=131072, rope_theta=500000.0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    budgets = dict(heavy_budget=1.0, recent_budget=1.0) if args.kivi else {}
    cm = minikv_compile(model, MiniKVConfig.preset("snapkv", max_batch_size=args.batch, max_prompt_len=args.prompt,
                                            max_new_tokens=args.steps + 8,
                                            recall_top_k=args.recall, group_size=args.group_size,
                                            rotation=args.rotation, **budgets))
    prompts = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt)).tolist()
    from minikv_compile.graphs.runtime import Request

    rt = cm.runtime
    for slot, p in enumerate(prompts):  # prefill every slot; the cache now holds the prompts
        rt.admit(slot, Request(p, args.steps + 8))
    for _ in range(3):
        rt.step()
    torch.cuda.synchronize()

    def replay():
        for _ in range(args.steps):
            rt.step()

    totals, counts = kernel_times(replay)
    step_us = sum(totals.values()) / args.steps
    floor_us = weight_bytes / 4.25e12 * 1e6
    print(f"batch {args.batch} x prompt {args.prompt}: {step_us:.0f} us of kernel time per step, "
          f"{sum(counts.values()) / args.steps:.0f} kernels per step; weight-read floor at 4.25 TB/s "
          f"{floor_us:.0f} us")
    if gdc.supported(torch.device("cuda")):
        print("(kernels launched with PDL overlap the one before them and count its tail as their "
              "own: the sum exceeds the step; MINIKV_PDL=0 gives each kernel's own duration)")
    print(f"{'us/step':>9} {'share':>6} {'n/step':>7}  kernel")
    for name, t in sorted(totals.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"{t / args.steps:9.1f} {t / args.steps / step_us:6.1%} {counts[name] / args.steps:7.1f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
