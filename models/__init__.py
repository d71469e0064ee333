"""Adapters from HF causal-LM architectures to what the engine needs, keyed by model_type."""
from __future__ import annotations

from torch import nn

from .checkpoint import load_shard
from .llama import LlamaFamilyAdapter
from .parallel import TensorParallel, shard_model

# model_type -> adapter class. SmolLM2 is a Llama ("llama"); Mistral without a sliding window.
ADAPTERS = {
    "llama": LlamaFamilyAdapter,
    "mistral": LlamaFamilyAdapter,
    "qwen2": LlamaFamilyAdapter,
    "qwen3": LlamaFamilyAdapter,
}

SUPPORTED_MODEL_TYPES = tuple(sorted(ADAPTERS))


def get_adapter(model: nn.Module, max_positions: int, fuse_projections: bool = False,
                tp: TensorParallel = TensorParallel()) -> LlamaFamilyAdapter:
    """The adapter for ``model`` (an HF ``*ForCausalLM``), or ``NotImplementedError``.

    ``fuse_projections`` concatenates q/k/v and gate/up weights in place (``fusion.py``);
    ``tp`` of several ranks shards the model in place to this rank's share (``shard_model``,
    unless it is that shard already; ``ValueError`` when its heads or features do not divide
    by the ranks).
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in ADAPTERS:
        raise NotImplementedError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if not (hasattr(model, "model") and hasattr(model, "lm_head")):
        raise NotImplementedError(
            f"expected a *ForCausalLM with .model and .lm_head, got {type(model).__name__}"
        )
    return ADAPTERS[model_type](model, max_positions, fuse_projections, tp)


__all__ = ["ADAPTERS", "SUPPORTED_MODEL_TYPES", "get_adapter", "LlamaFamilyAdapter",
           "TensorParallel", "load_shard", "shard_model"]
