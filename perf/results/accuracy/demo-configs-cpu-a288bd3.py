import sys, time, torch
from minikv_compile import MiniKVConfig, minikv_compile
from minikv_compile.models.smollm2 import load_smollm2
from minikv_compile.demo import build_needle_prompt, answer_is_right
dev = sys.argv[1]
cuda = dev == "cuda"
model, tok = load_smollm2(dtype=torch.bfloat16 if cuda else torch.float32, device=dev)
p = build_needle_prompt(tok, 4000 if cuda else 1500)
common = dict(max_batch_size=1, max_prompt_len=len(p.input_ids), max_new_tokens=48, compile=cuda, cuda_graphs=cuda)
cfgs = {"accurate64": dict(recall_top_k=64), "accurate128": dict(recall_top_k=128), "accurate256": dict(recall_top_k=256),
        "accurate64_had": dict(recall_top_k=64, rotation="hadamard"),
        "specache64": dict(heavy_budget=1.0, recent_budget=1.0, recall_top_k=64),
        "kivi_g64_had64": dict(heavy_budget=1.0, recent_budget=1.0, group_size=64, rotation="hadamard", recall_top_k=64),
        "kivi_g64_had64_b16": dict(heavy_budget=1.0, recent_budget=1.0, group_size=64, rotation="hadamard", recall_top_k=64, recall_block=16),
        "accurate64_b16": dict(recall_top_k=64, recall_block=16)}
names = sys.argv[2].split(",") if len(sys.argv) > 2 else list(cfgs)
cfgs = {n: cfgs[n] for n in names}
for name, c in cfgs.items():
    t = time.time()
    cm = minikv_compile(model, MiniKVConfig(**c, **common))
    out = cm.generate([p.input_ids], max_new_tokens=48, eos_token_id=tok.eos_token_id)
    a = tok.decode(out.sequences[0], skip_special_tokens=True).strip()
    print(f"{name:16s} {answer_is_right(a, p.expected)!s:5s} {time.time()-t:5.1f}s {a!r}", flush=True)
    del cm
    if cuda: torch.cuda.empty_cache()
