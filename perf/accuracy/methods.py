"""The compared KV-cache methods (``MiniKVConfig`` fields on top of the harness's capacity) and
their KV bytes, including budgets matched to another method's bytes."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

from minikv_compile import MiniKVConfig
from minikv_compile.config import PRESETS
from minikv_compile.graphs import budget
from minikv_compile.prompt_cache import cache_config


# -- methods --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Method:
    """One cache method: ``MiniKVConfig`` fields on top of the capacity the harness sets.

    ``match_bytes_of``: the budget is not given but chosen per task and prompt length as the
    largest whose prompt KV bytes (docs/algorithm.md, KV bytes) do not exceed that method's.
    """

    name: str
    label: str
    overrides: Tuple[Tuple[str, object], ...]
    match_bytes_of: Optional[str] = None

    @property
    def fields(self) -> Dict[str, object]:
        return dict(self.overrides)


def _method(name: str, label: str, match: Optional[str] = None, **fields) -> Method:
    return Method(name, label, tuple(sorted({**PAPER_MINIKV, **fields}.items())), match)


# Every field a method depends on is spelled out, so a later change of the library's defaults
# (issue 5 asks for the best selection to become the default) does not change what "minikv" means.
PAPER_MINIKV = dict(heavy_budget=0.25, recent_budget=0.25, budget_policy="uniform", pyramid_depth=7,
                    selection="h2o", snapkv_window=32, snapkv_kernel=7, selection_block=1,
                    sink_tokens=0, bits=2, group_size=16, residual_length=128, kept_floor=1,
                    rotation="none", recall_top_k=0, recall_block=1, recall_resync="off")
_KEEP_ALL = dict(heavy_budget=1.0, recent_budget=1.0)

# Selection recipes compared at MiniKV's bytes (and swept over budgets with --sweep-selections).
# Found on CPU (SmolLM2, 768-token needle prompts, 10 samples each, 2-bit, 25%/25%): SnapKV's
# pooling width matters (kernel 3 / 7 / 15: 2 / 3 / 7 of 10 right) and so do whole 16-position
# blocks (kernel 7: 3 -> 6, kernel 15: 7 -> 8); KIVI-2 got 8, H2O 1. Evidence for the default
# comes from the GPU run, not from these.
SELECTIONS = {
    "h2o": dict(selection="h2o"),
    "snapkv": dict(selection="snapkv"),
    "h2o_mean": dict(selection="h2o_mean"),
    "snapkv_h2o": dict(selection="snapkv_h2o"),
    "snapkv_block": dict(selection="snapkv", snapkv_kernel=15, selection_block=16),
    "snapkv_h2o_block": dict(selection="snapkv_h2o", snapkv_kernel=15, selection_block=16),
    "snapkv_block_sink": dict(selection="snapkv", snapkv_kernel=15, selection_block=16, sink_tokens=4),
}

METHODS: Dict[str, Method] = {m.name: m for m in (
    _method("full", "Full cache (16-bit)", bits=16, **_KEEP_ALL),
    _method("kivi2", "KIVI-2 (2-bit, no eviction)", **_KEEP_ALL),
    _method("h2o16", "H2O 16-bit at MiniKV's bytes", match="minikv", bits=16),
    _method("snapkv2", "SnapKV + 2-bit (25%/25%)", **SELECTIONS["snapkv"]),
    _method("minikv", "MiniKV (H2O 25%/25%, 2-bit)"),
    _method("minikv_pyramid", "MiniKV-pyramid", budget_policy="pyramid"),
    _method("h2o_mean", "MiniKV + h2o_mean", **SELECTIONS["h2o_mean"]),
    _method("snapkv_h2o", "MiniKV + snapkv_h2o", **SELECTIONS["snapkv_h2o"]),
    _method("snapkv_block", "MiniKV + snapkv k15, blocks of 16", **SELECTIONS["snapkv_block"]),
    _method("snapkv_h2o_block", "MiniKV + snapkv_h2o k15, blocks of 16", **SELECTIONS["snapkv_h2o_block"]),
    _method("snapkv_block_sink", "MiniKV + snapkv k15, blocks, 4 sinks", **SELECTIONS["snapkv_block_sink"]),
    _method("snapkv_block16", "SnapKV k15, blocks, 16-bit at MiniKV's bytes", match="minikv", bits=16,
            **SELECTIONS["snapkv_block"]),
    # Issue 25: the library default (snapkv_block_sink) with a Hadamard rotation of every head
    # before quantizing, and both at 4 bits as a reference.
    _method("snapkv_block_sink_hadamard", "MiniKV + snapkv k15, blocks, 4 sinks, Hadamard",
            rotation="hadamard", **SELECTIONS["snapkv_block_sink"]),
    _method("snapkv_block_sink4", "MiniKV + snapkv k15, blocks, 4 sinks, 4-bit", bits=4,
            **SELECTIONS["snapkv_block_sink"]),
    _method("snapkv_block_sink4_hadamard", "MiniKV + snapkv k15, blocks, 4 sinks, 4-bit, Hadamard",
            bits=4, rotation="hadamard", **SELECTIONS["snapkv_block_sink"]),
    # SpeCache (issue 25): K positions per KV head recalled in full precision from the host copy
    # every step; the GPU copy as the named method. Group 64 is the 2-bit copy within 16% of the
    # fp16 cache's bytes with the ring and the recall buffer.
    _method("kivi2_g64", "KIVI-2, group 64", group_size=64, **_KEEP_ALL),
    _method("kivi2_spec64", "KIVI-2 + SpeCache K 64", recall_top_k=64, **_KEEP_ALL),
    _method("kivi2_g64_spec64", "KIVI-2, group 64 + SpeCache K 64", group_size=64,
            recall_top_k=64, **_KEEP_ALL),
    _method("kivi2_g64_spec256", "KIVI-2, group 64 + SpeCache K 256", group_size=64,
            recall_top_k=256, **_KEEP_ALL),
    _method("kivi2_g64_spec64_hadamard", "KIVI-2, group 64, Hadamard + SpeCache K 64",
            group_size=64, rotation="hadamard", recall_top_k=64, **_KEEP_ALL),
    # the default (`"accurate"`); kivi2_g64_spec64_hadamard is its cache without the resync
    _method("kivi2_g64_spec64_hadamard_resync",
            "KIVI-2, group 64, Hadamard + SpeCache K 64, resync", group_size=64,
            rotation="hadamard", recall_top_k=64, recall_resync="greedy", **_KEEP_ALL),
    # issue 47's candidates for the default: 128 positions recalled, or groups of 32 (18.75%)
    _method("kivi2_g64_spec128_hadamard", "KIVI-2, group 64, Hadamard + SpeCache K 128",
            group_size=64, rotation="hadamard", recall_top_k=128, **_KEEP_ALL),
    _method("kivi2_g32_spec64_hadamard", "KIVI-2, group 32, Hadamard + SpeCache K 64",
            group_size=32, rotation="hadamard", recall_top_k=64, **_KEEP_ALL),
    _method("kivi2_g32_spec128_hadamard", "KIVI-2, group 32, Hadamard + SpeCache K 128",
            group_size=32, rotation="hadamard", recall_top_k=128, **_KEEP_ALL),
    # keys grouped over 128 tokens, values over SmolLM2's whole head (64): 14.8% by formula
    _method("kivi2_g128_spec64_hadamard", "KIVI-2, group 128, Hadamard + SpeCache K 64",
            group_size=128, rotation="hadamard", recall_top_k=64, **_KEEP_ALL),
    _method("kivi2_spec64_b16", "KIVI-2 + SpeCache K 64 in blocks of 16", recall_top_k=64,
            recall_block=16, **_KEEP_ALL),
    _method("kivi2_g64_spec64_hadamard_b16", "KIVI-2, group 64, Hadamard + SpeCache K 64, blocks of 16",
            group_size=64, rotation="hadamard", recall_top_k=64, recall_block=16, **_KEEP_ALL),
    # 1 bit (SpeCache's rule: levels at the midpoints of each half-range), group 64: 9.4% of
    # fp16's bytes by formula (SmolLM2's head dim 64 is the largest value group it allows)
    _method("kivi1_g64", "KIVI-1, group 64", bits=1, group_size=64, **_KEEP_ALL),
    _method("kivi1_g64_spec64", "KIVI-1, group 64 + SpeCache K 64", bits=1, group_size=64,
            recall_top_k=64, **_KEEP_ALL),
    _method("kivi1_g64_spec64_hadamard", "KIVI-1, group 64, Hadamard + SpeCache K 64", bits=1,
            group_size=64, rotation="hadamard", recall_top_k=64, **_KEEP_ALL),
    _method("kivi1_g64_spec256_hadamard", "KIVI-1, group 64, Hadamard + SpeCache K 256", bits=1,
            group_size=64, rotation="hadamard", recall_top_k=256, **_KEEP_ALL),
    _method("kivi1_g128_spec64_hadamard", "KIVI-1, group 128, Hadamard + SpeCache K 64",
            bits=1, group_size=128, rotation="hadamard", recall_top_k=64, **_KEEP_ALL),
    _method("kivi1_g128_spec192_hadamard", "KIVI-1, group 128, Hadamard + SpeCache K 192",
            bits=1, group_size=128, rotation="hadamard", recall_top_k=192, **_KEEP_ALL),
    _method("kivi1_g128_spec256_hadamard", "KIVI-1, group 128, Hadamard + SpeCache K 256",
            bits=1, group_size=128, rotation="hadamard", recall_top_k=256, **_KEEP_ALL),
    _method("kivi1_g32_spec64_hadamard", "KIVI-1, group 32, Hadamard + SpeCache K 64", bits=1,
            group_size=32, rotation="hadamard", recall_top_k=64, **_KEEP_ALL),
    _method("snapkv_block_sink_spec64", "MiniKV + snapkv k15, blocks, 4 sinks + SpeCache K 64",
            recall_top_k=64, **SELECTIONS["snapkv_block_sink"]),
    # eviction under recall: the library's selection at the default's and larger kept fractions
    # with the group-64 rotated copy (SnapKV blocks at 4 bits: perplexity x1.040 at 50% kept,
    # x1.016 at 70% in the sweep; at 85% the GPU copy is 13.3% of fp16's bytes by formula)
    _method("snapkv_block_sink_hadamard_spec64",
            "MiniKV + snapkv k15, blocks, 4 sinks, Hadamard + SpeCache K 64", rotation="hadamard",
            recall_top_k=64, **SELECTIONS["snapkv_block_sink"]),
    _method("snapkv_block_sink_k70_g64_spec64_hadamard",
            "SnapKV k15, blocks, 4 sinks, 70% kept, group 64, Hadamard + SpeCache K 64",
            heavy_budget=0.35, recent_budget=0.35, group_size=64, rotation="hadamard",
            recall_top_k=64, **SELECTIONS["snapkv_block_sink"]),
    _method("snapkv_block_sink_k85_g64_spec64_hadamard",
            "SnapKV k15, blocks, 4 sinks, 85% kept, group 64, Hadamard + SpeCache K 64",
            heavy_budget=0.425, recent_budget=0.425, group_size=64, rotation="hadamard",
            recall_top_k=64, **SELECTIONS["snapkv_block_sink"]),
)}
def method_fields(config: MiniKVConfig) -> Dict[str, object]:
    """The fields of ``config`` a method is: a prompt cache's (``cache_config``) and the
    speculation's resync, which a prompt cache need not match but a method's tokens do."""
    return {**cache_config(config), "recall_resync": config.recall_resync}


# The library as it stands (issue 47 chooses the default from them): its default config and its
# presets, every field but the capacity read from MiniKVConfig now, so they follow the library.
LIBRARY_METHODS = (
    Method("default", "Library default (MiniKVConfig())",
           tuple(sorted(method_fields(MiniKVConfig()).items()))),
    *(Method(f"preset_{name}", f'preset("{name}")',
             tuple(sorted(method_fields(MiniKVConfig.preset(name)).items()))) for name in PRESETS))
METHODS.update({m.name: m for m in LIBRARY_METHODS})
# Most important first: a run cut short by --budget-seconds still has the paper's comparison.
MAIN_METHODS = ("full", "minikv", "kivi2", "snapkv2", "h2o16", "minikv_pyramid", "snapkv_block",
                "snapkv_h2o_block", "h2o_mean", "snapkv_h2o", "snapkv_block_sink", "snapkv_block16",
                # issue 25: the rotation, then SpeCache at 2 and 1 bits
                "snapkv_block_sink_hadamard", "kivi2_spec64", "kivi2_g64_spec64_hadamard",
                "kivi2_g128_spec64_hadamard", "snapkv_block_sink_spec64",
                "kivi1_g128_spec64_hadamard", "kivi1_g128_spec192_hadamard")
QUICK_METHODS = ("full", "minikv", "snapkv_block")
AGREEMENT_METHODS = ("full", "minikv")
# Kept fraction of the prompt (half heavy hitters, half recent window). 4-bit at 1/3 costs what
# 2-bit at 1/2 costs (0.75 vs 0.5 bytes per value with G = 16 scales and zeros); the paper's
# "4 bits at 25% = 2 bits at 50%" ignores the scales.
SWEEP_KEPT = (0.5, 0.2, 0.7, 0.1, 0.3, 0.4)   # coarse to fine: a cut-short sweep still has a curve
SWEEP_KEPT_4BIT_EXTRA = (1 / 3,)


def sweep_methods(selections: Sequence[str]) -> List[Method]:
    """Full cache, KIVI at 2 and 4 bits, then every kept fraction x selection recipe x bits."""
    unknown = [s for s in selections if s not in SELECTIONS]
    if unknown:
        raise ValueError(f"sweep selections: expected names from {sorted(SELECTIONS)}, got {unknown}")
    out = [METHODS["full"], METHODS["kivi2"],
           _method("kivi4", "KIVI-4 (4-bit, no eviction)", bits=4, **_KEEP_ALL)]
    for kept in SWEEP_KEPT + SWEEP_KEPT_4BIT_EXTRA:
        for selection in selections:
            for bits in (2, 4):
                if kept in SWEEP_KEPT_4BIT_EXTRA and bits == 2:
                    continue
                pct = f"{100 * kept:.0f}"
                out.append(_method(f"{selection}-{bits}b-{pct}", f"{selection} {bits}-bit {pct}% kept",
                                   bits=bits, heavy_budget=kept / 2, recent_budget=kept / 2,
                                   **SELECTIONS[selection]))
    return out


# -- KV bytes (docs/algorithm.md, KV bytes; the paper's Appendix I) -------------------------------


def kv_bytes(config: MiniKVConfig, num_layers: int, width: int, prompt_len: int, new_tokens: int,
             head_dim: int) -> int:
    """Bytes of one sequence's KV cache under ``config``, by the paper's formula.

    ``width`` = KV heads x ``head_dim``. 16-bit: 2 bytes per value; b-bit: b/8 bytes of codes plus
    an fp16 scale and zero per key group of ``group_size`` tokens and per value group of
    ``min(group_size, head_dim)`` channels. Kept prompt tokens per layer follow the budgets
    (``budget.kept_tokens``); generated tokens are all kept. The residual ring (at most
    ``residual_length`` tokens in 16 bit) and padding come on top and are reported apart.
    """
    return budget.formula_kv_bytes(bits=config.bits, group_size=config.group_size, kv_width=width,
                                   head_dim=head_dim,
                                   kept=budget.kept_per_layer(config, prompt_len, num_layers),
                                   new_tokens=new_tokens, batch=1)


def fp16_bytes(num_layers: int, width: int, prompt_len: int, new_tokens: int) -> int:
    """The uncompressed cache of one sequence: K and V, 2 bytes per value."""
    return budget.full_kv_bytes(num_layers=num_layers, kv_width=width,
                                tokens=prompt_len + new_tokens, batch=1, dtype_bytes=2)


def matched_budget(target_bytes: int, base: MiniKVConfig, num_layers: int, width: int,
                   prompt_len: int, new_tokens: int, head_dim: int) -> float:
    """Largest kept fraction ``f`` (half heavy, half recent) whose bytes under ``base`` fit.

    Bytes grow with ``f`` (kept counts are non-decreasing), so a bisection over a grid of
    1/4096 finds it. At least one token per layer is kept (``f >= 1 / prompt_len``).
    """
    def cost(f: float) -> int:
        return kv_bytes(replace(base, heavy_budget=f / 2, recent_budget=f / 2), num_layers, width,
                        prompt_len, new_tokens, head_dim)

    lo, hi = 0, 4096  # cost(lo / 4096) fits (or lo = 0), cost(hi / 4096) may not
    if cost(1.0) <= target_bytes:
        return 1.0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if cost(mid / 4096) <= target_bytes else (lo, mid)
    return max(lo / 4096, 1.0 / prompt_len)
