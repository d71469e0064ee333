"""MiniKVConfig: every knob of the compressed cache and the compiled decode loop, validated once."""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

from minikv_compile.graphs.selection import SELECTIONS
from minikv_compile.inputs import check_bool, check_float, check_int

_POLICIES = ("uniform", "pyramid")
ROTATIONS = ("none", "hadamard")
RESYNCS = ("off", "greedy", "always")  # MiniKVConfig.recall_resync


# Named configurations (``MiniKVConfig.preset``), chosen from the accuracy harness on SmolLM2
# (its main table, 240 needle prompts of 2k-7k tokens, question last / context first; the full
# cache 88.3 / 87.1%; perplexity x the full cache's).
PRESETS = {
    # the MiniKV paper: H2O heavy hitters 25% + recent window 25%, 2 bit (needle 14.2 / 14.6%)
    "minikv": dict(heavy_budget=0.25, recent_budget=0.25, selection="h2o", snapkv_kernel=7,
                   selection_block=1, sink_tokens=0, bits=2, group_size=16, rotation="none",
                   recall_top_k=0),
    # MiniKV's bytes with the best eviction rule measured: SnapKV's window over 16-token blocks
    # and 4 sinks (50.8 / 17.1%: its window reads the question; x1.127); the default before
    # issue 47, for the smallest GPU copy without host memory
    "snapkv": dict(heavy_budget=0.25, recent_budget=0.25, selection="snapkv", snapkv_kernel=15,
                   selection_block=16, sink_tokens=4, bits=2, group_size=16, rotation="none",
                   recall_top_k=0),
    # KIVI-2: 2 bit, nothing evicted (42.1 / 36.2%, perplexity x1.115)
    "kivi": dict(heavy_budget=1.0, recent_budget=1.0, bits=2, group_size=16, rotation="none",
                 recall_top_k=0),
    # SpeCache as its paper runs it: KIVI-2's GPU copy, 64 positions per KV head recalled in
    # full precision from host memory each step, no resync (84.6 / 84.6%, x1.004; 1.08x KIVI's
    # step time on the Llama-3.1-8B shape at 1 x 32k, 1.11x at 8 x 4k, H100)
    "specache": dict(heavy_budget=1.0, recent_budget=1.0, bits=2, group_size=16,
                     rotation="none", recall_top_k=64, recall_resync="off"),
    # the library's default: KIVI-2 at group 64 with the Hadamard rotation and the recall of 64,
    # the speculation resynced after a greedy miss, recall_resync's default with recall (85.8 /
    # 85.8%, x1.001 / x1.002; 15.6% of fp16's bytes by formula, 16.6% resident at 32k with the
    # ring and the recall buffers; its step 1.17x "minikv"'s on the Llama-3.1-8B shape at 1 x
    # 32k and 8 x 4k, its 32k prefill 0.88x, its long-phase first token 0.91x)
    "accurate": dict(heavy_budget=1.0, recent_budget=1.0, bits=2, group_size=64,
                     rotation="hadamard", recall_top_k=64),
}

# Fields whose default depends on ``bits``: (quantized, 16 bit). A 16-bit cache has nothing to
# recall or to rotate before quantizing, and keeps the ring's flush quantum of 16.
BY_BITS = {"group_size": (64, 16), "rotation": ("hadamard", "none"), "recall_top_k": (64, 0)}


@dataclass(frozen=True)
class MiniKVConfig:
    """How the KV cache is compressed and how the decode loop runs.

    Budgets are fractions of the prompt length ``L``; the default keeps every token (the
    accuracy harness's evidence: ``PRESETS``). ``group_size``, ``rotation`` and ``recall_top_k``
    left as ``None`` are chosen by ``bits`` (``BY_BITS``), ``recall_resync`` by
    ``recall_top_k``, and stored: ``dataclasses.replace`` keeps them, so a config for other
    ``bits`` or without recall is built anew. The paper's methods are configurations:

    ===================  =====================================================================
    full cache           ``bits=16, heavy_budget=1.0, recent_budget=1.0`` (or any budgets
                         summing to >= 1)
    KIVI                 ``bits=2`` with budgets summing to >= 1 (no eviction)
    H2O (16 bit)         ``bits=16`` with budgets below 1
    SnapKV + 2 bit       ``selection="snapkv"``
    MiniKV (paper)       ``preset("minikv")``: budgets 0.25 + 0.25, ``selection="h2o",
                         snapkv_kernel=7, selection_block=1, sink_tokens=0``, 2 bit, group 16
    library default      KIVI-2 at group 64, Hadamard rotation, SpeCache recall of 64
                         re-phased after greedy misses (``preset("accurate")``): nothing
                         evicted, 15.6% of fp16's bytes on the GPU, a full-precision copy in
                         pinned host memory
    SnapKV + 2 bit       ``preset("snapkv")``: MiniKV's bytes, SnapKV scores over 16-token
                         blocks + 4 sinks (the default before issue 47)
    MiniKV-pyramid       ``budget_policy="pyramid"``
    SpeCache             ``recall_top_k=64, recall_resync="off"`` on KIVI's cache
                         (``preset("specache")``)
    ===================  =====================================================================

    Parameters
    ----------
    heavy_budget, recent_budget:
        ``a_HH`` and ``a_RW``: fractions of the prompt kept as heavy hitters (highest cumulative
        attention) and as the recent window. ``n_RW = ceil(a_RW * L)``,
        ``n_HH(l) = round(a_HH(l) * L)``; when they cover the prompt every token is kept.
    budget_policy:
        ``"uniform"`` (``a_HH(l) = a_HH``) or ``"pyramid"`` (linear from ``a_HH * (2 - 1/d)`` at the
        bottom layer to ``a_HH / d`` at the top, mean ``a_HH``).
    selection:
        ``"h2o"``: cumulative attention of every key over all prompt queries (the paper's rule).
        ``"snapkv"``: attention from the last ``snapkv_window`` prompt queries, max-pooled over
        ``snapkv_kernel`` neighbouring positions.
        ``"h2o_mean"``: the cumulative attention divided by the number of prompt queries that see
        the key (a mean, not a sum, so early keys are not favoured for being early).
        ``"snapkv_h2o"``: half the heavy budget by each of ``"snapkv"`` and ``"h2o"`` (the union
        of the two rankings), for prompts that end in a question about a long document.
    selection_block:
        Keep whole aligned blocks of this many positions, ranked by their best position's score.
        ``group_size`` makes each quantized key group of the heavy hitters one contiguous span
        (as in KIVI) instead of 16 scattered tokens, whose post-RoPE keys spread a 2-bit group's
        range. 1 (the paper) selects single positions.
    sink_tokens:
        Keep the first ``sink_tokens`` positions (attention sinks) whatever their score; they
        count against the heavy budget. 0 (the paper) protects nothing.
    bits:
        1, 2 or 4 (quantized cache), or 16 (the model's own dtype, no quantization). 1 bit
        (groups of 32 and up) puts its two levels at the midpoints of each group's half-ranges.
    group_size:
        Quantization group: keys per channel over this many tokens, values per token over this
        many channels, or the whole head where the head has fewer (SmolLM2's 64 channels with
        key groups of 128: 14.8% of fp16's bytes at 2 bits instead of 15.6% at 64). Default
        (``None``): 64, or 32 or 16 where ``residual_length`` is not a multiple of 64 (the ring
        flushes whole groups); 16 with ``bits=16``.
    kept_floor:
        The fewest prompt tokens a layer keeps: a prompt of at most ``kept_floor`` tokens is kept
        whole, a longer one keeps at least ``kept_floor`` (the budgets scaled up in their ratio
        where they keep fewer). Below it eviction saves less than it costs (the default's reason
        is beside it); 1 leaves the budgets alone (the paper's bytes at any length).
    residual_length:
        ``n_r``: tokens held in full precision in the ring before a flush; a multiple of
        ``group_size``. Prefill leaves the kept prompt in the ring when it fits (a prompt of at
        most ``n_r`` tokens gives the uncompressed cache's tokens until the ring, filling with
        generated tokens, is flushed at ``n_r``), else its last ``n_r / 2`` tokens or so
        (``graphs/budget.py``, ``prefill_ring_tokens``).
    rotation:
        Default (``None``): ``"hadamard"``, or ``"none"`` with ``bits=16``. ``"none"``, or
        ``"hadamard"``: every KV head's keys and the queries are multiplied by an
        orthonormal Hadamard matrix ``H`` (``D x D``, ``D = head_dim`` a power of two) after RoPE,
        so ``q . k`` is unchanged, and values by ``H`` with the attention output rotated back
        (both folded into v_proj and o_proj): outlier channels are spread over the head before
        the cache quantizes them. On SmolLM2 (GPU harness, 240 needle prompts of 2k-7k tokens)
        with recall of 64 at group 64: needle
        68.8% -> 85.8% at 2 bits, 13.3% -> 55.8% at 1 bit; on ``preset("snapkv")`` without
        recall 45.8% -> 64.2%, perplexity x1.120 -> x1.074 the full cache's; +2% of
        the decode step on the Llama-3.1-8B shape.
    recall_top_k:
        Default (``None``): 64, or 0 with ``bits=16``. SpeCache: 0 (off), or the ``K``
        positions per slot, layer and KV head whose full-precision K/V are recalled from host
        memory before each decode attention, chosen by the attention of a speculative next
        token one step ahead. The prompt's and the
        generated tokens' K/V are kept in (pinned) host memory besides the low-bit cache; each
        step feeds two rows per slot (the token and the speculation). Recall is among the
        tokens the quantized cache holds (budgets of 1.0 keep them all; at 0.35 + 0.35, group
        64 and the rotation, K 64: needle 85.0% and perplexity x1.012 the full cache's on
        SmolLM2's 2k-7k-token prompts, 14.0% of its bytes resident at 7k). Needs bits below 16.
    recall_block:
        Recall granularity: 1 (single positions) or aligned blocks of this many positions,
        ranked by their summed attention (fewer, larger host reads). ``recall_top_k`` must be
        a multiple of it.
    recall_resync:
        ``"off"``, ``"greedy"`` or ``"always"`` (``RESYNCS``); default (``None``): ``"greedy"``
        with recall (``recall_top_k`` above 0), ``"off"`` without. After a step whose
        speculation missed (the token chosen is not the one the speculative row fed), the next
        step pre-decodes the chosen token, as a slot's first step does, so that the next recall
        is chosen by its own query again: one step more a miss. Without it a missed guess's
        successor is conditioned on the wrong token and the speculation stays out of phase
        (``perf/NOTES.md``). With it the default's needle is 85.8 / 85.8% (full cache 88.3 /
        87.1), at 2-29% more steps than tokens on the demo's prompts. ``"greedy"`` leaves
        sampled requests alone: a drawn token differs from the greedy guess so often (SmolLM2:
        37% more steps at temperature 0.7, 46% at 1.0) that ``"always"`` would cost that much.
        SpeCache's paper runs without it (``preset("specache")``). Not ``"off"`` needs recall.
        The guess is the plain argmax: a greedy request with a repetition penalty (or a ban on
        eos before ``min_new_tokens``) chooses from other logits and misses more often.
    max_batch_size, max_prompt_len, max_new_tokens:
        The static capacity; buffers are allocated once for these.
    compile:
        Trace the decode step with ``torch.compile(fullgraph=True)``. ``None``: on for a CUDA
        model, off on the CPU (where compiling costs more than it saves for a short demo).
    cuda_graphs:
        Capture the decode step into CUDA graphs (one per batch-size bucket) and replay them.
        ``None``: on for a CUDA model; ``True`` for a CPU model is an error.
    tensor_parallel:
        Ranks the model is sharded over (``docs/algorithm.md``, "Tensor parallel"): 1, or the
        world size of ``torch.distributed``'s default process group, which the caller
        initialized (``torchrun --nproc-per-node N``, one process per device, every rank
        calling ``minikv_compile`` and ``generate`` with the same arguments). Each rank then
        holds ``1 / N`` of the KV heads (and their cache), the MLP and the LM head. Explicit,
        not read off an initialized process group: data-parallel ranks each hold a whole model.
    """

    heavy_budget: float = 1.0
    recent_budget: float = 1.0
    # Eviction's saving below 1024 tokens (at 50% kept, 2 bits: L/4 bytes a value column) is
    # under the 128-token fp16 ring's 256 each slot holds anyway, and frees no allocation.
    kept_floor: int = 1024
    budget_policy: str = "uniform"
    pyramid_depth: int = 7
    # The selection, where budgets below 1 evict, is the best rule of the accuracy harness at
    # MiniKV's bytes (SmolLM2-135M, 240 needle prompts): needle retrieval 50.8% vs 14.6% for
    # the paper's H2O rule question last, perplexity and code completion unchanged.
    # ``preset("minikv")`` is the paper's MiniKV exactly.
    selection: str = "snapkv"
    snapkv_window: int = 32
    snapkv_kernel: int = 15
    selection_block: int = 16
    sink_tokens: int = 4
    bits: int = 2
    group_size: Optional[int] = None    # BY_BITS: 64 (or what divides the ring), 16 with bits=16
    residual_length: int = 128
    rotation: Optional[str] = None      # BY_BITS: "hadamard", or "none" with bits=16
    recall_top_k: Optional[int] = None  # BY_BITS: 64, or 0 with bits=16
    recall_block: int = 1
    recall_resync: Optional[str] = None  # "greedy" with recall, else "off"
    max_batch_size: int = 1
    max_prompt_len: int = 4096
    max_new_tokens: int = 256
    compile: Optional[bool] = None
    cuda_graphs: Optional[bool] = None
    tensor_parallel: int = 1

    @classmethod
    def preset(cls, name: Optional[str], **fields) -> "MiniKVConfig":
        """A named configuration (``PRESETS``: ``"minikv"``, ``"snapkv"``, ``"kivi"``,
        ``"specache"``, ``"accurate"``), or the default one for ``None``, ``fields`` on top
        (capacity, compile, or any preset field)."""
        if name is None:
            return cls(**fields)
        if name not in PRESETS:
            raise ValueError(f"preset: expected one of {sorted(PRESETS)}, got {name!r}")
        return cls(**{**PRESETS[name], **fields})

    def __post_init__(self) -> None:
        # Integral numpy / 0-d torch values are stored as Python ints (floats, strings and bools
        # are refused, never coerced): the cache allocation and the op schemas take Python ints.
        def store(name: str, value) -> None:
            object.__setattr__(self, name, value)

        quantized = self.bits != 16
        if self.group_size is None and quantized:
            # the ring flushes whole groups: a ring 64 does not divide takes the largest group
            # that divides it (1 bit packs 32 tokens of a key group: 32 at least)
            try:
                ring = operator.index(self.residual_length)
            except TypeError:  # refused below, naming the field
                ring = 0
            sizes = (64, 32) if self.bits == 1 else (64, 32, 16)
            store("group_size", next((g for g in sizes if ring % g == 0), sizes[0]))
        for name, (low_bits, full) in BY_BITS.items():
            if getattr(self, name) is None:
                store(name, low_bits if quantized else full)
        for name in ("heavy_budget", "recent_budget"):
            store(name, check_float(name, getattr(self, name), lo=0.0, hi=1.0))
        if self.budget_policy not in _POLICIES:
            raise ValueError(f"budget_policy: expected one of {_POLICIES}, got {self.budget_policy!r}")
        if self.rotation not in ROTATIONS:
            raise ValueError(f"rotation: expected one of {ROTATIONS}, got {self.rotation!r}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection: expected one of {SELECTIONS}, got {self.selection!r}")
        for name, allowed in (("bits", (1, 2, 4, 16)), ("group_size", (16, 32, 64, 128))):
            value = check_int(name, getattr(self, name))
            if value not in allowed:
                raise ValueError(f"{name}: expected one of {allowed}, got {value!r}")
            store(name, value)
        if self.bits == 1 and self.group_size < 32:
            raise ValueError(f"group_size: expected 32, 64 or 128 with bits=1 (one int32 packs 32 "
                             f"tokens of a key group), got {self.group_size}")
        for name in ("kept_floor", "residual_length", "pyramid_depth", "snapkv_window",
                     "snapkv_kernel", "selection_block", "max_batch_size", "max_prompt_len",
                     "max_new_tokens", "tensor_parallel"):
            store(name, _positive_int(name, getattr(self, name)))
        store("sink_tokens", check_int("sink_tokens", self.sink_tokens, lo=0))
        if self.residual_length % self.group_size:
            raise ValueError(
                f"residual_length: expected a multiple of group_size={self.group_size}, "
                f"got {self.residual_length}"
            )
        store("recall_top_k", check_int("recall_top_k", self.recall_top_k, lo=0))
        store("recall_block", _positive_int("recall_block", self.recall_block))
        if self.recall_top_k and self.bits == 16:
            raise ValueError("recall_top_k: expected 0 with bits=16 (nothing to recall from a "
                             f"16-bit cache), got {self.recall_top_k}")
        if self.recall_top_k % self.recall_block:
            raise ValueError(f"recall_top_k: expected a multiple of recall_block="
                             f"{self.recall_block}, got {self.recall_top_k}")
        if self.recall_resync is None:
            store("recall_resync", "greedy" if self.recall_top_k else "off")
        if self.recall_resync not in RESYNCS:
            raise ValueError(f"recall_resync: expected one of {RESYNCS}, got {self.recall_resync!r}")
        if self.recall_resync != "off" and not self.recall_top_k:
            raise ValueError("recall_resync: expected 'off' without recall (recall_top_k=0), "
                             f"got {self.recall_resync!r}")
        if self.snapkv_kernel % 2 == 0:
            raise ValueError(f"snapkv_kernel: expected an odd pooling width, got {self.snapkv_kernel}")
        for name in ("compile", "cuda_graphs"):
            value = getattr(self, name)
            if value is not None:
                store(name, check_bool(name, value))


def _positive_int(name: str, value) -> int:
    """``value`` as a Python int >= 1 (numpy and 0-d tensor ints too; no floats, strings, bools)."""
    return check_int(name, value, lo=1)
