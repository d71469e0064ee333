"""Adapter for the Llama family of HF decoders: Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2.

These share one layer shape: ``h + o_proj(attn(rope(q, k), v))`` after an RMSNorm, then
``h + mlp(norm(h))``; Qwen3 adds an RMSNorm over the head dim of q and k before RoPE, Qwen2 adds
q/k/v biases (inside the ``nn.Linear``). The adapter calls the HF modules themselves, so weights,
rope scaling (Llama 3) and norms are exactly the model's, and it never builds a KV cache of its
own: the engine owns the cache and the attention.
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from minikv_compile import ops
from minikv_compile.ops.rotation import hadamard_matrix

from .fusion import fusable, fuse_layer, unfuse_layer
from .parallel import TensorParallel, model_heads, shard_model

# What a several-row decode step hands from one launch to the next in place of an RMSNorm:
# (norm weight * h, the sums of squares of h's rows in column blocks), see ``_norm_prologue``.
Normed = tuple[torch.Tensor, torch.Tensor]


class LayerWeights(NamedTuple):
    """One decoder layer as arguments, so that one compiled step serves every layer: nothing in
    it is looked up by a layer index (which a compiler would bake in, one graph per layer).

    block: the HF decoder layer (its norms, projections, q/k norms and MLP, called as they are).
    qkv, gate_up: the fused ``[q; k; v]`` and ``[gate; up]`` (weight, bias), or None (unfused).
    v: the rotated v_proj (weight, bias) of the unfused path, or None (no rotation, or fused).
    o: o_proj's (weight, bias): the rotated copy, or the module's own.
    next_norm: the next layer's input-norm weight, whose share a split-norm step hands on
        (``DecodePath.split_norm``); None for the last layer.
    """

    block: nn.Module
    qkv: Optional[tuple]
    gate_up: Optional[tuple]
    v: Optional[tuple]
    o: tuple
    next_norm: Optional[torch.Tensor]


class DecodePath(NamedTuple):
    """How a decode step's layer runs, as the step's plan decided it (``graphs/step_plan.py``,
    ``StepPlan``): ``fused_linear``, each projection one ``ops.fused_linear`` launch with the
    norm or SiLU-gate before it and the residual add or RoPE after it (else GEMMs with those
    around them); ``split_norm``, each RMSNorm split over the launch before it and the
    projection after it (``_norm_prologue``); and each projection's launch
    (``ops.linear.launch_tensor``; None on the GEMM path)."""

    fused_linear: bool
    split_norm: bool
    qkv: Optional[torch.Tensor] = None
    o: Optional[torch.Tensor] = None
    gate_up: Optional[torch.Tensor] = None
    down: Optional[torch.Tensor] = None


class LlamaFamilyAdapter:
    """What the engine needs from one HF causal LM, as plain tensor-in/tensor-out functions.

    Shapes: ``h (B, S, hidden)``, ``q (B, H_q, S, D)``, ``k, v (B, H_kv, S, D)``,
    ``cos, sin (B, S, D)``; ``S`` is the prompt length in prefill and 1 in decode.

    Tensor parallel (``tp`` of ``N > 1`` ranks, ``models/parallel.py``): the model's modules are
    sharded in place (``shard_model``, unless the model is this rank's shard already) and
    ``num_q_heads`` / ``num_kv_heads`` are this rank's (``H_q / N``, ``H_kv / N``); ``h`` stays
    whole (every rank holds the residual stream), the logits are gathered to the whole
    ``vocab_size``.
    """

    # Prefill runs the fused q/k/v projection (with its norm), o_proj and the MLP over this many
    # tokens at a time: the MLP's intermediate activations (L x 14336 x 3 bf16 for an 8B model:
    # 2.6 GB at 32k) and the input norm's fp32 copy of h (4 GiB at 131k tokens of the 70B
    # width, which did not fit beside its 66.7 GiB shard on an 80 GB H100) are what limit the
    # longest prompt otherwise, and every op there is per token, so chunking changes no result.
    prefill_chunk = 8192

    def __init__(self, model: nn.Module, max_positions: int, fuse_projections: bool = False,
                 tp: TensorParallel = TensorParallel()):
        config = model.config
        self.model = model
        self.config = config
        self.decoder = model.model
        self.layers = list(self.decoder.layers)
        self.num_layers = len(self.layers)
        self.num_q_heads, self.num_kv_heads, self.head_dim = model_heads(config)
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        self.scale = float(self.layers[0].self_attn.scaling)
        self.has_qk_norm = hasattr(self.layers[0].self_attn, "q_norm")
        _check_no_sliding_window(config, max_positions)
        self.tp = tp
        shard = getattr(model, "minikv_shard", None)
        if tp.world > 1 and shard is None:
            shard_model(model, tp)
        elif shard is not None and shard != (tp.rank, tp.world):
            raise ValueError(f"model: expected a whole model or the shard of rank {tp.rank} of "
                             f"{tp.world}, got the shard of rank {shard[0]} of {shard[1]}")
        self.num_q_heads //= tp.world
        self.num_kv_heads //= tp.world
        # Fused [q; k; v] and [gate; up] weights per layer (None: use the modules one by one).
        self.fused = [fuse_layer(block) for block in self.layers] if fuse_projections else None
        # Decode steps may run each projection as one ``ops.fused_linear`` launch with the norm
        # before it and the residual add, RoPE or SiLU-gate after it (their plan decides).
        self.fused_decode = self.fused is not None and fusable(self.layers[0], config)
        # ``rotate_heads("hadamard")``: H (D, D) fp32, and per layer the folded v_proj (CPU path;
        # the fused path holds it in its [q; k; v]) and o_proj weights. None: no rotation.
        self.hadamard: Optional[torch.Tensor] = None
        self.rotated_v: Optional[List[tuple]] = None
        self.rotated_o: Optional[List[tuple]] = None

    def rotate_heads(self, rotation: str) -> None:
        """Rotate every head's q, k and v by an orthonormal Hadamard matrix ``H`` (D x D).

        ``q H`` and ``k H`` after RoPE in ``qkv`` (scores unchanged: ``q H (k H)^T = q k^T``);
        ``v H`` folded into v_proj (rows of each KV head: ``H^T W_h``, bias ``b_h H``) and the
        attention output's rotation back folded into o_proj (columns of each query head:
        ``W_o,h H``), so decode pays nothing for V. The user's modules are never written: the
        folded weights are the adapter's own copies (on the fused path v's rows of the fused
        [q; k; v], whose v_proj module gets its original rows back as a tensor of its own;
        a [q; k; v] shared with an earlier engine is copied first, and that engine's left alone).
        Extra memory: one v_proj and one o_proj per layer (and the copied [q; k; v]).
        """
        if rotation == "none":
            return
        D = self.head_dim
        H = hadamard_matrix(D, device=self.layers[0].self_attn.o_proj.weight.device)
        self.hadamard = H
        self.rotated_v, self.rotated_o = [], []
        nq, nkv = self.num_q_heads * D, self.num_kv_heads * D
        with torch.no_grad():
            for layer, block in enumerate(self.layers):
                attn = block.self_attn
                w, b = attn.v_proj.weight, attn.v_proj.bias
                v_w = (H.T @ w.float().view(self.num_kv_heads, D, -1)).reshape(nkv, -1).to(w.dtype)
                v_b = None if b is None else (b.float().view(-1, D) @ H).reshape(-1).to(b.dtype)
                o = attn.o_proj
                o_w = (o.weight.float().view(-1, self.num_q_heads, D) @ H).reshape(-1, nq)
                self.rotated_o.append((o_w.to(o.weight.dtype), o.bias))
                if self.fused is None:
                    self.rotated_v.append((v_w, v_b))
                    continue
                fw, fb = self.fused[layer]["qkv"]
                if self.fused[layer]["shared"]:  # another engine's [q; k; v]: rotate a copy
                    fw, fb = fw.clone(), None if fb is None else fb.clone()
                    self.fused[layer]["qkv"] = (fw, fb)
                else:
                    attn.v_proj.weight.data = fw[nq + nkv:].clone()
                    if fb is not None:
                        attn.v_proj.bias.data = fb[nq + nkv:].clone()
                fw[nq + nkv:] = v_w
                if fb is not None:
                    fb[nq + nkv:] = v_b

    def unfuse(self) -> None:
        """Undo ``fuse_layer``: every q/k/v and gate/up module gets weights (and biases) of its
        own again, and the fused tensors are dropped. Decode then runs the modules one by one."""
        if self.fused is None:
            return
        for block in self.layers:
            unfuse_layer(block)
        if self.hadamard is not None:  # the folded v rows lived in the fused [q; k; v] only
            nv = self.num_kv_heads * self.head_dim
            self.rotated_v = [(w[-nv:].clone(), None if b is None else b[-nv:].clone())
                              for w, b in (f["qkv"] for f in self.fused)]
        self.fused, self.fused_decode = None, False

    # -- pieces -------------------------------------------------------------------------------

    def layer_weights(self, layer: int) -> LayerWeights:
        """Layer ``layer``'s modules and weights, as the arguments of ``qkv`` and ``_finish``."""
        block = self.layers[layer]
        o = block.self_attn.o_proj
        fused = {} if self.fused is None else self.fused[layer]
        last = layer + 1 == self.num_layers
        return LayerWeights(
            block=block, qkv=fused.get("qkv"), gate_up=fused.get("gate_up"),
            v=self.rotated_v[layer] if self.rotated_v else None,  # ([] on the fused path)
            o=(o.weight, o.bias) if self.rotated_o is None else self.rotated_o[layer],
            next_norm=None if last else self.layers[layer + 1].input_layernorm.weight)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids (B, S) int64 -> h (B, S, hidden)."""
        return self.decoder.embed_tokens(input_ids)

    def rope(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B, S) int64, *logical* positions -> cos, sin (B, S, D) in h's dtype."""
        return self.decoder.rotary_emb(h, positions)

    def qkv(self, layer: Union[int, LayerWeights], h: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor, normed: Optional[Normed] = None,
            path: Optional[DecodePath] = None):
        """Pre-norm, projections, optional q/k norm, RoPE. Keys are returned after RoPE.

        ``layer``: its index, or its ``layer_weights`` (what a compiled decode step passes).
        ``normed``: what the layer before returned with ``h`` (``finish_layer_normed``), the
        input norm split over the two launches; None runs the norm here. ``path``: a decode
        step's (``S = 1``) ``DecodePath``; None (prefill) runs the GEMM path.
        """
        w = layer if isinstance(layer, LayerWeights) else self.layer_weights(layer)
        block = w.block
        attn = block.self_attn
        B, S, _ = h.shape
        nq, nkv = self.num_q_heads * self.head_dim, self.num_kv_heads * self.head_dim
        roped = spun = False  # RoPE / the Hadamard rotation already applied
        if path is not None and path.fused_linear:
            weight, bias = w.qkv
            # RoPE of q and k in the same launch, unless a q/k norm (Qwen3) comes before it.
            roped = not self.has_qk_norm
            rope = (dict(rope_cos=cos[:, 0], rope_sin=sin[:, 0], rope_rows=nq + nkv)
                    if roped else {})
            x, norm = _norm_prologue(block.input_layernorm, h[:, 0], normed)
            qkv = ops.fused_linear(x, weight, bias, **norm, **rope, launch=path.qkv)
            if roped and self.hadamard is not None:  # q and k rotated in one launch
                qkv, spun = ops.hadamard_heads(qkv, self.head_dim, nq + nkv), True
            q, k, v = qkv[:, None].split([nq, nkv, nkv], dim=-1)
        elif w.qkv is not None:
            qkv = self._by_chunks(lambda x: F.linear(block.input_layernorm(x), *w.qkv), h,
                                  nq + 2 * nkv)
            q, k, v = qkv.split([nq, nkv, nkv], dim=-1)
        else:
            x = block.input_layernorm(h)
            q, k = attn.q_proj(x), attn.k_proj(x)
            v = attn.v_proj(x) if w.v is None else F.linear(x, *w.v)
        q = q.view(B, S, self.num_q_heads, self.head_dim)
        k = k.view(B, S, self.num_kv_heads, self.head_dim)
        v = v.view(B, S, self.num_kv_heads, self.head_dim)
        if self.has_qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if not roped:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        if self.hadamard is not None and not spun:
            # After RoPE, which sits between k_proj and here, so this cannot be folded into the
            # weights (prefill, the GEMM plan's steps, a q/k norm before RoPE).
            q, k = _rotate_each_head(q), _rotate_each_head(k)
        return q, k, v

    def finish_layer(self, layer: Union[int, LayerWeights], h: torch.Tensor,
                     attn_out: torch.Tensor, overwrite: bool = False) -> torch.Tensor:
        """attn_out (B, S, H_q * D) -> the layer's output h (B, S, hidden) (``layer``: its index
        or its ``layer_weights``, what a compiled tail layer passes). ``overwrite``:
        chunks of a long h are written over it, which the caller then must not read (prefill:
        at 131k tokens of the 70B shape a second h is 2 GiB a rank)."""
        w = layer if isinstance(layer, LayerWeights) else self.layer_weights(layer)
        return self._by_chunks(lambda x, a: self._finish(w, x, a, False)[0], h, h.shape[-1],
                               attn_out, overwrite=overwrite)

    def _by_chunks(self, fn, h: torch.Tensor, width: int, *more: torch.Tensor,
                   overwrite: bool = False) -> torch.Tensor:
        """``fn(h, *more)`` (B, S, width), run over ``prefill_chunk`` tokens at a time (``fn``
        is per token; ``more`` are cut along S alike). ``overwrite`` (width = h's) writes the
        chunks over h: a chunk's rows are read before they are written."""
        S, chunk = h.shape[1], self.prefill_chunk
        if S <= chunk:
            return fn(h, *more)
        out = h if overwrite else h.new_empty(h.shape[0], S, width)
        for i in range(0, S, chunk):
            out[:, i: i + chunk] = fn(h[:, i: i + chunk], *(m[:, i: i + chunk] for m in more))
        return out

    def finish_layer_normed(self, layer: Union[int, LayerWeights], h: torch.Tensor,
                            attn_out: torch.Tensor, path: DecodePath
                            ) -> tuple[torch.Tensor, Optional[Normed]]:
        """A decode step's ``finish_layer`` (``layer``: its index or its ``layer_weights``) on
        its ``path``, returning with ``h`` what the next layer's ``qkv(..., normed=...)`` takes
        (None where the path does not split the norm, and after the last layer)."""
        w = layer if isinstance(layer, LayerWeights) else self.layer_weights(layer)
        return self._finish(w, h, attn_out, True, path)

    def _finish(self, w: LayerWeights, h: torch.Tensor, attn_out: torch.Tensor, hand_on: bool,
                path: Optional[DecodePath] = None) -> tuple[torch.Tensor, Optional[Normed]]:
        """The layer's output, and with ``hand_on`` (where the path splits the norm and a next
        layer exists) the next layer's input norm share (``_norm_prologue``)."""
        block = w.block
        o = block.self_attn.o_proj
        o_w, o_b = w.o
        # o_proj and down_proj: this rank's partial sums over its heads / features, summed
        # over the ranks (``TensorParallel.all_reduce``; nothing with one rank)
        sum_ranks = self.tp.all_reduce
        if path is not None and path.fused_linear:
            down = block.mlp.down_proj
            post = block.post_attention_layernorm
            split = path.split_norm  # (one rank only)
            first = self.tp.rank == 0  # the residual in rank 0's epilogue alone: added once
            if split:  # the norm split over o_proj and gate/up
                x, *xn = ops.fused_linear(attn_out[:, 0], o_w, o_b, residual=h[:, 0],
                                          norm_out=post.weight, launch=path.o)
                a, norm = _norm_prologue(post, x, xn)
            else:
                x = sum_ranks(ops.fused_linear(attn_out[:, 0], o_w, o_b,
                                               residual=h[:, 0] if first else None,
                                               launch=path.o))
                a, norm = _norm_prologue(post, x)
            act = ops.fused_linear(a, *w.gate_up, **norm, glu_out=True,  # silu(gate) * up
                                   launch=path.gate_up)
            # next_norm is read only where the norm is split: elsewhere the last layer's None
            # is never seen, and one compiled layer serves them all
            if hand_on and split and w.next_norm is not None:
                out, *xn = ops.fused_linear(act, down.weight, down.bias, residual=x,
                                            norm_out=w.next_norm, launch=path.down)
                return out[:, None], tuple(xn)
            out = sum_ranks(ops.fused_linear(act, down.weight, down.bias,
                                             residual=x if first else None, launch=path.down))
            return out[:, None], None
        h = h + sum_ranks(o(attn_out) if self.rotated_o is None else F.linear(attn_out, o_w, o_b))
        x = block.post_attention_layernorm(h)
        if w.gate_up is None:
            return h + sum_ranks(block.mlp(x)), None
        gate, up = F.linear(x, *w.gate_up).chunk(2, dim=-1)
        return h + sum_ranks(block.mlp.down_proj(block.mlp.act_fn(gate) * up)), None

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h (B, hidden) of the last position -> logits (B, vocab) in fp32 (with several ranks
        each computes its vocabulary slice and every rank gets all of them)."""
        local = self.model.lm_head(self.decoder.norm(h))                  # (B, V / N)
        return self.tp.gather_vocab(local, self.vocab_size).float()


def _norm_prologue(norm: nn.Module, x: torch.Tensor, normed: Optional[Normed] = None
                   ) -> tuple[torch.Tensor, dict]:
    """The input and RMSNorm arguments of an ``ops.fused_linear`` behind ``norm``.

    One row: the norm runs inside the projection (each program normalizes the row itself).
    Several rows: inside, every program would normalize all the rows (16 or 32 with the
    tensor-core padding) of every K tile again, and the normalized tile would go through
    registers instead of the compiler's shared-memory pipeline: at 8 rows the gate/up projection
    took 72-87 us that way against 62 us for the norm + cuBLAS chain
    (``perf/NOTES.md``, "Several rows"). So the launch before hands over ``normed`` =
    (``norm.weight * x``, x's sums of squares) and the projection scales its product by the
    1 / RMS (``fused_linear``'s ``norm_out`` and ``rms_sumsq``): no launch for the norm.
    Without ``normed`` (the first layer, fp16), ``ops.rms_norm`` runs first, a PDL launch, so
    the projection's programs start and prefetch their weights while it runs.
    """
    if x.shape[0] == 1:
        return x, dict(rms_weight=norm.weight, eps=norm.variance_epsilon)
    if normed is not None:  # only from a launch that split it (``DecodePath.split_norm``)
        x_scaled, sumsq = normed
        return x_scaled, dict(rms_sumsq=sumsq, eps=norm.variance_epsilon)
    return ops.rms_norm(x, norm.weight, norm.variance_epsilon), {}


def _rotate_each_head(x: torch.Tensor) -> torch.Tensor:
    """x (B, H, S, D) -> x with every head times the Hadamard matrix, in x's layout."""
    B, H, S, D = x.shape
    y = ops.hadamard_heads(x.transpose(1, 2).reshape(B * S, H * D), D)
    return y.view(B, S, H, D).transpose(1, 2)


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
