"""Weight fusion of a Llama-family layer: [q; k; v] and [gate; up] as one matrix each
(``fuse_layer``, undone by ``unfuse_layer``), and whether a layer's norms and MLP are the ones
``ops.fused_linear`` computes (``fusable``).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import nn

# The norms whose forward is ``weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype)``,
# what ``ops.fused_linear`` computes in front of a projection (and ``ops.rms_norm`` on its own).
PLAIN_RMSNORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


def fusable(block: nn.Module, config) -> bool:
    """The layer's norms are plain RMSNorms and its MLP is ``down(silu(gate) * up)``."""
    norms = (block.input_layernorm, block.post_attention_layernorm)
    plain = all(type(n).__name__ in PLAIN_RMSNORMS and hasattr(n, "variance_epsilon")
                for n in norms)
    return plain and getattr(config, "hidden_act", None) in ("silu", "swish")


def fuse_layer(block: nn.Module) -> dict:
    """Concatenate [q; k; v] and [gate; up] weights (and biases) of one layer, in place.

    Decoding at small batch reads every weight once per token; one GEMV over the concatenated
    matrix replaces three (two) launches, and the small k/v GEMVs no longer run far under the
    bandwidth. The modules' own parameters are re-pointed at slices of the fused tensors, so the
    model keeps working unchanged and no weight is stored twice (``unfuse_layer`` undoes it).
    ``shared``: the layer was fused already (an earlier engine on the same model) and its
    tensors are taken as they are: a second engine stores no weight twice either (a copy did
    not fit beside a Llama-3.1-70B shard of 66.7 GiB on an 80 GB H100).
    """
    attn, mlp = block.self_attn, block.mlp
    qkv, qkv_shared = _concat_linears([attn.q_proj, attn.k_proj, attn.v_proj])
    gate_up, _ = _concat_linears([mlp.gate_proj, mlp.up_proj])
    return {"qkv": qkv, "gate_up": gate_up, "shared": qkv_shared}


def unfuse_layer(block: nn.Module) -> None:
    """Undo ``fuse_layer`` on one layer: every q/k/v and gate/up module gets weights (and biases)
    of its own again."""
    attn, mlp = block.self_attn, block.mlp
    for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
        m.weight.data = m.weight.data.clone()
        if m.bias is not None:
            m.bias.data = m.bias.data.clone()


def _concat_linears(linears) -> Tuple[Tuple[torch.Tensor, Optional[torch.Tensor]], bool]:
    """((weight, bias), shared): the linears' rows concatenated; ``shared`` when they already
    were consecutive rows of one tensor, which is then returned as a view, not copied."""
    has_bias = [m.bias is not None for m in linears]
    if any(has_bias) and not all(has_bias):
        raise NotImplementedError("expected all or none of the fused projections to have a bias")
    weights = [m.weight.data for m in linears]
    biases = [m.bias.data for m in linears] if all(has_bias) else None
    weight, bias = _joined(weights), None if biases is None else _joined(biases)
    if weight is not None and (biases is None or bias is not None):
        return (weight, bias), True
    weight, bias = torch.cat(weights), None if biases is None else torch.cat(biases)
    row = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight.data = weight[row: row + n]
        if bias is not None:
            m.bias.data = bias[row: row + n]
        row += n
    return (weight, bias), False


def _joined(parts: List[torch.Tensor]) -> Optional[torch.Tensor]:
    """The tensor whose consecutive rows ``parts`` are (contiguous, in order, in one storage),
    as a view; None if they are not."""
    first = parts[0]
    offset = first.storage_offset()
    for t in parts:
        if (not t.is_contiguous() or t.shape[1:] != first.shape[1:] or t.dtype != first.dtype
                or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or t.storage_offset() != offset):
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in parts)
    return first.as_strided((rows,) + tuple(first.shape[1:]), first.stride(),
                            first.storage_offset())


__all__ = ["PLAIN_RMSNORMS", "fusable", "fuse_layer", "unfuse_layer"]
