"""The demo's question (1 Kings 10:22 in Proverbs, at 30% depth) answered through the engine by
the configurations that evict under recall, beside the presets, on the CPU (fp32).
Usage: python demo_configs.py CONTEXT_TOKENS [names]"""
import sys, time, torch
from minikv_compile import MiniKVConfig, minikv_compile
from minikv_compile.models.smollm2 import load_smollm2
from minikv_compile.demo import build_needle_prompt, answer_is_right
model, tok = load_smollm2(dtype=torch.float32, device="cpu")
p = build_needle_prompt(tok, int(sys.argv[1]))
common = dict(max_batch_size=1, max_prompt_len=len(p.input_ids), max_new_tokens=48)
g64h = dict(group_size=64, rotation="hadamard", recall_top_k=64)
cfgs = {"accurate_g64": dict(heavy_budget=1.0, recent_budget=1.0, **g64h),
        "kept85_g64h": dict(heavy_budget=0.425, recent_budget=0.425, **g64h),
        "kept70_g64h": dict(heavy_budget=0.35, recent_budget=0.35, **g64h),
        "default_h_k64": dict(rotation="hadamard", recall_top_k=64),
        "default": dict()}
names = sys.argv[2].split(",") if len(sys.argv) > 2 else list(cfgs)
print(f"# CPU fp32, prompt {len(p.input_ids)} tokens, torch {torch.__version__}", flush=True)
for name in names:
    t = time.time()
    cm = minikv_compile(model, MiniKVConfig(**cfgs[name], **common))
    out = cm.generate([p.input_ids], max_new_tokens=48, eos_token_id=tok.eos_token_id)
    a = tok.decode(out.sequences[0], skip_special_tokens=True).strip()
    print(f"{name:14s} {answer_is_right(a, p.expected)!s:5s} {time.time()-t:5.1f}s {a!r}", flush=True)
    del cm
