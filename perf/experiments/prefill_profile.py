"""Where does a prompt's prefill time go, per configuration (issue 47, part 3: the "accurate"
preset's 32k prefill took 2.6x MiniKV's, 4.81 against 1.86 s on an H200)? The host copy of
recall, the rotation, the ranking, the quantization, attention, the projections?

For each method of the perf harness (``--methods``: ``minikv`` the paper's MiniKV,
``kivi-g64-hadamard-specache`` the "accurate" preset), on the Llama-3.1-8B shape with random
weights: the harness's engine runner and warm-up call, ``--repeats`` prefills as the engine
times them (``generate`` of one token: it comes from the prefill's logits), then one under
``torch.profiler``; its GPU kernels' time is
summed into categories by kernel name (``CATEGORIES``, first match; ``other`` keeps the rest,
its largest kernels listed), beside the memcpy time by direction and the host's CPU time.

    python perf/experiments/prefill_profile.py --out FILE.json [--prompt 32768]
        [--methods minikv,kivi-g64-hadamard-specache] [--repeats 3]
    python perf/experiments/prefill_profile.py --tiny --out FILE.json   # CPU plumbing check

``--tiny`` runs the tiny shape on the CPU (CPU operators instead of GPU kernels).
"""
from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict

import torch

from minikv_compile.perf import harness as H
from minikv_compile.perf.argtypes import comma_list

# (category, name pattern), first match wins: GPU kernel names (Triton kernels keep their
# function names; inductor's are triton_*; cuBLAS/CUTLASS GEMMs), and ATen names on the CPU.
CATEGORIES = (
    ("host copy", r"Memcpy|memcpy|aten::copy_|_to_copy|pin_memory"),
    ("rotation", r"hadamard|rotation"),
    ("quantization", r"quant|pack"),
    ("selection", r"selective|snapkv|h2o|topk|sort|select|pool|cumsum|scatter|gather"),
    ("attention", r"attention|attn|flash|fmha|sdpa|softmax"),
    ("projections", r"gemm|gemv|matmul|xmma|cutlass|nvjet|fused_linear|aten::mm|aten::addmm|"
                    r"aten::bmm|aten::linear"),
    ("norms, RoPE, elementwise", r"triton_|elementwise|vectorized|reduce|norm|rope|aten::"),
)


def category(name: str) -> str:
    for cat, pattern in CATEGORIES:
        if re.search(pattern, name):
            return cat
    return "other"


def profile_one(runner, prompts, device) -> dict:
    """One prefill under the profiler: per category the summed self time (GPU kernels on CUDA,
    CPU operators on the CPU), the memcpys, the host's CPU time, and the largest ``other``s."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        runner.generate(prompts, 1)
        if device.type == "cuda":
            torch.cuda.synchronize()
    by_cat, other = defaultdict(float), defaultdict(float)
    cpu_ms = 0.0
    for e in prof.key_averages():
        cpu_ms += e.self_cpu_time_total / 1e3
        ms = (e.self_device_time_total if device.type == "cuda" else e.self_cpu_time_total) / 1e3
        if ms <= 0 or (device.type == "cpu" and not e.key.startswith("aten::")):
            continue
        cat = category(e.key)
        by_cat[cat] += ms
        if cat == "other":
            other[e.key] += ms
    top_other = sorted(other.items(), key=lambda kv: -kv[1])[:8]
    return {"categories_ms": dict(sorted(by_cat.items(), key=lambda kv: -kv[1])),
            "kernel_ms": sum(by_cat.values()), "host_cpu_ms": cpu_ms,
            "other_top": [{"name": k[:120], "ms": v} for k, v in top_other]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompt", type=int, default=32768)
    ap.add_argument("--methods", default="minikv,kivi-g64-hadamard-specache",
                    type=comma_list(tuple(H.ENGINE_METHODS), "methods"),
                    help="comma list of the perf harness's engine methods")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tiny", action="store_true")
    a = ap.parse_args()
    if a.repeats < 1 or a.prompt < 2:
        raise SystemExit(f"--repeats >= 1 and --prompt >= 2 expected, got {a.repeats}, {a.prompt}")
    device = torch.device("cpu" if a.tiny else "cuda")
    dtype = torch.float32 if a.tiny else torch.bfloat16
    shape, prompt = ("tiny", min(a.prompt, 192)) if a.tiny else ("llama3.1-8b", a.prompt)
    model = H.build_model(shape, device, dtype)
    prompts = H.make_prompts(1, prompt, min(1000, model.config.vocab_size))
    rows = []
    for method in a.methods:
        runner = H.EngineRunner(model, method, batch=1, prompt_len=prompt, new_tokens=2)
        H.warm_call(runner, prompts, 1)
        times = [runner.generate(prompts, 1).prefill_s for _ in range(a.repeats)]
        row = {"method": method, "prompt": prompt, "prefill_s": times,
               **profile_one(runner, prompts, device)}
        rows.append(row)
        print(f"{method}: prefill {min(times):.3f} s (best of {a.repeats}); kernels "
              f"{row['kernel_ms']:.1f} ms, host CPU {row['host_cpu_ms']:.1f} ms; " + ", ".join(
                  f"{k} {v:.1f}" for k, v in row["categories_ms"].items()), flush=True)
        runner.close()
        H.release()
    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "shape": shape}
    with open(a.out, "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
