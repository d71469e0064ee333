"""How much of SpeCache's recall set does one step share with the step before?

    python perf/experiments/recall_overlap.py [--device cpu] [--context-tokens 1500]
        [--steps 48] [--top-k 64] [--out FILE.json]

The engine gathers every recalled row from host memory every step (68 MB a step on the 8B shape
at 8 x 4k, K 64). If consecutive steps' top-K sets of a (layer, KV head) plane mostly agree, a
gather of only the positions new to the set, the other rows kept in place, would move a fraction
of that. This runs the real SmolLM2 on the demo's needle prompt with the ``"specache"`` preset
(K = ``--top-k``), greedy, one slot, and after every step reads the indices the step chose for
the next one (``recall.idx``): per plane and step, the share of the K positions that were
already in the set the step before (the first set is pre-decoding's, ranked on the low-bit
cache alone). Prints the distribution over planes and steps; ``--out`` keeps it with the run.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from minikv_compile import MiniKVConfig, minikv_compile
from minikv_compile.demo import build_needle_prompt
from minikv_compile.graphs.runtime import Request
from minikv_compile.models.smollm2 import load_smollm2


def shared(prev: torch.Tensor, cur: torch.Tensor) -> torch.Tensor:
    """(L, H_kv) share of each plane's valid positions in ``cur`` that ``prev`` holds too;
    prev, cur: (L, H_kv, K) int32, -1 unused."""
    hit = (cur[..., :, None] == prev[..., None, :]).any(-1) & (cur >= 0)
    valid = (cur >= 0).sum(-1).clamp(min=1)
    return hit.sum(-1) / valid


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--context-tokens", type=int, default=1500)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--top-k", type=int, default=64)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    on_cuda = torch.device(a.device).type == "cuda"
    model, tokenizer = load_smollm2(dtype=torch.bfloat16 if on_cuda else torch.float32,
                                    device=a.device)
    prompt = build_needle_prompt(tokenizer, a.context_tokens)
    cfg = MiniKVConfig.preset("specache", max_batch_size=1, max_prompt_len=len(prompt.input_ids),
                              max_new_tokens=a.steps + 1, recall_top_k=a.top_k,
                              compile=on_cuda, cuda_graphs=on_cuda)
    rt = minikv_compile(model, cfg).runtime
    rt.admit(0, Request(list(prompt.input_ids), a.steps + 1))
    sets, shares = [], []
    for _ in range(a.steps):
        rt.step()
        sets.append(rt.cache.recall.idx[:, 0].clone().cpu())          # (L, H_kv, K)
    for prev, cur in zip(sets, sets[1:]):
        shares.extend(shared(prev, cur).flatten().tolist())
    shares.sort()
    q = lambda f: shares[min(len(shares) - 1, int(f * len(shares)))]  # noqa: E731
    summary = dict(prompt_tokens=len(prompt.input_ids), top_k=a.top_k, steps=a.steps,
                   planes=int(sets[0][..., 0].numel()), samples=len(shares),
                   mean=statistics.fmean(shares), p10=q(0.10), p50=q(0.50), p90=q(0.90),
                   min=shares[0], device=a.device)
    print(json.dumps(summary, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
