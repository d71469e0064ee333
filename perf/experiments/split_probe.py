"""Where a needle prompt is cut into cached document and prefilled tail: does it change the
answer of a compressed configuration (issue 47: question last lost needles that context first
kept)? One harness needle prompt, SmolLM2 fp32 on the CPU, one engine:

    MINIKV_SMOLLM2_GGUF=F python perf/experiments/split_probe.py needle/2048/10/7 \\
        kivi2_g64_spec128_hadamard 0,-16,2015 ["{'residual_length': 256}"]

The sample id is the accuracy harness's (``needle/LENGTH/DEPTH%/INDEX``), the method one of its
``METHODS``, then the cuts: 0 is question last (the whole prompt prefilled at once), a positive
cut caches that many tokens with ``cache_prompt`` and prefills the rest as the tail, a negative
one leaves that many tokens to the tail. A fourth argument: ``MiniKVConfig`` fields on top.
Prints each cut's answer.
"""
from __future__ import annotations

import ast
import sys
from dataclasses import replace

import torch

from minikv_compile import MiniKVConfig, minikv_compile
from minikv_compile.perf.accuracy.methods import METHODS
from minikv_compile.perf.accuracy.running import load_subject
from minikv_compile.perf.accuracy.tasks import PLANS, needle_samples


def main() -> None:
    torch.set_num_threads(1)
    sample_id, method = sys.argv[1], sys.argv[2]
    cuts = [int(x) for x in sys.argv[3].split(",")]
    extra = ast.literal_eval(sys.argv[4]) if len(sys.argv) > 4 else {}
    subject = load_subject("smollm2", torch.device("cpu"), torch.float32)
    length, index = int(sample_id.split("/")[1]), int(sample_id.split("/")[3])
    plan = replace(PLANS["main"], needle_lengths=(length,), needle_per_cell=index + 1)
    sample = {s["id"]: s for s in needle_samples(subject.codec, subject.corpora, plan)}[sample_id]
    fields = {**METHODS[method].fields, **extra}
    prompt, eos = sample["prompt"], subject.codec.eos_id
    cm = minikv_compile(subject.model, MiniKVConfig(**fields, max_batch_size=1, max_prompt_len=length,
                                                    max_new_tokens=plan.needle_new_tokens + length))
    print(f"{sample_id}: {len(prompt)} tokens, document {sample['doc_len']}, answer {sample['answer']}")
    for cut in cuts:
        at = cut if cut > 0 else len(prompt) + cut
        cache = cm.cache_prompt([prompt[:at]]) if cut else None
        out = cm.generate([prompt], max_new_tokens=plan.needle_new_tokens, eos_token_id=eos,
                          past_key_values=cache)
        print(f"  {'question last' if not cut else f'{at} cached, {len(prompt) - at} tail'}: "
              f"{subject.codec.decode(out.sequences[0])!r}", flush=True)


if __name__ == "__main__":
    main()
