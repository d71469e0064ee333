"""minikv_compile: MiniKV-compressed KV cache + a compiled, CUDA-graph-replayed decode loop.

    compiled_model = minikv_compile(model, MiniKVConfig(heavy_budget=0.25, recent_budget=0.25))
    out = compiled_model.generate(input_ids, max_new_tokens=256)
"""
from .config import MiniKVConfig
from .engine import GenerationOutput, MiniKVModel, minikv_compile
from minikv_compile.graphs.cache import KVMemoryReport

__all__ = ["minikv_compile", "MiniKVConfig", "MiniKVModel", "GenerationOutput", "KVMemoryReport"]
