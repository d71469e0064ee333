"""minikv_compile: MiniKV-compressed KV cache + a compiled, CUDA-graph-replayed decode loop.

    compiled_model = minikv_compile(model, MiniKVConfig(heavy_budget=0.25, recent_budget=0.25))
    out = compiled_model.generate(input_ids, max_new_tokens=256)
    cache = compiled_model.cache_prompt([doc])       # compress once, ask many times
    out = compiled_model.generate([doc + question], past_key_values=cache)
"""
from .config import MiniKVConfig
from .engine import GenerationOutput, MiniKVModel, minikv_compile
from .prompt_cache import PromptCache
from minikv_compile.graphs.cache import KVMemoryReport

__all__ = ["minikv_compile", "MiniKVConfig", "MiniKVModel", "GenerationOutput", "KVMemoryReport",
           "PromptCache"]
