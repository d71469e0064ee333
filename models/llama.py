"""Adapter for the Llama family of HF decoders: Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2.

These share one layer shape: ``h + o_proj(attn(rope(q, k), v))`` after an RMSNorm, then
``h + mlp(norm(h))``; Qwen3 adds an RMSNorm over the head dim of q and k before RoPE, Qwen2 adds
q/k/v biases (inside the ``nn.Linear``). The adapter calls the HF modules themselves, so weights,
rope scaling (Llama 3) and norms are exactly the model's, and it never builds a KV cache of its
own: the engine owns the cache and the attention.
"""
from __future__ import annotations

import torch
from torch import nn


class LlamaFamilyAdapter:
    """What the engine needs from one HF causal LM, as plain tensor-in/tensor-out functions.

    Shapes: ``h (B, S, hidden)``, ``q (B, H_q, S, D)``, ``k, v (B, H_kv, S, D)``,
    ``cos, sin (B, S, D)``; ``S`` is the prompt length in prefill and 1 in decode.
    """

    def __init__(self, model: nn.Module, max_positions: int):
        config = model.config
        self.model = model
        self.config = config
        self.decoder = model.model
        self.layers = list(self.decoder.layers)
        self.num_layers = len(self.layers)
        self.num_q_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_q_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_q_heads
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        self.scale = float(self.layers[0].self_attn.scaling)
        self.has_qk_norm = hasattr(self.layers[0].self_attn, "q_norm")
        _check_no_sliding_window(config, max_positions)

    # -- pieces -------------------------------------------------------------------------------

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids (B, S) int64 -> h (B, S, hidden)."""
        return self.decoder.embed_tokens(input_ids)

    def rope(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B, S) int64, *logical* positions -> cos, sin (B, S, D) in h's dtype."""
        return self.decoder.rotary_emb(h, positions)

    def qkv(self, layer: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Pre-norm, projections, optional q/k norm, RoPE. Keys are returned after RoPE."""
        block = self.layers[layer]
        attn = block.self_attn
        x = block.input_layernorm(h)
        B, S, _ = x.shape
        q = attn.q_proj(x).view(B, S, self.num_q_heads, self.head_dim)
        k = attn.k_proj(x).view(B, S, self.num_kv_heads, self.head_dim)
        v = attn.v_proj(x).view(B, S, self.num_kv_heads, self.head_dim)
        if self.has_qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v

    def finish_layer(self, layer: int, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """attn_out (B, S, H_q * D) -> the layer's output h (B, S, hidden)."""
        block = self.layers[layer]
        h = h + block.self_attn.o_proj(attn_out)
        return h + block.mlp(block.post_attention_layernorm(h))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h (B, hidden) of the last position -> logits (B, vocab) in fp32."""
        return self.model.lm_head(self.decoder.norm(h)).float()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _check_no_sliding_window(config, max_positions: int) -> None:
    # A sliding window shorter than the context changes attention itself; the compressed cache
    # implements full causal attention only. A window at least as long as the context is a no-op.
    window = getattr(config, "sliding_window", None)
    uses_window = getattr(config, "use_sliding_window", window is not None)
    layer_types = getattr(config, "layer_types", None) or []
    if any(t == "sliding_attention" for t in layer_types):
        uses_window = True
    if uses_window and window is not None and window < max_positions:
        raise NotImplementedError(
            f"{config.model_type}: sliding-window attention (window {window}) is not supported; "
            f"expected no window or one >= max_prompt_len + max_new_tokens = {max_positions}"
        )
