"""Issue 25: the README demo's question (``minikv_compile.demo``) at 2 and 4 bits, with and
without the Hadamard rotation before quantizing (``MiniKVConfig.rotation``).

    python perf/experiments/rotation_demo.py [--device cpu] [--context-tokens 1500] [--bits 2,4] [--budget 0.25]

Same prompt, model and budgets as ``make demo`` (25% heavy + 25% recent, the library's default
selection); prints each run's answer and whether it is right. CPU figures are accuracy figures.
"""
from __future__ import annotations

import argparse
import time

import torch

from minikv_compile import MiniKVConfig
from minikv_compile.demo import build_needle_prompt, run
from minikv_compile.models.smollm2 import load_smollm2


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--context-tokens", type=int, default=None, help="default: as the demo (4000 / 1500)")
    p.add_argument("--bits", default="2", help="comma-separated, from 2, 4")
    p.add_argument("--rotations", default="none,hadamard")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--budget", type=float, default=0.25,
                   help="heavy and recent budget each (0.5: KIVI, nothing evicted)")
    args = p.parse_args()
    on_cuda = torch.device(args.device).type == "cuda"
    dtype = torch.bfloat16 if on_cuda else torch.float32
    model, tokenizer = load_smollm2(dtype=dtype, device=args.device)
    prompt = build_needle_prompt(tokenizer, args.context_tokens or (4000 if on_cuda else 1500))
    print(f"prompt: {len(prompt.input_ids)} tokens, question: {prompt.question}")
    common = dict(max_batch_size=1, max_prompt_len=len(prompt.input_ids),
                  max_new_tokens=args.max_new_tokens, compile=on_cuda, cuda_graphs=on_cuda)
    for bits in (int(b) for b in args.bits.split(",")):
        for rotation in args.rotations.split(","):
            t0 = time.perf_counter()
            run(model, tokenizer, prompt, f"MiniKV, rotation={rotation}",
                MiniKVConfig.preset("snapkv", heavy_budget=args.budget, recent_budget=args.budget, bits=bits, rotation=rotation,
                             **common))
            print(f"({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
