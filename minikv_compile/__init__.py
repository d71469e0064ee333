"""minikv_compile: a compressed KV cache + a compiled, CUDA-graph-replayed decode loop.

    compiled_model = minikv_compile(model)                      # MiniKVConfig(): 2 bit + recall
    compiled_model = minikv_compile(model, MiniKVConfig.preset("minikv"))  # the MiniKV paper's
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
