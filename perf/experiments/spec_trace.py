"""SpeCache's speculation step by step (issue 47: on the CPU in bf16, recall 128 answers the demo
"gold, silver, and precious gems" greedily although teacher forcing keeps " ivory" ahead at that
branch). Each decode step feeds row 0 the newest token and row 1 a guess of the token after it
(the speculation), whose attention picks the positions the next step recalls. This prints, for
one greedy generation with the demo's prompt, each step's two tokens and whether the guess was
right (it equals the token row 0 feeds next) or else an echo (row 1 feeds the token row 0
feeds: the guess lags one position) or a miss, then the counts::

    python perf/experiments/spec_trace.py --dtype bf16 --recall-top-k 128
"""
from __future__ import annotations

import argparse

import torch

import minikv_compile.graphs.decode as decode
from minikv_compile import MiniKVConfig, minikv_compile
from minikv_compile.demo import build_needle_prompt
from minikv_compile.models.smollm2 import load_smollm2


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bf16", choices=("fp32", "bf16"))
    p.add_argument("--recall-top-k", type=int, default=64)
    p.add_argument("--context-tokens", type=int, default=4000)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--resync", action="store_true",
                   help="recall_resync='greedy' (the default since; without the flag 'off'): "
                        "after a miss, a pre-decoding step (the chosen token fed in both rows, "
                        "nothing recorded) puts the pair back in phase")
    a = p.parse_args()
    fed = []  # (row 0's token, row 1's token, pre-decoding) at each step, slot 0
    begin = decode.RecallDecodeStep.begin

    def logged(self, slots):
        st = self.state
        if bool(st.active[0]) and not bool(st.done[0]):  # (steps after eos change nothing)
            fed.append((int(st.tokens[0]), int(st.spec[0]), bool(st.pre[0])))
        return begin(self, slots)

    decode.RecallDecodeStep.begin = logged  # eager on the CPU: every step runs this
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    model, tok = load_smollm2(dtype=dtype, device="cpu")
    prompt = build_needle_prompt(tok, a.context_tokens)
    cm = minikv_compile(model, MiniKVConfig(max_batch_size=1, max_prompt_len=len(prompt.input_ids),
                                            max_new_tokens=a.new_tokens,
                                            recall_top_k=a.recall_top_k,
                                            recall_resync="greedy" if a.resync else "off"))
    out = cm.generate([prompt.input_ids], max_new_tokens=a.new_tokens,
                      eos_token_id=tok.eos_token_id)
    print(f"{a.dtype}, recall_top_k={a.recall_top_k}{', resync' if a.resync else ''}: "
          f"{tok.decode(list(out.sequences[0]), skip_special_tokens=True)!r}")
    print(f"steps {len(fed)}, of them pre-decoding {sum(s[2] for s in fed)}")
    steps = [s for s in fed if not s[2]]
    counts = {"right": 0, "miss": 0, "echo": 0}
    for i, (t, s, _) in enumerate(steps):
        nxt = steps[i + 1][0] if i + 1 < len(steps) else None
        kind = ("-" if nxt is None else "right" if s == nxt else "echo" if s == t else "miss")
        counts[kind] = counts.get(kind, 0) + 1
        print(f"  {i:3d} row 0 {tok.decode([t])!r:14s} row 1 {tok.decode([s])!r:14s} {kind}")
    print("counts:", counts)


if __name__ == "__main__":
    main()
