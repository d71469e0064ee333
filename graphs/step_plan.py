"""One plan per (bucket, mode): every kernel a decode step runs, decided once (``StepPlan``).

The runtime builds a bucket's plan when it prepares the bucket (``SlotRuntime.prepare``), and
the step reads it (``DecodeStep``): nothing re-derives a choice from shapes while it runs. It
holds the step's rows (the bucket, twice it with recall: SpeCache's two rows a slot), the
linear path and the launch of each projection (``ops.linear.launch_config``), whether the
norms are split, and per layer the attention kernel and its splits
(``ops.attention_decode.decode_attention_plan``). The ops take those as explicit ``launch``
arguments (CPU int tensors: inputs of the compiled step, so that the buckets of one path share
one compiled graph); ``kernels()`` names every launch of the step, for ``MiniKVModel.stats``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch

from minikv_compile.models.llama import DecodePath
from minikv_compile.ops.attention_decode import FRAGMENTS, decode_attention_plan
from minikv_compile.ops.linear import launch_config, launch_tensor

# Decode steps of up to this many rows run ``ops.fused_linear``: one tile of 16 or 32 (padded)
# rows, so 9-16 rows cost what 8 do (H100, 16 x 2k: 6.36 ms a step against 7.15 for the GEMM
# plan; SpeCache's 2 rows of 8 slots: 9.06 against 9.41) and 24 x 8k in bucket 32 takes 7.95 ms
# against 8.47 (``perf/NOTES.md``, "SpeCache" and "Serving on the H100").
FUSED_MAX_ROWS = 32

# The fused path's projections, in the order a layer runs them.
PROJECTIONS = ("qkv", "o", "gate_up", "down")


def decode_path(adapter, rows: int, dtype: torch.dtype) -> DecodePath:
    """How a decode step of ``rows`` rows in ``dtype`` runs its layers.

    ``fused_linear`` where the adapter's layers fuse (CUDA's path: plain RMSNorms, SiLU MLP,
    fused weights) and at most ``FUSED_MAX_ROWS`` rows (measured on the H200 against inductor's
    kernels around cuBLAS, ``perf/NOTES.md``, "Fused linear layers"), each projection with its
    ``launch_config``; otherwise GEMMs (cuBLAS on CUDA) with the norms, RoPE and gates around
    them (fused by inductor when compiled). ``split_norm`` at several rows: each RMSNorm split
    over the launch before it (which hands on ``weight * h`` and the row sums of squares) and
    the projection after it (which scales by 1 / RMS), no launch for the norm; not in fp16
    (``weight * h`` rounded before the division could overflow: a residual stream of 3e4 and a
    weight of 4 would), nor with several ranks (the launch before the norm holds this rank's
    partial sum only, not h).
    """
    if not (adapter.fused_decode and rows <= FUSED_MAX_ROWS):
        return DecodePath(fused_linear=False, split_norm=False)
    split = rows > 1 and dtype != torch.float16 and adapter.tp.world == 1
    return DecodePath(True, split, **{name: launch_tensor(launch_config(rows, n, k, dtype))
                                      for name, (n, k) in projection_shapes(adapter).items()})


def projection_shapes(adapter) -> Dict[str, Tuple[int, int]]:
    """The fused path's projections' weights ``(N, K)`` (this rank's), by ``PROJECTIONS``."""
    w = adapter.layer_weights(0)
    return {"qkv": tuple(w.qkv[0].shape), "o": tuple(w.o[0].shape),
            "gate_up": tuple(w.gate_up[0].shape),
            "down": tuple(w.block.mlp.down_proj.weight.shape)}


@dataclass(frozen=True, eq=False)
class StepPlan:
    """Every kernel of one decode step of a bucket in a mode.

    bucket, mode: the key (``GraphRunner``'s). rows: the rows each launch computes (``bucket``;
    ``2 * bucket`` with recall). device: where it runs (the CPU runs every op's reference,
    which reads no launch). path: the layers' ``DecodePath`` (linear path, split norms, the
    projections' launches), handed to every layer. linears: each projection's launch as a dict
    (``launch_config``; empty on the GEMM path). attention: per layer, the attention's launch
    (``_Plan``: kernel, splits, tiles; layers differ where their capacities do), and
    ``attention_launch`` the same as the op's ``launch`` tensors.
    """

    bucket: int
    mode: str
    rows: int
    recall: bool
    device: torch.device
    path: DecodePath
    linears: Dict[str, dict]
    attention: Tuple[object, ...]
    attention_launch: Tuple[torch.Tensor, ...]

    @classmethod
    def build(cls, adapter, cache, bucket: int, mode: str) -> "StepPlan":
        """The plan of ``(bucket, mode)`` for ``adapter``'s model over ``cache``."""
        recall = cache.recall is not None
        rows = 2 * bucket if recall else bucket
        path = decode_path(adapter, rows, cache.dtype)
        linears = ({name: launch_config(rows, n, k, cache.dtype)
                    for name, (n, k) in projection_shapes(adapter).items()}
                   if path.fused_linear else {})
        attention = tuple(
            decode_attention_plan(cache.device, cache.dtype, cache.bits, cache.group_size,
                                  adapter.head_dim, bucket, adapter.num_q_heads,
                                  adapter.num_kv_heads, kv.capacity, rows=rows // bucket,
                                  recall=recall)
            for kv in cache.layers)
        return cls(bucket, mode, rows, recall, cache.device, path, linears, attention,
                   tuple(p.as_tensor() for p in attention))

    def kernels(self) -> List[str]:
        """The step's launches in order, each with its choice: the layer's (every layer runs
        them), then the attention's launch per run of layers that share it."""
        path, split = self.path, self.path.split_norm
        attention = ("minikv::decode_attention_recall" if self.recall
                     else "minikv::decode_attention")
        if path.fused_linear:
            tile = {name: _tiles(cfg) for name, cfg in self.linears.items()}
            if self.rows == 1:  # each norm inside its projection
                norm_in, norm_post, norm_next = "input norm, RoPE", "", ""
                gate = "post-attention norm, "
            elif split:
                norm_in = "RoPE; the input norm handed on, layer 0: minikv::rms_norm first"
                norm_post, gate = ", post-attention norm's share", ""
                norm_next = ", next input norm's share"
            else:
                norm_in, norm_post, norm_next = "RoPE; minikv::rms_norm first", "", ""
                gate = "minikv::rms_norm first, "
            layer = [f"fused_linear q/k/v ({norm_in}) {tile['qkv']}",
                     "minikv::cache_write_ring", attention,
                     f"fused_linear o_proj (+ residual{norm_post}) {tile['o']}",
                     f"fused_linear gate/up ({gate}SiLU-gate) {tile['gate_up']}",
                     f"fused_linear down (+ residual{norm_next}) {tile['down']}"]
        else:
            layer = ["input norm, q/k/v GEMM, RoPE", "minikv::cache_write_ring", attention,
                     "o_proj GEMM, residual", "post-attention norm, gate/up GEMM, SiLU-gate",
                     "down GEMM, residual"]
        layer[2] += " (its launch by layer: below)"
        lines = [f"bucket {self.bucket}, {self.mode}: rows a launch {self.rows}"
                 + (" (two a slot: recall)" if self.recall else "")
                 + (" on the CPU: each op's reference, launches unread"
                    if self.device.type == "cpu" else "")]
        start = "start: minikv::cache_begin_step (every layer), embedding, RoPE"
        if self.recall:
            start += "; side stream: minikv::recall_gather of layers 1.. (the step's recall rows)"
            layer.append("side stream: minikv::recall_store (the ring's newest token to the host)")
        lines += [start] + [f"per layer: {k}" for k in layer]
        first = 0
        for i in range(1, len(self.attention) + 1):
            if i == len(self.attention) or self.attention[i] != self.attention[first]:
                which = f"layer {first}" if i - 1 == first else f"layers {first}-{i - 1}"
                lines.append(f"{which}: {attention} {_attention(self.attention[first])}")
                first = i
        choice = {"greedy": "argmax", "sample": "sampling (temperature, top-k, top-p, penalty)",
                  "teacher": "the forced token and its log-probability"}[self.mode]
        end = f"end: final norm, lm_head, {choice}"
        if self.recall:
            end += ("; side stream: recall_topk of every layer, minikv::recall_gather of layer 0 "
                    "(the next step's)")
        return lines + [end]


def _tiles(cfg: dict) -> str:
    """One projection's launch in a few words."""
    how = "tensor cores" if cfg["USE_DOT"] else "FMA"
    return (f"[{how}, {cfg['BLOCK_M']} x {cfg['BLOCK_N']} x {cfg['BLOCK_K']} tiles, "
            f"{cfg['NUM_STAGES']} stages, {cfg['num_warps']} warps"
            + (f", L2 prefetch {cfg['K_PREFETCH']}" if cfg["K_PREFETCH"] else "") + "]")


def _attention(plan) -> str:
    """One attention launch in a few words."""
    kernel = ("Gluon fragments kernel" if plan.kernel == FRAGMENTS else "Triton split kernel"
              + (" (half2" + (", prefetch)" if plan.prefetch else ")") if plan.half2 else ""))
    return (f"[{kernel}, {plan.num_splits} splits + ring, {plan.block_n}-token blocks, "
            f"{plan.num_warps} warps, {plan.num_stages} stages"
            + (f", {plan.maxnreg} registers" if plan.maxnreg else "") + "] + combine")
