"""How sure is SmolLM2-135M of the demo's answer, and would another needle or question do
better? (issue 47: the GPU's default answered the demo wrong.) For each candidate (a KJV verse
as the needle, a question only it answers, the words a right answer holds), HF's own greedy
generate, uncompressed, fp32 on the CPU, at 1,500 and 4,000 tokens of context: the answer,
whether it is right, and the smallest margin (nats) between the two likeliest tokens along it
up to the first expected word (where a small change to the attention could turn it); then the
same question with no needle (a right answer there is a guess)::

    python perf/experiments/demo_needles.py
"""
from __future__ import annotations

import torch

import minikv_compile.demo as demo
from minikv_compile.models.smollm2 import load_smollm2
from minikv_compile.texts import kjv_verses

THARSHISH = ("1 Kings", 10, 22)
CANDIDATES = [  # (needle, question, expected words); the demo's own first
    (THARSHISH, demo.QUESTION, demo.EXPECTED),
    (THARSHISH, "Which animals did the navy of Tharshish bring?", ("apes", "peacocks")),
    (THARSHISH, "Which two animals did the navy of Tharshish bring once in three years?",
     ("apes", "peacocks")),
    (THARSHISH, "What did the navy of Tharshish bring besides gold and silver?",
     ("ivory", "apes", "peacocks")),
    (THARSHISH, "How often did the navy of Tharshish come?", ("three years",)),
    (("Daniel", 3, 1), "In which plain did Nebuchadnezzar set up the image of gold?", ("dura",)),
    (("Genesis", 36, 24), "What did Anah find in the wilderness?", ("mules",)),
    (("Numbers", 13, 23), "What did they bear between two upon a staff?", ("grapes",)),
    (("Esther", 1, 1), "Over how many provinces did Ahasuerus reign?",
     ("127", "hundred and seven and twenty", "hundred twenty-seven")),
    (("1 Kings", 4, 26), "How many stalls of horses did Solomon have for his chariots?",
     ("forty thousand", "40,000", "40000")),
    (("Ezekiel", 27, 12), "With which metals did Tarshish trade in the fairs?",
     ("tin", "lead", "iron")),
]
LENGTHS = (1500, 4000)


def main() -> None:
    model, tok = load_smollm2(dtype=torch.float32, device="cpu")
    verses = {(v.book, v.chapter, v.verse): v.text for v in kjv_verses()}

    def greedy(ids):
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True)
        new = out.sequences[0, len(ids):]
        margins = [float(t[0] - t[1]) for t in
                   (s[0].float().log_softmax(-1).topk(2).values for s in out.scores)]
        return new, margins

    for needle, question, expected in CANDIDATES:
        print(f"{needle} {verses[needle][:80]!r}...\n  Q: {question}", flush=True)
        demo.NEEDLE, demo.QUESTION, demo.EXPECTED = needle, question, expected
        for n in LENGTHS:
            new, margins = greedy(demo.build_needle_prompt(tok, n).input_ids)
            text = tok.decode(new, skip_special_tokens=True)
            upto, seen = len(new), ""
            for i, t in enumerate(new):
                seen += tok.decode([int(t)])
                if demo.answer_is_right(seen, expected):
                    upto = i + 1
                    break
            print(f"  {n}: {'right' if demo.answer_is_right(text, expected) else 'wrong'}, "
                  f"smallest margin {min(margins[:upto]):.2f}: {text!r}", flush=True)
        demo.NEEDLE = ("Proverbs", 1, 1)  # a verse the haystack holds anyway: no needle
        new, _ = greedy(demo.build_needle_prompt(tok, LENGTHS[0]).input_ids)
        text = tok.decode(new, skip_special_tokens=True)
        print(f"  no needle: {'right' if demo.answer_is_right(text, expected) else 'wrong'}: "
              f"{text!r}", flush=True)


if __name__ == "__main__":
    main()
