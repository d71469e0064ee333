"""MiniKV kernels: Triton kernels with pure-PyTorch references, registered as ``minikv::`` ops.

This package imports nothing else of the project. Every public function here is backed by a
``torch.library`` custom op with a fake (meta) implementation, so ``torch.compile(fullgraph=True)``
traces through it; on CPU tensors the op runs its reference, on CUDA tensors the Triton kernel.
"""
from .quant import dequantize_keys, dequantize_values, quantize_keys, quantize_values
from .attention_prefill import causal_attention, selective_attention
from .attention_decode import decode_attention
from .attention_decode_recall import decode_attention_recall
from .attention_tail import tail_attention
from .attention_tail_recall import tail_attention_recall
from .cache_layout import CacheLayout, LayerBuffers
from .cache_update import cache_begin_step, cache_write_prefill, cache_write_ring
from .linear import fused_linear, rms_norm
from .recall import HostStore, recall_gather, recall_store, recall_store_rows, recall_topk
from .rotation import hadamard_heads

__all__ = [
    "quantize_keys",
    "dequantize_keys",
    "quantize_values",
    "dequantize_values",
    "selective_attention",
    "causal_attention",
    "decode_attention",
    "decode_attention_recall",
    "tail_attention",
    "tail_attention_recall",
    "CacheLayout",
    "LayerBuffers",
    "cache_begin_step",
    "cache_write_ring",
    "cache_write_prefill",
    "fused_linear",
    "rms_norm",
    "HostStore", "recall_gather", "recall_store", "recall_store_rows", "recall_topk",
    "hadamard_heads",
]
