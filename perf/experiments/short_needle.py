"""Where does eviction start to cost answers? The accuracy harness's needle task (its prompts,
its exact-match score) at prompt lengths below the harness's shortest (2048), SmolLM2 fp32 on the
CPU: the uncompressed cache, the library default with the budgets alone (``kept_floor=1``, it
evicts at every length) and with the floor (nothing evicted up to ``kept_floor``), the two
caches that differ only in eviction.

Usage: python perf/experiments/short_needle.py [--lengths 256,512,1024] [--per-cell 2]
       [--floor 1024] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from minikv_compile import MiniKVConfig, minikv_compile
from minikv_compile.models.smollm2 import load_smollm2
from minikv_compile.texts import kjv_verses
from minikv_compile.perf.accuracy.tasks import Corpora, HFCodec, Plan, first_number, needle_samples

DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="256,512,1024")
    ap.add_argument("--per-cell", type=int, default=2)
    ap.add_argument("--floor", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lengths = tuple(int(x) for x in args.lengths.split(","))
    torch.set_num_threads(2)
    model, tok = load_smollm2(dtype=torch.float32)
    codec = HFCodec(tok)
    # the KJV alone (no download): the harness's first prose family
    corpora = Corpora(prose=(("KJV", "\n".join(v.text for v in kjv_verses())),), code=())
    plan = Plan("short", lengths, DEPTHS, args.per_cell, 24, 0, 0, 0, 0, 0, 0, args.batch, 0)
    samples = needle_samples(codec, corpora, plan)
    cap = dict(max_prompt_len=max(lengths), max_new_tokens=24, max_batch_size=args.batch)
    methods = {
        "full": MiniKVConfig.preset("snapkv", bits=16, heavy_budget=1.0, recent_budget=1.0, **cap),
        "default_no_floor": MiniKVConfig.preset("snapkv", kept_floor=1, **cap),
        f"default_floor{args.floor}": MiniKVConfig.preset("snapkv", kept_floor=args.floor, **cap),
    }
    print(f"# SmolLM2 fp32 CPU, torch {torch.__version__}, {len(samples)} needle prompts, "
          f"lengths {lengths}, depths {DEPTHS} x {args.per_cell}", flush=True)
    results = {}
    for name, config in methods.items():
        t = time.time()
        cm = minikv_compile(model, config)
        right = {L: 0 for L in lengths}
        for i in range(0, len(samples), args.batch):
            chunk = samples[i: i + args.batch]
            out = cm.generate([s["prompt"] for s in chunk], max_new_tokens=24,
                              eos_token_id=codec.eos_id).sequences
            for s, seq in zip(chunk, out):
                right[s["length"]] += first_number(codec.decode(seq)) == s["answer"]
        n = len(samples) // len(lengths)
        results[name] = {L: right[L] / n for L in lengths}
        print(f"{name:22s} " + "  ".join(f"{L}: {right[L]:2d}/{n}" for L in lengths)
              + f"   {time.time() - t:.0f} s", flush=True)
        del cm
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(lengths=lengths, per_length=len(samples) // len(lengths),
                           results=results), f, indent=1)


if __name__ == "__main__":
    main()
