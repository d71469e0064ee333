"""Does ``recall_resync`` fix the GPU demo (issue 47)? The demo's prompt (4,000 passage tokens on
a GPU) answered greedily by the compiled, graph-replayed engine with several caches, at several
passage lengths: each answer, whether it is right, and the decode steps against the tokens they
made, looked at every step (steps - (tokens - 1) = the pre-decoding steps, which make no token:
a recall cache's first, and with the resync one a missed guess)::

    python perf/experiments/demo_resync.py [--lengths 4000,1500,3000,6000] [--device cuda]

Prints one line a (length, cache) and writes them as JSON to ``--out`` if given.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from minikv_compile import MiniKVConfig, minikv_compile
from minikv_compile.demo import answer_is_right, build_needle_prompt
from minikv_compile.models.smollm2 import load_smollm2

CACHES = {  # (at 103c77b the resync was off by default: "default" there is "default-off" here,
            # "default+resync" there "default" here, and the same for recall128)
    "default-off": dict(recall_resync="off"),
    "default": {},
    "recall128-off": dict(recall_top_k=128, recall_resync="off"),
    "recall128": dict(recall_top_k=128),
    "uncompressed": dict(heavy_budget=1.0, recent_budget=1.0, bits=16, recall_top_k=0),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--lengths", default="4000,1500,3000,6000")
    p.add_argument("--caches", default=",".join(CACHES))
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    on_cuda = torch.device(a.device).type == "cuda"
    model, tok = load_smollm2(dtype=torch.bfloat16 if on_cuda else torch.float32, device=a.device)
    prompts = {n: build_needle_prompt(tok, n) for n in map(int, a.lengths.split(","))}
    longest = max(len(pr.input_ids) for pr in prompts.values())
    rows = []
    for name in a.caches.split(","):
        t0 = time.perf_counter()
        cm = minikv_compile(model, MiniKVConfig(max_batch_size=1, max_prompt_len=longest,
                                                max_new_tokens=a.new_tokens, compile=on_cuda,
                                                cuda_graphs=on_cuda, **CACHES[name]))
        setup = time.perf_counter() - t0
        for n, pr in prompts.items():
            out = cm.generate([pr.input_ids], max_new_tokens=a.new_tokens,
                              eos_token_id=tok.eos_token_id, eos_check_every=1)
            answer = tok.decode(out.sequences[0], skip_special_tokens=True).strip()
            row = dict(length=n, prompt_tokens=len(pr.input_ids), cache=name, answer=answer,
                       right=answer_is_right(answer, pr.expected), tokens=len(out.sequences[0]),
                       decode_steps=out.decode_steps,
                       pre_steps=out.decode_steps - (len(out.sequences[0]) - 1),
                       setup_s=round(setup, 1))
            rows.append(row)
            print(f"{n:5d} {name:18s} right={row['right']!s:5s} tokens {row['tokens']:3d} "
                  f"pre-decoding steps {row['pre_steps']:2d}  {answer[:90]!r}", flush=True)
        del cm
        if on_cuda:
            torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name() if on_cuda else "cpu",
                           torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
