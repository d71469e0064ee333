"""The demo's answer at its branch point, teacher-forced, for several caches (issue 47: on the
GPU the default answers "gold, silver, and precious gems" where the uncompressed cache says
"... and ivory"). Each cache is given the demo's prompt and the stem "The navy of Tharshish
brought once in three years of gold, silver, and", then " ivory" or " precious" (one sequence
each, one batch), and the log-probabilities of both last tokens are printed: their difference is
the margin by which the cache would choose "ivory" there; then the cache's own greedy answer. Teacher forcing speculates the forced
token (SpeCache's row 1 is always right); greedy generation speculates its own guess, so a
margin here that differs from a greedy run's choice points at the speculation, one that differs
between devices at the same dtype at the kernels::

    python perf/experiments/demo_branch.py --dtype fp32                # CPU references
    python perf/experiments/demo_branch.py --device cuda --dtype bf16  # the GPU demo's setting
"""
from __future__ import annotations

import argparse

import torch

from minikv_compile import MiniKVConfig, minikv_compile
from minikv_compile.demo import answer_is_right, build_needle_prompt
from minikv_compile.models.smollm2 import load_smollm2

STEM = "The navy of Tharshish brought once in three years of gold, silver, and"
CACHES = {"uncompressed": dict(bits=16, heavy_budget=1.0, recent_budget=1.0), "default": {},
          "k128": dict(recall_top_k=128), "g32": dict(group_size=32),
          "g16": dict(group_size=16), "no-rotation": dict(rotation="none"),
          "no-recall": dict(recall_top_k=0)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--context-tokens", type=int, default=4000, help="as the demo's (GPU: 4000)")
    p.add_argument("--caches", default=",".join(CACHES))
    a = p.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    model, tok = load_smollm2(dtype=dtype, device=a.device)
    prompt = build_needle_prompt(tok, a.context_tokens)
    right = tok(STEM + " ivory", add_special_tokens=False)["input_ids"]
    wrong = tok(STEM + " precious", add_special_tokens=False)["input_ids"]
    assert right[:-1] == wrong[:-1], "the two answers must share the stem's tokens"
    cuda = torch.device(a.device).type == "cuda"
    common = dict(max_batch_size=2, max_prompt_len=len(prompt.input_ids), max_new_tokens=48,
                  compile=cuda, cuda_graphs=cuda)
    print(f"{len(prompt.input_ids)} prompt tokens on {a.device} in {a.dtype}; the stem "
          f"{len(right) - 1} tokens")
    for name in a.caches.split(","):
        cm = minikv_compile(model, MiniKVConfig(**common, **CACHES[name]))
        lr, lw = cm.teacher_force([prompt.input_ids] * 2, [right, wrong])
        out = cm.generate([prompt.input_ids], max_new_tokens=48, eos_token_id=tok.eos_token_id)
        answer = tok.decode(out.sequences[0], skip_special_tokens=True).strip()
        print(f"{name:13s} ivory {float(lr[-1]):6.2f}  precious {float(lw[-1]):6.2f}  margin "
              f"{float(lr[-1] - lw[-1]):+.2f}  the stem's log-probability {float(lr[:-1].sum()):.2f}"
              f"\n{'':13s} greedy: {answer!r} ({'right' if answer_is_right(answer, prompt.expected) else 'wrong'})",
              flush=True)
        del cm
        if cuda:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
