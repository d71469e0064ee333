"""The accuracy harness's reports: JSON written atomically, the markdown tables and the plot of
accuracy against KV bytes."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from minikv_compile.perf.report import jsonable
from .stats import pareto_front, shortfall
from .tasks import TASKS

SCHEMA = "minikv_compile.perf.accuracy/1"
PLOT_NAME = "accuracy.png"

_NUMBER_LIST = re.compile(r"\[\s+(-?[\d.eE+-]+(?:,\s+-?[\d.eE+-]+)*)\s+\]")


def to_json(data) -> str:
    """Indented JSON with every list of numbers (token ids, intervals) on one line."""
    text = json.dumps(jsonable(data), indent=1, allow_nan=False)
    return _NUMBER_LIST.sub(lambda m: "[" + ", ".join(m.group(1).replace(",", " ").split()) + "]", text)


def _brief(check: Dict[str, dict]) -> Dict[str, object]:
    return {t: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in c.items() if k != "mismatches"}
            for t, c in check.items()}


# -- markdown -------------------------------------------------------------------------------------


def _pct(x, digits=1) -> str:
    return "–" if x is None else f"{100 * x:.{digits}f}"


def _ci(ci, scale=100.0, digits=1) -> str:
    if not ci or ci[0] is None or any(isinstance(v, float) and not math.isfinite(v) for v in ci):
        return ""
    return f" [{scale * ci[0]:.{digits}f}, {scale * ci[1]:.{digits}f}]"


def render_markdown(data: dict) -> str:
    env, model = data.get("environment", {}), data.get("model", {})
    dev = env.get("device", {})
    git = env.get("git", {}) or {}
    lines = [
        f"# Accuracy: {data['part']}",
        "",
        f"{model.get('model', model.get('name'))}, {model.get('dtype')} on {dev.get('name', dev.get('type'))}; "
        f"torch {env.get('torch')}, triton {env.get('triton')}, transformers {env.get('transformers')}, "
        f"Python {env.get('python')}; git {str(git.get('sha'))[:10]}{' (dirty)' if git.get('dirty') else ''}; "
        f"{env.get('timestamp')}.",
        f"Engine: compile={data['engine']['compile']}, cuda_graphs={data['engine']['cuda_graphs']}, "
        f"batch {data['engine']['max_batch_size']}. Status: "
        f"{'finished' if data.get('finished') else 'incomplete'} after {data.get('elapsed_s', 0):.0f} s"
        + (f" in {len(data['extended']) + 1} processes (`--extend`), the first started "
           f"{data['extended'][0]['timestamp']}." if data.get("extended") else ".")
        + (f" With the units of {len(data['merged'])} run(s) made beside it (`--merge`): "
           + ", ".join(f"{m['source']} ({m.get('elapsed_s', 0):.0f} s)" for m in data["merged"])
           + "." if data.get("merged") else ""),
        "",
    ]
    plan = data["plan"]
    counts = {t: len(s) for t, s in data["samples"].items()}
    lines += [
        f"Samples: needle {counts.get('needle', 0)} (lengths {plan['needle_lengths']}, depths "
        f"{plan['needle_depths']}, {plan['needle_per_cell']} each), ppl {counts.get('ppl', 0)} documents "
        f"({plan['ppl_prefix']} prefilled + {plan['ppl_continuation']} teacher-forced), code "
        f"{counts.get('code', 0)} lines ({plan['code_context']} tokens of context). "
        f"Fingerprints: {', '.join(f'{k} `{v}`' for k, v in data['fingerprints'].items())}.",
        "",
        "KV = bytes of one sequence's cache by the paper's formula at the task's prompt length and "
        "generated tokens, as % of the fp16 cache (averaged over tasks; the 16-bit ring of at most "
        "128 tokens is extra, in the JSON). Needle: exact match %, 95% Wilson interval. PPL: "
        "perplexity of the teacher-forced continuation; ×full = ratio to the full cache, paired "
        "bootstrap 95%. Code: edit similarity ×100. rel = score relative to the full cache "
        "(perplexity: full / method); avg rel = mean over tasks; P = on the Pareto front of "
        "(KV, avg rel).",
        "",
    ]
    labels = {m["name"]: m["label"] for m in data["methods"]}
    modes = data.get("modes") or ["question-last"]
    if modes != ["question-last"]:
        lines += _modes_section(data, labels)
    if "question-last" in modes:
        if modes != ["question-last"]:
            lines += ["", "### Question last (the rest of this page is this mode's)", ""]
        lines += _main_table(data["summary"], labels)
    versus = {name: e["tasks"] for name, e in data["summary"].items()
              if any("vs_baseline" in t for t in e["tasks"].values())}
    if versus:
        lines += ["", "Against the paper's MiniKV on the same samples (paired; bootstrap 95%): needle and "
                  "code as differences in points, perplexity as a ratio (< 1 is better):", "",
                  "| method | KV % | Δ needle EM | PPL ×MiniKV | Δ code ES |", "|---|---:|---:|---:|---:|"]
        for name, tasks in versus.items():
            cells = []
            for task in TASKS:
                v = tasks.get(task, {}).get("vs_baseline")
                if v is None:
                    cells.append("–")
                elif task == "ppl":
                    cells.append(f"{v['ratio']:.3f}{_ci(v['ci'], 1, 3)}")
                else:
                    cells.append(f"{100 * v['diff']:+.1f}{_ci(v['ci'])}")
            lines.append(f"| {labels.get(name, name)} | {_pct(data['summary'][name].get('kv_fraction'))} | "
                         + " | ".join(cells) + " |")
    needle = {name: e["tasks"]["needle"] for name, e in data["summary"].items() if "needle" in e["tasks"]}
    if needle:
        for key, title in (("by_length", "prompt tokens"), ("by_depth", "depth")):
            cols = sorted({k for t in needle.values() for k in t[key]}, key=float)
            lines += ["", f"Needle exact match % by {title}:", "",
                      "| method | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
            for name, t in needle.items():
                lines.append(f"| {labels.get(name, name)} | "
                             + " | ".join(_pct(t[key].get(c), 0) for c in cols) + " |")
    budgets = [u for u in data["units"] if any(m["name"] == u["method"] and m["match_bytes_of"]
                                                for m in data["methods"])]
    if budgets:
        lines += ["", "Budgets matched to MiniKV's KV bytes of the prompt (16 bit, half heavy, half recent; "
                  "generated tokens are kept in 16 bit on top):", ""]
        for u in budgets:
            kept = u["config"]["heavy_budget"] + u["config"]["recent_budget"]
            lines.append(f"- {u['method']} {u['task']} {u['group']}: {100 * kept:.1f}% kept at "
                         f"L={u['kv']['prompt_len']}, {u['kv']['new_tokens']} new tokens")
    check = data.get("hf_check")
    if check:
        lines += ["", f"Full cache against the unwrapped HF model ({'exact' if check['exact'] else 'tolerance'} "
                  f"check, {check['samples_per_task']} samples per task): "
                  f"**{'passed' if check['passed'] else 'FAILED'}** — `{json.dumps(_brief(check['tasks']))}`"]
    if data.get("skipped"):
        lines += ["", "Skipped by the time budget: "
                  + ", ".join(f"{s['method']}/{s['task']}/{s['group']}" + (f" ({s['mode']})" if s.get("mode") else "")
                     for s in data["skipped"])]
    if data.get("notes"):
        lines += ["", "Notes:", ""] + [f"- {n}" for n in data["notes"]]
    return "\n".join(lines) + "\n"


def _main_table(summary: Dict[str, dict], labels: Dict[str, str]) -> List[str]:
    lines = ["| method | KV % | needle EM % | needle rel | PPL | PPL ×full | code ES | code rel | avg rel | P |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|:-:|"]
    for name, e in summary.items():
        t = e["tasks"]
        n, p, c = t.get("needle", {}), t.get("ppl", {}), t.get("code", {})
        lines.append(
            f"| {_label(name, e, summary, labels)} | {_pct(e.get('kv_fraction'))} | "
            f"{_pct(n.get('score'))}{_ci(n.get('ci'))} | {_num(n.get('rel'))}{_ci(n.get('rel_ci'), 1, 2)} | "
            f"{_num(p.get('score'))} | {_num(p.get('ratio'), 3)}{_ci(p.get('ratio_ci'), 1, 3)} | "
            f"{_pct(c.get('score'))}{_ci(c.get('ci'))} | {_num(c.get('rel'))}{_ci(c.get('rel_ci'), 1, 2)} | "
            f"{_num(e.get('rel'), 3)} | {'*' if e.get('pareto') else ''} |")
    return lines


def _label(name: str, e: dict, summary: Dict[str, dict], labels: Dict[str, str]) -> str:
    """The method's label, with what it lacks of the full cache's measurements (``shortfall``)."""
    short = shortfall(e, summary.get("full", {}))
    return labels.get(name, name) + (f" ({short})" if short else "")


_MODE_TITLES = {"question-last": "question last", "context-first": "context first"}


def _modes_section(data: dict, labels: Dict[str, str]) -> List[str]:
    """Both modes side by side (needle %, perplexity ×full, KV %), the paired contrast
    context-first - question-last, each mode's own full table, and the methods not run."""
    by_mode = data.get("summary_by_mode", {})
    contrast = data.get("mode_contrast", {})
    modes = [m for m in ("question-last", "context-first") if m in (data.get("modes") or [])]
    lines = [
        "## Question last and context first",
        "",
        "Question last: the whole prompt is prefilled and compressed at once, so selection sees the "
        "question. Context first: the document (needle: chat prefix + haystack; perplexity and code: "
        "the prompt but its last 32 tokens) is compressed by `cache_prompt` before any question "
        "exists, then the prompt runs through that cache, only the tail prefilled and kept whole. "
        "Same samples in both modes; Δ and ratio are paired (context first against question last, "
        "bootstrap 95%); ×full is against the full cache in the same mode. KV %: the compressed "
        "document plus the tail and generated tokens, by the formula.",
        "",
        "| method | " + " | ".join(f"KV % {_MODE_TITLES[m]}" for m in modes) + " | "
        + " | ".join(f"needle % {_MODE_TITLES[m]}" for m in modes) + " | Δ needle (points) | "
        + " | ".join(f"PPL ×full {_MODE_TITLES[m]}" for m in modes) + " | PPL CF/QL |",
        "|---|" + "---:|" * (3 * len(modes) + 2),
    ]
    unsupported = {}
    for u in data.get("unsupported", []):
        unsupported.setdefault(u["method"], set()).add(u["mode"])
    for m in data["methods"]:
        name = m["name"]
        entries = [by_mode.get(mode, {}).get(name) for mode in modes]
        if all(e is None for e in entries) and name not in unsupported:
            continue

        def cell(mode, e, fmt):
            if e is None:
                return "not supported" if mode in unsupported.get(name, ()) else "–"
            return fmt(e)

        kv = [cell(md, e, lambda e: _pct(e.get("kv_fraction"))) for md, e in zip(modes, entries)]
        needle = [cell(md, e, lambda e: _pct(e["tasks"].get("needle", {}).get("score"))
                       + _ci(e["tasks"].get("needle", {}).get("ci"))) for md, e in zip(modes, entries)]
        ppl = [cell(md, e, lambda e: _num(e["tasks"].get("ppl", {}).get("ratio"), 3)
                    + _ci(e["tasks"].get("ppl", {}).get("ratio_ci"), 1, 3)) for md, e in zip(modes, entries)]
        shorts = {md: shortfall(e, by_mode[md].get("full", {}))
                  for md, e in zip(modes, entries) if e is not None}
        short = ("; ".join(sorted(set(shorts.values()) - {""})) if len(set(shorts.values())) < 2
                 else ". ".join(f"{_MODE_TITLES[md]}: {s}" for md, s in shorts.items() if s))
        c = contrast.get(name, {})
        dn = c.get("needle")
        dn = "–" if dn is None else f"{100 * dn['diff']:+.1f}{_ci(dn['ci'])}"
        dp = c.get("ppl")
        dp = "–" if dp is None else f"{dp['ratio']:.3f}{_ci(dp['ci'], 1, 3)}"
        lines.append(f"| {labels.get(name, name)}{f' ({short})' if short else ''} | "
                     + " | ".join(kv) + " | " + " | ".join(needle)
                     + f" | {dn} | " + " | ".join(ppl) + f" | {dp} |")
    if "context-first" in by_mode:
        lines += ["", "### Context first", ""] + _main_table(by_mode["context-first"], labels)
    if data.get("unsupported"):
        lines += ["", "Not run (the method cannot run in that mode):", ""]
        lines += [f"- {u['method']} {u['task']}/{u['group']} {u['mode']}: {u['reason']}"
                  for u in data["unsupported"]]
    return lines


def _num(x, digits=2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


# -- the plot -------------------------------------------------------------------------------------


def plot(out_dir: Path) -> Optional[Path]:
    """Score against KV bytes, one panel per task plus the mean relative score, from every
    ``main.json`` / ``sweep.json`` in ``out_dir``; the Pareto front of each panel dashed.
    Context-first results (``summary_by_mode``) are drawn hollow in their method's marker and
    colour, joined to the same method's question-last point by a thin line.
    Returns None (with a message) when matplotlib is not importable."""
    try:
        import matplotlib
        import matplotlib.ticker

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("accuracy: matplotlib is not importable, no PNG written (pip install matplotlib, then "
              f"python -m minikv_compile.perf.accuracy --plot-only --out {out_dir})", flush=True)
        return None
    parts = {}
    for part in ("main", "sweep", "quick"):
        path = Path(out_dir) / f"{part}.json"
        if path.is_file():
            parts[part] = json.loads(path.read_text())
    if not parts:
        return None
    panels = (("needle", "needle retrieval: exact match", lambda t: t.get("score")),
              ("ppl", "decode perplexity: full cache / method", lambda t: t.get("rel")),
              ("code", "code completion: edit similarity", lambda t: t.get("score")),
              ("avg", "mean score relative to the full cache", None))
    markers = "os^vDP*XhpH<>d8"
    fig, axes = plt.subplots(2, 2, figsize=(15, 10))
    handles: Dict[str, object] = {}
    style: Dict[str, int] = {}  # one marker and colour per method name across panels and parts
    for ax, (task, title, get) in zip(axes.flat, panels):
        points: Dict[str, Tuple[float, float]] = {}
        drawn = set()
        for part, data in parts.items():
            labels = {m["name"]: m["label"] for m in data["methods"]}
            curves: Dict[str, List[Tuple[float, float]]] = {}
            by_mode = {"question-last": data["summary"],
                       **{k: v for k, v in (data.get("summary_by_mode") or {}).items()
                          if k != "question-last"}}
            for mode, name, e in [(md, n, e) for md, summary in by_mode.items()
                                  for n, e in summary.items()]:
                short = shortfall(e, by_mode[mode].get("full", {}))
                if short and (task == "avg" or (task == "needle" and "needle" in short)):
                    continue  # a score short of what the full cache was measured on
                if task == "avg":
                    x, y = e.get("kv_fraction"), e.get("rel")
                elif task in e["tasks"]:
                    x, y = e["tasks"][task]["kv_fraction"], get(e["tasks"][task])
                else:
                    continue
                if x is None or y is None:
                    continue
                x *= 100
                points[f"{part}:{name}" if mode == "question-last" else f"{part}:{mode}:{name}"] = (x, y)
                if mode != "question-last":
                    i = style.setdefault(name, len(style))
                    colour = plt.cm.tab20(i % 20)
                    ax.scatter([x], [y], s=70, zorder=4, marker=markers[i % len(markers)],
                               facecolors="none", edgecolors=[colour], linewidths=1.6)
                    handles.setdefault(labels.get(name, name),
                                       ax.scatter([], [], s=60, marker=markers[i % len(markers)],
                                                  color=colour, edgecolors="k", linewidths=0.5))
                    twin = points.get(f"{part}:{name}")
                    if twin is not None:
                        ax.plot([twin[0], x], [twin[1], y], color=colour, lw=0.8, alpha=0.6)
                    if "context first (hollow)" not in handles:
                        handles["question last (filled)"] = ax.scatter(
                            [], [], s=60, marker="o", color="0.6", edgecolors="k", linewidths=0.5)
                        handles["context first (hollow)"] = ax.scatter(
                            [], [], s=60, marker="o", facecolors="none", edgecolors="0.3",
                            linewidths=1.6)
                    continue
                if name.count("-") == 2:  # a sweep configuration: selection-bits-kept
                    selection, bits, _ = name.split("-")
                    curves.setdefault(f"{selection}, {bits}", []).append((x, y))
                elif name not in drawn:  # full / KIVI appear in both parts: draw once
                    drawn.add(name)
                    i = style.setdefault(name, len(style))
                    h = ax.scatter([x], [y], s=60, zorder=3, marker=markers[i % len(markers)],
                                   color=plt.cm.tab20(i % 20), edgecolors="k", linewidths=0.5)
                    handles.setdefault(labels.get(name, name), h)
            for j, (label, pts) in enumerate(sorted(curves.items())):
                pts.sort()
                (h,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", lw=1.2, alpha=0.7,
                               ls="-" if label.endswith("2b") else ":", color=plt.cm.Dark2(j % 8))
                handles.setdefault(f"sweep: {label}", h)
        front = [points[n] for n in pareto_front(points)]
        if front:
            (h,) = ax.step([p[0] for p in front], [p[1] for p in front], where="post", ls="--", c="k",
                           lw=1, alpha=0.6)
            handles.setdefault("Pareto front", h)
        ax.set_xscale("log")
        ticks = [t for t in (2, 3, 5, 7, 10, 15, 20, 30, 50, 70, 100)
                 if points and min(p[0] for p in points.values()) / 1.5 <= t]
        ax.set_xticks(ticks, [f"{t}%" for t in ticks])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_title(title, fontsize=11)
        ax.set_xlabel("KV bytes of one sequence, % of the fp16 cache (log scale)")
        ax.grid(alpha=0.3, which="both")
    fig.legend(list(handles.values()), list(handles.keys()), loc="center right", fontsize=8,
               frameon=False)
    model = next(iter(parts.values()))["model"]
    fig.suptitle(f"{model.get('model', model.get('name'))}: score against KV bytes", fontsize=12)
    fig.tight_layout(rect=(0, 0, 0.78, 0.97))
    path = Path(out_dir) / PLOT_NAME
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
