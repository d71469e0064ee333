"""Issue 25: paired differences between two methods of one accuracy-harness run (same samples).

    python perf/experiments/rotation_paired.py RUN.json BASE OTHER [OTHER ...]

Needle: the discordant pairs (right with one method only) and the exact two-sided sign-test p
over them (McNemar's exact test). Perplexity: OTHER / BASE as the ratio of the perplexities of
the pooled tokens, with a paired bootstrap 95% interval over documents, and per document. Code:
the difference of mean edit similarity, paired bootstrap 95%.
"""
from __future__ import annotations

import json
import math
import sys

from minikv_compile.perf.accuracy.stats import paired_bootstrap


def _rows(data, method, task):
    return {r["id"]: r for u in data["units"] if u["method"] == method and u["task"] == task
            for r in u["rows"]}


def _sign_test(a: int, b: int) -> float:
    n = a + b
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(a, b) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def compare(data, base: str, other: str) -> None:
    print(f"== {other} vs {base}")
    x, y = _rows(data, base, "needle"), _rows(data, other, "needle")
    ids = sorted(set(x) & set(y))
    if ids:
        only_base = sum(x[i]["score"] > y[i]["score"] for i in ids)
        only_other = sum(y[i]["score"] > x[i]["score"] for i in ids)
        print(f"needle: n={len(ids)}  {base} {sum(x[i]['score'] for i in ids):.0f} right, "
              f"{other} {sum(y[i]['score'] for i in ids):.0f} right; right only with {base}: "
              f"{only_base}, only with {other}: {only_other}; sign test p={_sign_test(only_base, only_other):.3f}")
    x, y = _rows(data, base, "ppl"), _rows(data, other, "ppl")
    ids = sorted(set(x) & set(y))
    if ids:
        pairs = [(y[i]["nll"], x[i]["nll"], y[i]["tokens"]) for i in ids]

        def ratio(a, b, t):
            return math.exp((sum(a) - sum(b)) / sum(t))

        lo, hi = paired_bootstrap(pairs, ratio)
        print(f"ppl: n={len(ids)} docs  {other}/{base} = {ratio(*zip(*pairs)):.4f} [{lo:.4f}, {hi:.4f}]; "
              f"per doc: " + " ".join(f"{y[i]['ppl'] / x[i]['ppl']:.3f}" for i in ids))
    x, y = _rows(data, base, "code"), _rows(data, other, "code")
    ids = sorted(set(x) & set(y))
    if ids:
        pairs = [(y[i]["score"], x[i]["score"]) for i in ids]
        lo, hi = paired_bootstrap(pairs, lambda a, b: 100 * (sum(a) - sum(b)) / len(a))
        d = 100 * sum(a - b for a, b in pairs) / len(pairs)
        print(f"code: n={len(ids)}  delta ES {d:+.1f} [{lo:+.1f}, {hi:+.1f}] points")


def main() -> None:
    path, base, *others = sys.argv[1:]
    data = json.load(open(path))
    for other in others:
        compare(data, base, other)


if __name__ == "__main__":
    main()
