"""How often does SpeCache's guess miss when tokens are drawn, not argmaxed (issue 47: the
resync's cost)? Row 1 guesses the next token greedily; a sampled token that differs is a miss,
and with ``recall_resync="always"`` each miss costs a pre-decoding step. SmolLM2 on the CPU
(fp32), the default cache with the resync on for every request, three prompts (the demo's at
1,500 passage tokens and two chat questions), 64 new tokens, greedy and at two temperatures::

    python perf/experiments/sample_misses.py
"""
from __future__ import annotations

import torch

from minikv_compile import MiniKVConfig, minikv_compile
from minikv_compile.demo import build_needle_prompt
from minikv_compile.models.smollm2 import load_smollm2

QUESTIONS = ("Write a short story about a lighthouse keeper.", "Explain how rainbows form.")


def main() -> None:
    model, tok = load_smollm2(dtype=torch.float32, device="cpu")
    prompts = [build_needle_prompt(tok, 1500).input_ids] + [
        list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                     return_dict=True)["input_ids"]) for q in QUESTIONS]
    cm = minikv_compile(model, MiniKVConfig(max_batch_size=1, max_new_tokens=64,
                                            max_prompt_len=max(map(len, prompts)),
                                            recall_resync="always"))
    for how in (dict(), dict(do_sample=True, temperature=0.7), dict(do_sample=True, temperature=1.0)):
        tokens = misses = 0
        for i, p in enumerate(prompts):
            out = cm.generate([p], max_new_tokens=64, eos_token_id=tok.eos_token_id,
                              eos_check_every=1, seed=i, **how)
            n = len(out.sequences[0]) - 1  # decode tokens (the first comes from the prefill)
            tokens += n
            misses += out.decode_steps - n - 1  # less admission's pre-decoding step
        print(f"{how or 'greedy'}: {misses} pre-decoding steps after misses in {tokens} decode "
              f"tokens ({100 * misses / tokens:.1f}% more steps)", flush=True)


if __name__ == "__main__":
    main()
