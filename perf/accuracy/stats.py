"""The accuracy harness's statistics: Wilson and paired-bootstrap intervals, the summary of a
run's per-sample results, the Pareto front, and the agreement of two runs."""
from __future__ import annotations

import math
import random
from typing import Dict, List, Sequence, Tuple

from .tasks import TASKS


def wilson(successes: int, n: int, z: float = 1.96) -> Tuple[float, float]:
    """95% Wilson score interval of a proportion."""
    if n == 0:
        return (float("nan"), float("nan"))
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def paired_bootstrap(values: Sequence[Sequence[float]], stat, n_boot: int = 1000, seed: int = 0
                     ) -> Tuple[float, float]:
    """95% percentile interval of ``stat(*columns)`` over samples resampled with replacement.

    ``values``: one tuple per sample (e.g. (method score, full-cache score)); resampling whole
    tuples keeps the pairing.
    """
    n = len(values)
    if n == 0:
        return (float("nan"), float("nan"))
    rng = random.Random(seed)
    stats = []
    for _ in range(n_boot):
        pick = [values[rng.randrange(n)] for _ in range(n)]
        s = stat(*zip(*pick))
        if s is not None and math.isfinite(s):
            stats.append(s)
    if not stats:
        return (float("nan"), float("nan"))
    stats.sort()
    return (stats[int(0.025 * (len(stats) - 1))], stats[int(math.ceil(0.975 * (len(stats) - 1)))])


def _ratio_of_means(a, b):
    return sum(a) / sum(b) if sum(b) else None


def _ppl_ratio(nll_m, nll_f, tokens):
    return math.exp((sum(nll_m) - sum(nll_f)) / sum(tokens))


def pareto_front(points: Dict[str, Tuple[float, float]]) -> List[str]:
    """Names of the points no other point beats: (bytes, score) with fewer-or-equal bytes and a
    higher-or-equal score, one of them strictly."""
    front = []
    for name, (x, y) in points.items():
        if any(x2 <= x and y2 >= y and (x2 < x or y2 > y) for n2, (x2, y2) in points.items() if n2 != name):
            continue
        front.append(name)
    return sorted(front, key=lambda n: points[n][0])


def shortfall(entry: dict, reference: dict) -> str:
    """What a summary entry lacks of what ``reference`` (the full cache's entry) was measured on,
    in words (``"needle at 2048, 4096 only; no ppl, code"``), or "" when nothing. A run cut short
    by its time budget leaves a method without the longest needles or whole tasks, and its mean
    over the rest flatters it: such an entry is marked in the tables and kept off the front."""
    tasks, ref = entry.get("tasks", {}), reference.get("tasks", {})
    held = tasks.get("needle", {}).get("by_length", {})
    parts = []
    if "needle" in tasks and set(ref.get("needle", {}).get("by_length", ())) - set(held):
        parts.append("needle at " + ", ".join(sorted(held, key=float)) + " only")
    missing = [t for t in ref if t not in tasks]
    if missing:
        parts.append("no " + ", ".join(missing))
    return "; ".join(parts)


def summarize(units: List[dict], methods: Sequence[str], baseline: str = "minikv") -> Dict[str, dict]:
    """Per method: each task's score with its interval, relative to the full cache (paired), the
    paired difference to ``baseline`` (the paper's MiniKV) and the KV bytes; plus the mean
    relative score over the tasks present and the Pareto front of the methods measured on every
    task and needle length the full cache was (``shortfall``)."""
    rows: Dict[Tuple[str, str], List[dict]] = {}
    kv: Dict[Tuple[str, str], List[Tuple[int, int, int]]] = {}
    for u in units:
        key = (u["method"], u["task"])
        rows.setdefault(key, []).extend(u["rows"])
        kv.setdefault(key, []).append((len(u["rows"]), u["kv"]["formula_bytes"], u["kv"]["fp16_bytes"]))
    out: Dict[str, dict] = {}
    for method in methods:
        entry: Dict[str, object] = {"tasks": {}}
        for task in TASKS:
            mine = rows.get((method, task))
            if not mine:
                continue
            full = {r["id"]: r for r in rows.get(("full", task), [])}
            paired = [(r, full[r["id"]]) for r in mine if r["id"] in full]
            n_kv = sum(n for n, _, _ in kv[(method, task)])
            t: Dict[str, object] = {
                "n": len(mine),
                "kv_bytes": sum(n * b for n, b, _ in kv[(method, task)]) / n_kv,
                "kv_fraction": sum(n * b / f for n, b, f in kv[(method, task)]) / n_kv,
            }
            if task == "needle":
                hits = sum(r["score"] for r in mine)
                t.update(score=hits / len(mine), ci=wilson(int(hits), len(mine)))
                t["by_length"] = _grouped(mine, "length")
                t["by_depth"] = _grouped(mine, "depth")
                if paired:
                    pairs = [(a["score"], b["score"]) for a, b in paired]
                    t["rel"] = _ratio_of_means(*zip(*pairs))
                    t["rel_ci"] = paired_bootstrap(pairs, _ratio_of_means)
                    t["diff"] = sum(a - b for a, b in pairs) / len(pairs)
                    t["diff_ci"] = paired_bootstrap(pairs, lambda a, b: (sum(a) - sum(b)) / len(a))
            elif task == "ppl":
                nll, tok = sum(r["nll"] for r in mine), sum(r["tokens"] for r in mine)
                t["score"] = math.exp(nll / tok)
                t["ci"] = paired_bootstrap([(r["nll"], r["tokens"]) for r in mine],
                                           lambda a, b: math.exp(sum(a) / sum(b)))
                if paired:
                    triples = [(a["nll"], b["nll"], a["tokens"]) for a, b in paired]
                    ratio = _ppl_ratio(*zip(*triples))
                    lo, hi = paired_bootstrap(triples, _ppl_ratio)
                    t["ratio"], t["ratio_ci"] = ratio, (lo, hi)
                    t["rel"], t["rel_ci"] = 1.0 / ratio, (1.0 / hi, 1.0 / lo)
            else:
                scores = [r["score"] for r in mine]
                t["score"] = sum(scores) / len(scores)
                t["ci"] = paired_bootstrap([(s,) for s in scores], lambda a: sum(a) / len(a))
                t["exact"] = sum(r["pred"] == r["answer"] for r in mine) / len(mine)
                if paired:
                    pairs = [(a["score"], b["score"]) for a, b in paired]
                    t["rel"] = _ratio_of_means(*zip(*pairs))
                    t["rel_ci"] = paired_bootstrap(pairs, _ratio_of_means)
            base = {r["id"]: r for r in rows.get((baseline, task), [])}
            against = [(r, base[r["id"]]) for r in mine if r["id"] in base]
            if against and method != baseline:
                t["vs_baseline"] = _versus(task, against)
            entry["tasks"][task] = t
        tasks = entry["tasks"]
        if tasks:
            entry["kv_fraction"] = sum(t["kv_fraction"] for t in tasks.values()) / len(tasks)
            rels = [t["rel"] for t in tasks.values() if t.get("rel") is not None]
            entry["rel"] = sum(rels) / len(rels) if len(rels) == len(tasks) else None
            out[method] = entry
    ref = out.get("full", {})
    points = {m: (e["kv_fraction"], e["rel"]) for m, e in out.items()
              if e.get("rel") is not None and not shortfall(e, ref)}
    for m in pareto_front(points):
        out[m]["pareto"] = True
    return out


def mode_contrast(units: List[dict], methods: Sequence[str], mode_of, first: str = "context-first",
                  last: str = "question-last") -> Dict[str, dict]:
    """Per method and task, ``first`` mode against ``last`` on the same samples (paired, as
    ``_versus``: needle and code the mean score difference first - last, perplexity the ratio
    first / last); ``mode_of(unit)`` reads a unit's mode. Methods with no pair are left out."""
    rows: Dict[Tuple[str, str, str], Dict[str, dict]] = {}
    for u in units:
        rows.setdefault((u["method"], u["task"], mode_of(u)), {}).update({r["id"]: r for r in u["rows"]})
    out: Dict[str, dict] = {}
    for method in methods:
        for task in TASKS:
            a, b = rows.get((method, task, first), {}), rows.get((method, task, last), {})
            pairs = [(a[i], b[i]) for i in a if i in b]
            if pairs:
                out.setdefault(method, {})[task] = _versus(task, pairs)
    return out


def _versus(task: str, pairs: List[Tuple[dict, dict]]) -> Dict[str, object]:
    """Paired difference of one method to another on the same samples: needle and code as
    mean score difference, perplexity as a ratio; each with its bootstrap 95% interval."""
    if task == "ppl":
        triples = [(a["nll"], b["nll"], a["tokens"]) for a, b in pairs]
        return {"n": len(pairs), "ratio": _ppl_ratio(*zip(*triples)), "ci": paired_bootstrap(triples, _ppl_ratio)}
    values = [(a["score"], b["score"]) for a, b in pairs]
    diff = lambda a, b: (sum(a) - sum(b)) / len(a)  # noqa: E731
    return {"n": len(pairs), "diff": diff(*zip(*values)), "ci": paired_bootstrap(values, diff)}


def _grouped(rows: List[dict], key: str) -> Dict[str, float]:
    groups: Dict[str, List[float]] = {}
    for r in rows:
        groups.setdefault(str(r[key]), []).append(r["score"])
    return {k: sum(v) / len(v) for k, v in sorted(groups.items(), key=lambda kv: float(kv[0]))}
