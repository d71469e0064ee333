"""Reports of ``python -m minikv_compile.perf``: JSON (every raw figure), markdown tables, PNG plots.

One JSON and one markdown file per subcommand (``<out>/<command>.json``, ``<out>/<command>.md``),
rewritten after every measurement so a run that is killed still leaves its results; plots at the
end (or later, from the JSON, with the ``report`` subcommand), and ``summary.md`` with the
headline figures and the targets of issue 4 checked against them.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

SCHEMA = "minikv_compile.perf/1"
PLOTS_UNAVAILABLE = ("matplotlib is not importable here, so no PNG plots were written "
                     "(`pip install matplotlib`, then `python -m minikv_compile.perf report --out DIR` "
                     "redraws them from the JSON)")

# -- the JSON document --------------------------------------------------------------------------


class Report:
    """The results of one subcommand, written to ``out_dir`` after every change."""

    def __init__(self, out_dir: Path, command: str, argv: Sequence[str], args: Dict[str, object],
                 environment: Dict[str, object]):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.command = command
        self.json_path = self.out_dir / f"{command}.json"
        self.md_path = self.out_dir / f"{command}.md"
        self.data: Dict[str, object] = {
            "schema": SCHEMA, "command": command, "argv": list(argv), "args": jsonable(args),
            "environment": environment, "started": environment.get("timestamp"), "updated": None,
            "finished": False, "interrupted": None, "elapsed_s": 0.0,
            "context": {}, "results": [], "notes": [], "plots": [],
        }
        self.write()

    @property
    def results(self) -> List[Dict[str, object]]:
        return self.data["results"]

    def add(self, row: Dict[str, object]) -> Dict[str, object]:
        """Append ``row`` (kept by reference: later changes appear at the next write)."""
        self.results.append(row)
        self.write()
        return row

    def set_context(self, key: str, value) -> None:
        self.data["context"][key] = value
        self.write()

    def note(self, text: str) -> None:
        if text not in self.data["notes"]:
            self.data["notes"].append(text)
            self.write()

    def write(self, elapsed_s: Optional[float] = None) -> None:
        from .measure import now_iso

        self.data["updated"] = now_iso()
        if elapsed_s is not None:
            self.data["elapsed_s"] = elapsed_s
        atomic_write(self.json_path, json.dumps(jsonable(self.data), indent=1, allow_nan=False))
        atomic_write(self.md_path, render_markdown(self.data))

    def finish(self, elapsed_s: float, interrupted: Optional[str] = None) -> None:
        self.data["finished"] = interrupted is None
        self.data["interrupted"] = interrupted
        files, message = write_plots(self.data, self.out_dir)
        self.data["plots"] = files
        if message:
            self.note(message)
        self.write(elapsed_s)


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def jsonable(value):
    """Plain JSON values: NaN/inf become None, tuples lists, unknown objects strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)


def load(path: Path, schema: str = SCHEMA) -> Optional[Dict[str, object]]:
    """A report of ``schema`` written by this tool, or None for any other JSON file."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("schema") == schema else None


# -- formatting ---------------------------------------------------------------------------------


def _num(value, fmt: str = "{:.2f}") -> str:
    return "–" if value is None else fmt.format(value)


def fmt_bytes(n) -> str:
    if n is None:
        return "–"
    if abs(n) >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    if abs(n) >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 2**10:.1f} KiB"


def fmt_rate(n) -> str:
    return "–" if n is None else (f"{n:,.0f}" if n >= 100 else f"{n:.1f}")


def _gbps(n) -> str:
    return "–" if n is None else f"{n / 1e9:,.0f}"


def _nvml_peak(row) -> Optional[int]:
    nv = row.get("nvml")
    return nv.get("peak_used_bytes") if isinstance(nv, dict) else None


def _label(method: str) -> str:
    from .harness import METHOD_LABELS

    return METHOD_LABELS.get(method, method)


Column = Tuple[str, Callable[[Dict[str, object]], str]]

# Memory of a decode run, the last columns of the decode, latency and throughput tables.
_FOOTPRINT: List[Column] = [
    ("KV allocated", lambda r: fmt_bytes(r.get("kv_bytes"))),
    ("peak (torch)", lambda r: fmt_bytes(r.get("peak_allocated_bytes"))),
    ("peak (NVML)", lambda r: fmt_bytes(_nvml_peak(r))),
]

_DECODE_COLUMNS: List[Column] = [
    ("batch x prompt", lambda r: f"{r.get('batch')} x {r.get('prompt_len')}"),
    ("method", lambda r: r.get("method", "")),
    ("ms / token", lambda r: _num(r.get("ms_per_token"))),
    ("tokens / s", lambda r: fmt_rate(r.get("decode_tokens_per_s"))),
    ("floor ms", lambda r: _num(r.get("floor_ms"))),
    ("x floor", lambda r: _num(r.get("x_floor"))),
    ("achieved GB/s", lambda r: _gbps(r.get("achieved_bytes_per_s"))),
    ("prefill s", lambda r: _num(r.get("prefill_s"), "{:.3f}")),
    ("first call s", lambda r: _num(r.get("warm_s"), "{:.1f}")),
    ("compile s", lambda r: _num(r.get("compile_s"), "{:.1f}")),
    ("capture s", lambda r: _num(r.get("capture_s"), "{:.3f}")),
    *_FOOTPRINT,
]

_LATENCY_COLUMNS: List[Column] = [
    ("method", lambda r: r.get("method", "")),
    ("batch", lambda r: str(r.get("batch"))),
    ("context", lambda r: str(r.get("prompt_len"))),
    ("TTFT s", lambda r: _num(r.get("ttft_s"), "{:.3f}")),
    ("ms / token p50", lambda r: _num(r.get("ms_per_token"))),
    ("p10 – p90", lambda r: _spread(r)),
    ("max", lambda r: _num((r.get("ms_per_token_stats") or {}).get("max"))),
    ("tokens / s", lambda r: fmt_rate(r.get("decode_tokens_per_s"))),
    ("x floor", lambda r: _num(r.get("x_floor"))),
    *_FOOTPRINT,
]

_THROUGHPUT_COLUMNS: List[Column] = [
    ("prompt", lambda r: str(r.get("prompt_len"))),
    ("method", lambda r: r.get("method", "")),
    ("batch", lambda r: str(r.get("batch"))),
    ("decode tokens / s", lambda r: fmt_rate(r.get("decode_tokens_per_s"))),
    ("ms / step", lambda r: _num(r.get("ms_per_token"))),
    ("x floor", lambda r: _num(r.get("x_floor"))),
    ("prefill s (batch)", lambda r: _num(r.get("prefill_s"), "{:.2f}")),
    ("prefill tokens / s", lambda r: fmt_rate(r.get("prefill_tokens_per_s"))),
    ("end-to-end tokens / s", lambda r: fmt_rate(r.get("e2e_tokens_per_s"))),
    ("first call s", lambda r: _num(r.get("warm_s"), "{:.1f}")),
    ("compile s", lambda r: _num(r.get("compile_s"), "{:.1f}")),
    *_FOOTPRINT,
]

_LIMIT_COLUMNS: List[Column] = [
    ("prompt", lambda r: str(r.get("prompt_len"))),
    ("method", lambda r: r.get("method", "")),
    ("bytes / sequence", lambda r: fmt_bytes(r.get("bytes_per_sequence"))),
    ("usable", lambda r: fmt_bytes(r.get("usable_bytes"))),
    ("predicted limit", lambda r: str(r.get("predicted_limit"))),
    ("tried", lambda r: ", ".join(f"{b}:{s}" for b, s in r.get("attempts", []))),
    ("largest verified batch", lambda r: str(r.get("verified_limit"))),
    ("best tokens / s", lambda r: fmt_rate(r.get("best_tokens_per_s"))),
    ("at batch", lambda r: str(r.get("best_batch"))),
]

_PROBE_COLUMNS: List[Column] = [
    ("method", lambda r: r.get("method", "")),
    ("prompt", lambda r: str(r.get("prompt_len"))),
    ("fits", lambda r: {True: "yes", False: "no"}.get(r.get("fits"), "–")),
    ("status", lambda r: r.get("status", "")),
    ("peak (torch)", lambda r: fmt_bytes(r.get("peak_allocated_bytes") or r.get("emulated_peak_bytes"))),
    ("+ cache growth", lambda r: fmt_bytes(r.get("kv_growth_bytes"))),
    ("KV allocated", lambda r: fmt_bytes(r.get("kv_bytes"))),
    ("prefill s", lambda r: _num(r.get("prefill_s"), "{:.2f}")),
]

_MAXPROMPT_COLUMNS: List[Column] = [
    ("method", lambda r: r.get("method", "")),
    ("longest verified prompt", lambda r: str(r.get("longest_prompt"))),
    ("shortest failing", lambda r: str(r.get("shortest_failing"))),
    ("linear prediction", lambda r: str(r.get("predicted_prompt"))),
    ("probes", lambda r: str(r.get("probes"))),
]

_PREFILL_COLUMNS: List[Column] = [
    ("method", lambda r: r.get("method", "")),
    ("prompt", lambda r: str(r.get("prompt_len"))),
    ("prefill s", lambda r: _num(r.get("prefill_s"), "{:.3f}")),
    ("transient peak", lambda r: fmt_bytes(r.get("prefill_peak_extra_bytes"))),
    ("KV allocated", lambda r: fmt_bytes(r.get("kv_bytes"))),
    ("peak (torch)", lambda r: fmt_bytes(r.get("peak_allocated_bytes"))),
]

_MEMORY_COLUMNS: List[Column] = [
    ("method", lambda r: r.get("method", "")),
    ("allocated", lambda r: f"{fmt_bytes(r.get('total_bytes'))} ({_gb(r.get('total_bytes'))})"),
    ("codes", lambda r: fmt_bytes(r.get("codes_bytes"))),
    ("scales + zeros", lambda r: fmt_bytes(r.get("scale_zero_bytes"))),
    ("ring", lambda r: fmt_bytes(r.get("ring_bytes"))),
    ("padding", lambda r: fmt_bytes(r.get("padding_bytes"))),
    ("formula (App. I)", lambda r: f"{fmt_bytes(r.get('formula_bytes'))} ({_gb(r.get('formula_bytes'))})"),
    ("fp16 cache", lambda r: f"{fmt_bytes(r.get('fp16_bytes'))} ({_gb(r.get('fp16_bytes'))})"),
    ("allocated / fp16", lambda r: _num(r.get("ratio"), "{:.4f}")),
]

_SETUP_COLUMNS: List[Column] = [
    ("what", lambda r: r.get("what") or " ".join(
        str(x) for x in (r.get("experiment"), r.get("method"), f"b={r.get('batch')}", f"L={r.get('prompt_len')}"))),
    ("model build s", lambda r: _num(r.get("seconds") if r.get("experiment") == "setup" else None, "{:.1f}")),
    ("engine build s", lambda r: _num(r.get("build_s") if r.get("compile_s") is not None else None, "{:.1f}")),
    ("compile s", lambda r: _num(r.get("compile_s"), "{:.1f}")),
    ("capture s", lambda r: _num(r.get("capture_s"), "{:.3f}")),
    ("first call s", lambda r: _num(r.get("warm_s"), "{:.1f}")),
]


_PROMPT_CACHE_COLUMNS: List[Column] = [
    ("measure", lambda r: r.get("measure")),
    ("prompt", lambda r: r.get("prompt_len")),
    ("s (median)", lambda r: _num(r.get("time_s"), "{:.4f}")),
    ("bytes", lambda r: fmt_bytes(r.get("file_bytes") or r.get("cache_bytes"))),
    ("fp16 bytes", lambda r: fmt_bytes(r.get("fp16_bytes"))),
    ("ideal s (disk + link)", lambda r: _num(r.get("ideal_s"), "{:.4f}")),
    ("efficiency", lambda r: _num(r.get("efficiency"), "{:.2f}")),
]


def _gb(n) -> str:
    return "–" if n is None else f"{n / 1e9:.3f} GB"


def _spread(r) -> str:
    st = r.get("ms_per_token_stats") or {}
    return "–" if not st else f"{st['p10']:.2f} – {st['p90']:.2f}"


TABLES: Dict[str, List[Tuple[str, str, List[Column]]]] = {
    # command -> [(heading, experiment, columns)]
    "engine-vs-hf": [("Decode, engine vs HF", "decode", _DECODE_COLUMNS)],
    "latency": [("Latency over context (batch 1) and batch", "latency", _LATENCY_COLUMNS)],
    "throughput": [("Batch-size limit per method", "limit", _LIMIT_COLUMNS),
                   ("Throughput", "throughput", _THROUGHPUT_COLUMNS)],
    "max-prompt": [("Longest batch-1 prompt under the memory cap", "max-prompt", _MAXPROMPT_COLUMNS),
                   ("Probes (prefill peak memory and time against prompt length)", "probe", _PROBE_COLUMNS)],
    "prefill": [("Prefill time and peak memory against prompt length", "prefill", _PREFILL_COLUMNS)],
    "memory-claim": [("KV bytes the engine allocates (batch 1)", "memory-claim", _MEMORY_COLUMNS)],
    "prompt-cache": [("A cached compressed prompt against a fresh prefill", "prompt-cache",
                      _PROMPT_CACHE_COLUMNS)],
}


def _table(rows: Sequence[Dict[str, object]], columns: Sequence[Column]) -> List[str]:
    lines = ["| " + " | ".join(h for h, _ in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(str(get(r)).replace("|", "/") for _, get in columns) + " |")
    return lines


def _env_line(env: Dict[str, object]) -> str:
    dev = env.get("device", {}) or {}
    nv = env.get("nvml", {}) or {}
    git = env.get("git", {}) or {}
    parts = [f"device **{dev.get('name')}**"]
    if nv.get("available"):
        parts.append(f"driver {nv.get('driver_version')}, SM {nv.get('sm_clock_mhz')}/"
                     f"{nv.get('max_sm_clock_mhz')} MHz, power limit {_num(nv.get('power_limit_w'), '{:.0f}')} W")
    else:
        parts.append(f"NVML: {nv.get('reason')}")
    parts.append(f"torch {env.get('torch')}, triton {env.get('triton')}, transformers {env.get('transformers')}")
    sha = git.get("sha")
    parts.append(f"git {sha[:12] + (' (dirty)' if git.get('dirty') else '') if sha else 'unknown'}")
    parts.append(str(env.get("timestamp")))
    return "; ".join(parts)


def render_markdown(data: Dict[str, object]) -> str:
    """The markdown summary of one subcommand's report."""
    cmd = data.get("command", "?")
    results = data.get("results", [])
    lines = [f"# `{cmd}`", "", _env_line(data.get("environment", {})), ""]
    state = "finished" if data.get("finished") else (
        f"interrupted ({data.get('interrupted')})" if data.get("interrupted") else "in progress")
    lines += [f"Run {state}; {data.get('elapsed_s', 0):.0f} s; command: `{' '.join(data.get('argv', []))}`", ""]
    ctx = data.get("context", {})
    if ctx.get("model"):
        m = ctx["model"]
        lines.append(f"Model: {m.get('name')} — {m.get('description')}; "
                     f"{fmt_bytes(m.get('weight_bytes'))} of weights ({m.get('dtype')}).")
    if ctx.get("bandwidth"):
        bw = ctx["bandwidth"]
        if bw.get("bytes_per_s"):
            how = (f"the fastest of {bw['blocks']} medians of {bw['per_block']} copies"
                   if bw.get("blocks") else f"median of {bw.get('iters')}")  # older reports
            lines.append(f"Copy bandwidth measured in this run: {bw['bytes_per_s'] / 1e12:.2f} TB/s "
                         f"(bytes read + written, {how}).")
        else:
            lines.append(f"Copy bandwidth not measured: {bw.get('reason')}.")
    lines.append("")
    for heading, experiment, columns in TABLES.get(cmd, []):
        rows = [r for r in results if r.get("experiment") == experiment and r.get("status") == "ok"]
        if experiment in ("limit", "max-prompt", "probe"):
            rows = [r for r in results if r.get("experiment") == experiment]
        if not rows:
            continue
        lines += [f"## {heading}", ""] + _table(rows, columns) + [""]
    setup = [r for r in results if r.get("status") == "ok" and (r.get("experiment") == "setup" or (
        "build_s" in r and (r.get("compile_s") is not None or r.get("auto_compile"))))]
    if setup:
        lines += ["## Compile and capture (not in any steady-state figure)", "",
                  "Engine build = `minikv_compile()`: allocation, compile and CUDA-graph capture of the "
                  "decode step (capture = build's prepare time less compile). HF StaticCache compiles "
                  "inside its first `generate` call: its first call s includes the compile, a prefill and "
                  "the warm-up tokens.", ""]
        lines += _table(setup, _SETUP_COLUMNS) + [""]
    extra = render_extra(cmd, data)
    if extra:
        lines += extra + [""]
    missing = [r for r in results if r.get("status") not in ("ok", None) and r.get("experiment") != "probe"]
    if missing:
        lines += ["## Not measured", ""]
        for r in missing:
            where = ", ".join(f"{k} {r[k]}" for k in ("batch", "prompt_len") if r.get(k) is not None)
            lines.append(f"- {r.get('experiment')} / {r.get('method', '-')}"
                         f"{' (' + where + ')' if where else ''}: **{r.get('status')}** — {r.get('reason')}")
        lines.append("")
    if data.get("notes"):
        lines += ["## Notes", ""] + [f"- {n}" for n in data["notes"]] + [""]
    if data.get("plots"):
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in data["plots"]] + [""]
    return "\n".join(lines)


def render_extra(cmd: str, data: Dict[str, object]) -> List[str]:
    """Command-specific lines under the tables: ratios taken within the run."""
    if cmd == "memory-claim":
        return _memory_claim_lines(data)
    checks = [t for t in targets([data]) if t["value"] is not None]
    if not checks:
        return []
    return ["## Targets (ratios taken within this run)", ""] + _target_table(checks)


def _memory_claim_lines(data) -> List[str]:
    ctx = data.get("context", {}).get("paper", {})
    rows = {r.get("method"): r for r in data.get("results", []) if r.get("status") == "ok"}
    mk = rows.get("minikv")
    if not ctx or not mk:
        return []
    fp16, paper_mk = ctx.get("fp16_bytes"), ctx.get("minikv_bytes")
    out = ["## The paper's claim, checked", "",
           f"Paper (Appendix I), {ctx.get('shape')} at prompt {ctx.get('prompt_len')} + "
           f"{ctx.get('new_tokens')} generated, {ctx.get('budgets')}: fp16 cache "
           f"{fp16 / 1e9:.3f} GB (paper: 2.4 GB), MiniKV {paper_mk / 1e9:.3f} GB (paper: 0.33 GB), "
           f"{100 * (1 - paper_mk / fp16):.1f}% smaller (paper: 86%).", "",
           f"- Engine fp16 reference = `2 * layers * width * (L + L_gen) * 2` = {mk.get('fp16_bytes'):,} B "
           f"({'matches' if mk.get('fp16_bytes') == fp16 else 'DIFFERS from'} the paper's formula).",
           f"- Engine formula bytes = {mk.get('formula_bytes'):,} B "
           f"({'matches' if mk.get('formula_bytes') == paper_mk else 'DIFFERS from'} "
           f"`layers * width * (0.5 L + L_gen)` = {paper_mk:,} B).",
           f"- Allocated by MiniKV: {mk.get('total_bytes'):,} B = quantized region "
           f"{mk.get('quantized_region_bytes'):,} B (codes {mk.get('codes_bytes'):,} + scales/zeros "
           f"{mk.get('scale_zero_bytes'):,}; of which padding {mk.get('padding_bytes'):,}) + residual ring "
           f"{mk.get('ring_bytes'):,} B + counters {mk.get('counters_bytes'):,} B.",
           f"- Difference to the paper's MiniKV figure: {mk.get('total_bytes') - paper_mk:+,} B "
           f"({100 * (mk.get('total_bytes') / paper_mk - 1):+.1f}%), all of it ring + padding + counters: "
           f"the ring keeps the newest tokens (up to `residual_length`) in 16 bit per layer, K and V, "
           f"which the formula does not count; padding rounds each layer's capacity up to a whole group.",
           f"- Allocated / fp16: {mk.get('ratio'):.4f} → {100 * (1 - mk.get('ratio')):.1f}% smaller "
           f"(paper: 86%)."]
    return out


# -- targets of issue 4 -------------------------------------------------------------------------


def _best(rows, method, key, pick=max, **match):
    """The row of ``method`` with the best ``key`` (``pick=min`` where lower is better)."""
    vals = [r for r in rows if r.get("method") == method and r.get("status") == "ok"
            and r.get(key) is not None and all(r.get(k) == v for k, v in match.items())]
    return pick(vals, key=lambda r: r[key]) if vals else None


def targets(datasets: Iterable[Dict[str, object]]) -> List[Dict[str, object]]:
    """Each target of issue 4 (and of the engine issue) with its value in these reports.

    value None: the report holds no measurement for it (not run, skipped or failed).
    """
    datasets = list(datasets)
    out = []
    for data in datasets:
        cmd, rows = data.get("command"), data.get("results", [])
        if cmd == "throughput":
            for L in sorted({r.get("prompt_len") for r in rows if r.get("experiment") == "throughput"}):
                tp = [r for r in rows if r.get("experiment") == "throughput"]
                mk = _best(tp, "minikv", "decode_tokens_per_s", prompt_len=L)
                hf = _best(tp, "hf-static", "decode_tokens_per_s", prompt_len=L)
                out.append(_target(
                    f"throughput at prompt {L}: MiniKV peak / HF StaticCache peak (each at its best batch)",
                    mk and hf and mk["decode_tokens_per_s"] / hf["decode_tokens_per_s"], ">=", 3.0,
                    f"MiniKV {fmt_rate(mk and mk['decode_tokens_per_s'])} tok/s at batch {mk and mk['batch']}, "
                    f"HF {fmt_rate(hf and hf['decode_tokens_per_s'])} tok/s at batch {hf and hf['batch']}"))
        elif cmd == "max-prompt":
            mp = {r.get("method"): r for r in rows if r.get("experiment") == "max-prompt"}
            mk = (mp.get("minikv") or {}).get("longest_prompt")
            hf_rows = [(m, (mp.get(m) or {}).get("longest_prompt")) for m in ("hf-static", "hf-eager")]
            hf_rows = [(m, v) for m, v in hf_rows if v]
            hf_m, hf = max(hf_rows, key=lambda x: x[1]) if hf_rows else (None, None)
            cap = (data.get("context", {}).get("memory_cap") or {}).get("cap_bytes")
            out.append(_target(
                f"longest batch-1 prompt under {fmt_bytes(cap)}: MiniKV / best HF",
                mk / hf if mk and hf else None, ">=", 3.0, f"MiniKV {mk}, {hf_m} {hf}"))
        elif cmd == "latency":
            lat = [r for r in rows if r.get("experiment") == "latency" and r.get("batch") == 1
                   and r.get("sweep") == "context"]
            L = 32768  # the target context
            mk = _best(lat, "minikv", "ms_per_token", min, prompt_len=L)
            hf = _best(lat, "hf-static", "ms_per_token", min, prompt_len=L)
            out.append(_target(f"decode ms/token at {L} (batch 1, streamed p50): MiniKV / HF StaticCache",
                               mk and hf and mk["ms_per_token"] / hf["ms_per_token"], "<=", 0.4,
                               f"MiniKV {_num(mk and mk['ms_per_token'])} ms, HF {_num(hf and hf['ms_per_token'])} ms"))
        elif cmd == "engine-vs-hf":
            dec = [r for r in rows if r.get("experiment") == "decode"]
            for B, L in sorted({(r.get("batch"), r.get("prompt_len")) for r in dec}):
                mk = _best(dec, "minikv", "ms_per_token", min, batch=B, prompt_len=L)
                hf = _best(dec, "hf-static", "ms_per_token", min, batch=B, prompt_len=L)
                out.append(_target(f"{B} x {L}: MiniKV ms/token / MiniKV floor",
                                   mk and mk.get("x_floor"), "<=", 1.25,
                                   f"{_num(mk and mk['ms_per_token'])} ms vs floor {_num(mk and mk.get('floor_ms'))} ms"))
                out.append(_target(f"{B} x {L}: MiniKV ms/token / HF StaticCache ms/token",
                                   mk and hf and mk["ms_per_token"] / hf["ms_per_token"], "<=", 0.4,
                                   f"MiniKV {_num(mk and mk['ms_per_token'])} ms, HF {_num(hf and hf['ms_per_token'])} ms"))
    if len(datasets) > 1 and not any(d.get("command") == "latency" for d in datasets):
        fallback = _latency_from_engine_vs_hf(datasets)
        if fallback:
            out.append(fallback)
    return out


def _latency_from_engine_vs_hf(datasets) -> Optional[Dict[str, object]]:
    """The 32k latency target from engine-vs-hf's 1 x 32768 rows, when no latency run exists."""
    for data in datasets:
        if data.get("command") != "engine-vs-hf":
            continue
        dec = [r for r in data.get("results", []) if r.get("experiment") == "decode"]
        mk = _best(dec, "minikv", "ms_per_token", min, batch=1, prompt_len=32768)
        hf = _best(dec, "hf-static", "ms_per_token", min, batch=1, prompt_len=32768)
        if mk and hf:
            return _target("decode ms/token at 32768 (batch 1, from engine-vs-hf: no per-token sync): "
                           "MiniKV / HF StaticCache", mk["ms_per_token"] / hf["ms_per_token"], "<=", 0.4,
                           f"MiniKV {_num(mk['ms_per_token'])} ms, HF {_num(hf['ms_per_token'])} ms")
    return None


def _target(name, value, op, threshold, detail) -> Dict[str, object]:
    value = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    met = None if value is None else (value >= threshold if op == ">=" else value <= threshold)
    if value is None:
        by = None
    elif op == ">=":
        by = value / threshold - 1  # > 0: margin; < 0: short by this fraction
    else:
        by = threshold / value - 1
    return {"target": name, "value": value, "op": op, "threshold": threshold, "met": met,
            "margin": by, "detail": detail}


def _target_table(checks) -> List[str]:
    lines = ["| target | value | required | met | margin | detail |", "|---|---|---|---|---|---|"]
    for t in checks:
        met = "–" if t["met"] is None else ("yes" if t["met"] else "**no**")
        margin = "–" if t["margin"] is None else f"{100 * t['margin']:+.0f}%"
        lines.append(f"| {t['target']} | {_num(t['value'])} | {t['op']} {t['threshold']} | {met} | "
                     f"{margin} | {t['detail']} |")
    return lines


def headlines(datasets: List[Dict[str, object]]) -> List[str]:
    """One line per headline figure of each report (what the README quotes)."""
    out = []
    for data in datasets:
        cmd, res = data.get("command"), [r for r in data.get("results", []) if r.get("status") == "ok"]
        model = (data.get("context", {}).get("model") or {}).get("name", "?")
        if cmd == "memory-claim":
            mk = next((r for r in res if r.get("method") == "minikv"), None)
            if mk:
                out.append(f"KV memory ({model}, {mk['prompt_len']} + {mk['new_tokens']} tokens): fp16 "
                           f"{_gb(mk['fp16_bytes'])} (paper 2.4 GB); MiniKV formula {_gb(mk['formula_bytes'])} "
                           f"(paper 0.33 GB); allocated {_gb(mk['total_bytes'])} = formula + ring "
                           f"{fmt_bytes(mk['ring_bytes'])} + padding {fmt_bytes(mk['padding_bytes'])} "
                           f"({100 * (1 - mk['ratio']):.1f}% below fp16)")
        elif cmd == "engine-vs-hf":
            for r in (r for r in res if r.get("experiment") == "decode"):
                out.append(f"{model} {r['batch']} x {r['prompt_len']}: {r['method']} {_num(r['ms_per_token'])} "
                           f"ms/token ({_num(r.get('x_floor'))} x its floor, MiniKV floor "
                           f"{_num(r.get('minikv_floor_ms'))} ms), prefill {_num(r.get('prefill_s'), '{:.2f}')} s")
        elif cmd == "throughput":
            for r in (r for r in data.get("results", []) if r.get("experiment") == "limit"):
                out.append(f"{model} prompt {r['prompt_len']}: {r['method']} best "
                           f"{fmt_rate(r.get('best_tokens_per_s'))} decode tokens/s at batch {r.get('best_batch')}; "
                           f"largest batch verified {r.get('verified_limit')} (predicted {r.get('predicted_limit')})")
        elif cmd == "max-prompt":
            cap = (data.get("context", {}).get("memory_cap") or {}).get("cap_bytes")
            for r in (r for r in data.get("results", []) if r.get("experiment") == "max-prompt"):
                out.append(f"{model} under {fmt_bytes(cap)}: {r['method']} longest prompt {r.get('longest_prompt')} "
                           f"(first failing {r.get('shortest_failing')})")
        elif cmd == "latency":
            for r in (r for r in res if r.get("experiment") == "latency" and r.get("sweep") == "context"):
                out.append(f"{model} batch 1 at {r['prompt_len']}: {r['method']} {_num(r['ms_per_token'])} ms/token "
                           f"p50 ({_spread(r)}), TTFT {_num(r.get('ttft_s'), '{:.3f}')} s")
        elif cmd == "prefill":
            for r in (r for r in res if r.get("experiment") == "prefill"):
                out.append(f"{model} prefill {r['prompt_len']}: {r['method']} {_num(r.get('prefill_s'), '{:.3f}')} s, "
                           f"transient {fmt_bytes(r.get('prefill_peak_extra_bytes'))}")
    return out


def render_summary(datasets: List[Dict[str, object]], out_dir: Path) -> str:
    """``summary.md``: every report in the folder, its headline figures and the targets."""
    lines = ["# Performance summary", ""]
    if datasets:
        lines += [_env_line(datasets[0].get("environment", {})), ""]
    heads = headlines(datasets)
    if heads:
        lines += ["## Headline figures", ""] + [f"- {h}" for h in heads] + [""]
    checks = targets(datasets)
    if checks:
        lines += ["## Targets", "", "A negative margin is how far a target was missed.", ""]
        lines += _target_table(checks) + [""]
    lines += ["## Reports", ""]
    for d in datasets:
        cmd = d.get("command")
        n_ok = sum(r.get("status") == "ok" for r in d.get("results", []))
        n_other = sum(r.get("status") not in ("ok", None) for r in d.get("results", []))
        state = "finished" if d.get("finished") else f"not finished ({d.get('interrupted') or 'killed'})"
        lines.append(f"- [`{cmd}`]({cmd}.md): {n_ok} measurements, {n_other} not measured, {state}, "
                     f"{d.get('elapsed_s', 0):.0f} s")
    pngs = sorted(p.name for p in Path(out_dir).glob("*.png"))
    if pngs:
        # Every PNG of the folder: also accuracy.png when `python -m minikv_compile.perf.accuracy`
        # wrote its reports here (it draws the accuracy-vs-KV-bytes plot itself).
        lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in pngs]
    return "\n".join(lines) + "\n"


def rerender(out_dir: Path) -> Tuple[List[str], str]:
    """Redraw markdown and plots of every report in ``out_dir`` and write ``summary.md``.

    Returns (the commands found, the plots message or "").
    """
    out_dir = Path(out_dir)
    datasets, message = [], ""
    for path in sorted(out_dir.glob("*.json")):
        data = load(path)
        if data is None:
            continue
        files, msg = write_plots(data, out_dir)
        data["plots"] = files
        message = message or msg
        atomic_write(path, json.dumps(data, indent=1, allow_nan=False, default=str))
        atomic_write(out_dir / f"{data['command']}.md", render_markdown(data))
        datasets.append(data)
    atomic_write(out_dir / "summary.md", render_summary(datasets, out_dir))
    return [d["command"] for d in datasets], message


# -- plots --------------------------------------------------------------------------------------


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return None
    return plt


def _by_method(rows) -> Dict[str, List[Dict[str, object]]]:
    out: Dict[str, List[Dict[str, object]]] = {}
    for r in rows:
        out.setdefault(r.get("method"), []).append(r)
    return out


def _save(plt, fig, out_dir: Path, name: str, files: List[str]) -> None:
    fig.tight_layout()
    fig.savefig(out_dir / name, dpi=110)
    plt.close(fig)
    files.append(name)


def _line_plot(plt, out_dir, files, name, rows, x, y, xlabel, ylabel, title, logx=True, err=None,
               scale=1.0):
    series = {m: sorted((r for r in rs if r.get(y) is not None and r.get(x) is not None), key=lambda r: r[x])
              for m, rs in _by_method(rows).items()}
    series = {m: rs for m, rs in series.items() if rs}
    if not series:
        return
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for method, rs in series.items():
        xs, ys = [r[x] for r in rs], [r[y] * scale for r in rs]
        if err:
            lo = [max(0.0, r[y] - r[err]["p10"]) * scale for r in rs]
            hi = [max(0.0, r[err]["p90"] - r[y]) * scale for r in rs]
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=_label(method))
        else:
            ax.plot(xs, ys, marker="o", label=_label(method))
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    _save(plt, fig, out_dir, name, files)


def write_plots(data: Dict[str, object], out_dir: Path) -> Tuple[List[str], str]:
    """PNG plots of one report; (file names, "" or the reason none were drawn)."""
    rows = [r for r in data.get("results", []) if r.get("status") == "ok"]
    cmd = data.get("command")
    if not rows or cmd not in ("latency", "throughput", "max-prompt", "prefill", "engine-vs-hf", "memory-claim"):
        return [], ""
    plt = _pyplot()
    if plt is None:
        return [], PLOTS_UNAVAILABLE
    files: List[str] = []
    model = (data.get("context", {}).get("model") or {}).get("name", "")
    if cmd == "latency":
        lat = [r for r in rows if r.get("experiment") == "latency"]
        b1 = [r for r in lat if r.get("batch") == 1]
        _line_plot(plt, out_dir, files, "latency_vs_context.png", b1, "prompt_len", "ms_per_token",
                   "context (tokens)", "decode ms / token (p50, bars p10-p90)",
                   f"Decode latency, batch 1, {model}", err="ms_per_token_stats")
        _line_plot(plt, out_dir, files, "ttft_vs_context.png", b1, "prompt_len", "ttft_s",
                   "context (tokens)", "time to first token (s)", f"Time to first token, batch 1, {model}")
        prompts = {r.get("prompt_len") for r in lat if r.get("batch", 1) > 1}
        batch_rows = [r for r in lat if r.get("prompt_len") in prompts and r.get("sweep") == "batch"]
        _line_plot(plt, out_dir, files, "latency_vs_batch.png", batch_rows, "batch", "ms_per_token",
                   "batch size", "decode ms / token (p50)", f"Decode latency against batch, {model}",
                   err="ms_per_token_stats")
    elif cmd == "throughput":
        tp = [r for r in rows if r.get("experiment") == "throughput"]
        for L in sorted({r.get("prompt_len") for r in tp}):
            sub = [r for r in tp if r.get("prompt_len") == L]
            _line_plot(plt, out_dir, files, f"throughput_vs_batch_{L}.png", sub, "batch",
                       "decode_tokens_per_s", "batch size", "decode tokens / s",
                       f"Throughput, prompt {L}, {model}")
            _line_plot(plt, out_dir, files, f"peak_memory_vs_batch_{L}.png", sub, "batch",
                       "peak_allocated_bytes", "batch size", "peak allocated (GiB, PyTorch)",
                       f"Peak memory, prompt {L}, {model}", scale=1 / 2**30)
    elif cmd == "max-prompt":
        mp = [r for r in data.get("results", []) if r.get("experiment") == "max-prompt" and r.get("longest_prompt")]
        if mp:
            fig, ax = plt.subplots(figsize=(7, 4.2))
            ax.barh([_label(r["method"]) for r in mp], [r["longest_prompt"] for r in mp])
            for i, r in enumerate(mp):
                ax.text(r["longest_prompt"], i, f" {r['longest_prompt']:,}", va="center", fontsize=8)
            cap = (data.get("context", {}).get("memory_cap") or {}).get("cap_bytes")
            ax.set_xlabel("longest batch-1 prompt that fits (tokens)")
            ax.set_title(f"Max prompt under {fmt_bytes(cap)}, {model}")
            _save(plt, fig, out_dir, "max_prompt.png", files)
        probes = [r for r in rows if r.get("experiment") == "probe" and r.get("fits")]
        _line_plot(plt, out_dir, files, "prefill_memory_vs_prompt_capped.png", probes, "prompt_len",
                   "peak_allocated_bytes", "prompt (tokens)", "peak allocated (GiB)",
                   f"Peak memory of the max-prompt probes, {model}", scale=1 / 2**30)
    elif cmd == "prefill":
        pf = [r for r in rows if r.get("experiment") == "prefill"]
        _line_plot(plt, out_dir, files, "prefill_memory_vs_prompt.png", pf, "prompt_len",
                   "prefill_peak_extra_bytes", "prompt (tokens)", "prefill transient peak (GiB)",
                   f"Prefill peak memory (Table 3 analogue), {model}", scale=1 / 2**30)
        _line_plot(plt, out_dir, files, "prefill_time_vs_prompt.png", pf, "prompt_len", "prefill_s",
                   "prompt (tokens)", "prefill seconds", f"Prefill time (Table 4 analogue), {model}")
    elif cmd == "engine-vs-hf":
        dec = [r for r in rows if r.get("experiment") == "decode"]
        shapes = sorted({(r["batch"], r["prompt_len"]) for r in dec})
        if shapes:
            fig, ax = plt.subplots(figsize=(7, 4.2))
            methods = sorted({r["method"] for r in dec})
            width = 0.8 / (len(methods) + 1)
            for i, m in enumerate(methods):
                vals = [next((r["ms_per_token"] for r in dec if r["method"] == m
                              and (r["batch"], r["prompt_len"]) == s), 0) for s in shapes]
                ax.bar([j + i * width for j in range(len(shapes))], vals, width, label=_label(m))
            floors = [next((r.get("minikv_floor_ms") for r in dec if (r["batch"], r["prompt_len"]) == s
                            and r.get("minikv_floor_ms")), 0) for s in shapes]
            if any(floors):
                ax.bar([j + len(methods) * width for j in range(len(shapes))], floors, width,
                       label="MiniKV bandwidth floor", color="grey")
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))])
            ax.set_xticklabels([f"{b} x {L}" for b, L in shapes])
            ax.set_ylabel("decode ms / token")
            ax.set_title(f"Engine vs HF StaticCache, {model}")
            ax.legend(fontsize=8)
            _save(plt, fig, out_dir, "engine_vs_hf.png", files)
    elif cmd == "memory-claim":
        mc = [r for r in rows if r.get("experiment") == "memory-claim"]
        paper = data.get("context", {}).get("paper", {})
        if mc:
            fig, ax = plt.subplots(figsize=(7, 4.2))
            names = [r["method"] for r in mc]
            parts = [("codes", "codes_bytes"), ("scales + zeros", "scale_zero_bytes"), ("ring", "ring_bytes")]
            left = [0.0] * len(mc)
            for label, key in parts:
                vals = [(r.get(key) or 0) / 1e9 for r in mc]
                ax.barh(names, vals, left=left, label=label)
                left = [a + b for a, b in zip(left, vals)]
            if paper:
                ax.axvline(paper["fp16_bytes"] / 1e9, color="k", ls="--", lw=1, label="paper fp16 (2.4 GB)")
                ax.axvline(paper["minikv_bytes"] / 1e9, color="r", ls="--", lw=1, label="paper MiniKV (0.33 GB)")
            ax.set_xlabel("KV bytes allocated (GB)")
            ax.set_title(f"KV memory, {model}, prompt {paper.get('prompt_len')} + {paper.get('new_tokens')}")
            ax.legend(fontsize=8)
            _save(plt, fig, out_dir, "memory_claim.png", files)
    return files, ""
