"""Where the accuracy harness's context-first time goes with recall (issue 46: on 2 x H200 a
recall method took 77-113 s a needle length of 80 prompts context first against 5-21 s question
last; methods without recall 9-16 s). One batch of the harness's needle prompts, one method, one
engine: question last, then ``cache_prompt`` and ``generate`` timed apart (synchronized), then
the same batch again under ``torch.profiler``, its top operations by device and host time:

    MINIKV_SMOLLM2_GGUF=F python perf/experiments/context_first_profile.py \\
        --method preset_accurate --length 2048 --out DIR    # (--model tiny: the random model)

Writes ``DIR/context_first_profile.txt`` (the timings and tables) and the profiler's trace.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

import torch

from minikv_compile import MiniKVConfig, minikv_compile
from minikv_compile.perf.accuracy.methods import METHODS
from minikv_compile.perf.accuracy.running import load_subject
from minikv_compile.perf.accuracy.tasks import PLANS, needle_samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", choices=("smollm2", "tiny"))
    p.add_argument("--method", default="preset_accurate", choices=sorted(METHODS))
    p.add_argument("--length", type=int, default=2048, help="needle prompt length")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2, help="timed batches of each mode")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    subject = load_subject(a.model, device, dtype)
    plan = replace(PLANS["main"], needle_lengths=(a.length,), needle_per_cell=a.batch)
    samples = needle_samples(subject.codec, subject.corpora, plan)[:a.batch]
    new = plan.needle_new_tokens
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    cm = minikv_compile(subject.model, MiniKVConfig(
        **METHODS[a.method].fields, max_batch_size=a.batch,
        max_prompt_len=max(len(s["prompt"]) for s in samples), max_new_tokens=new + 64))
    prompts = [s["prompt"] for s in samples]
    docs = [s["prompt"][:s["doc_len"]] for s in samples]
    eos = subject.codec.eos_id
    lines = [f"{a.model} {a.method} on {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}), "
             f"{a.batch} needle prompts of {a.length} tokens, {new} new tokens"]

    def timed(label: str, fn):
        sync()
        t = time.perf_counter()
        out = fn()
        sync()
        lines.append(f"  {label}: {1e3 * (time.perf_counter() - t):.1f} ms")
        return out

    def context_first():
        cache = timed("cache_prompt", lambda: cm.cache_prompt(docs))
        timed("generate (tail + decode)", lambda: cm.generate(
            prompts, max_new_tokens=new, eos_token_id=eos, past_key_values=cache))
        timed("the rows' nbytes (the harness reads them)", lambda: [
            (q.nbytes, q.host_nbytes) for q in cache.sequences])

    cm.generate(prompts, max_new_tokens=new, eos_token_id=eos)  # warm: compiles, captures
    context_first()
    for r in range(a.repeats):
        lines.append(f"repeat {r}:")
        timed("question last: generate", lambda: cm.generate(prompts, max_new_tokens=new,
                                                              eos_token_id=eos))
        context_first()
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        context_first()
    a.out.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(a.out / "context_first_trace.json"))
    table = prof.key_averages()
    for key in (["self_cuda_time_total"] if device.type == "cuda" else []) + ["self_cpu_time_total"]:
        lines += [f"top by {key}:", table.table(sort_by=key, row_limit=25)]
    text = "\n".join(lines)
    (a.out / "context_first_profile.txt").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
