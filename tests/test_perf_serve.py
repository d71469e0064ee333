"""``python -m minikv_compile.perf serve`` on the CPU: the serving benchmark end to end.

``--tiny`` starts both backends as real server processes on loopback ports (this engine's server,
then HF's continuous batching behind the same endpoint), drives each over HTTP with the load
generator through every phase, and leaves the merged report. The figures are checked, not only
the files: every request completed with exactly its ``max_tokens`` tokens, the latencies are
positive and ordered, the sweep's saturation follows its own rule.
"""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# The serve extra (make test installs it); the GPU machine runs without it (see test_serve).
pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from minikv_compile.perf.__main__ import main  # noqa: E402
from minikv_compile.perf.serve_bench import (BACKENDS, PHASES, PRESETS, Worker,  # noqa: E402
                                             saturation)
from minikv_compile.perf.serve_load import (Outcome, Workload, percentile,  # noqa: E402
                                            poisson_arrivals)
from minikv_compile.perf.serve_report import SCHEMA, PartStore, targets  # noqa: E402

TINY = PRESETS["tiny"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("serve")
    proc = subprocess.run([sys.executable, "-m", "minikv_compile.perf", "serve", "--tiny",
                           "--out", str(out)], capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def _check_run(run, phase):
    reqs = run["per_request"]
    assert run["requests"] == len(reqs) > 0
    assert run["completed"] == len(reqs) and run["tokens_exact"], run
    assert run["refused"] == run["errors"] == run["cut"] == run["unsent"] == 0
    lo, hi = TINY["prompt_len"]
    for r in reqs:
        assert r["status"] == "ok" and r["http_status"] == 200 and r["finish_reason"] == "length", r
        # exactly max_tokens, counted from the chunks (one synthetic word per token) and by usage
        assert r["tokens"] == r["usage_tokens"] == r["max_tokens"]
        assert TINY["output_len"][0] <= r["max_tokens"] <= TINY["output_len"][1]
        assert 1 <= r["chunks"] <= r["tokens"]
        assert 0 < r["ttft_s"] <= r["e2e_s"]
        assert len(r["itl_ms"]) == r["tokens"] - 1 and min(r["itl_ms"]) >= 0
        assert r["long"] == (r["prompt_len"] == TINY["long_prompt"])
        if not r["long"]:
            assert lo <= r["prompt_len"] <= hi
    assert run["output_tokens"] == sum(r["max_tokens"] for r in reqs)
    assert 0 < run["ttft_p50_s"] <= run["ttft_p99_s"] <= run["ttft_max_s"]
    assert 0 <= run["itl_p50_ms"] <= run["itl_p90_ms"] <= run["itl_p99_ms"] <= run["itl_max_ms"]
    assert run["itl_samples"] == sum(r["tokens"] - 1 for r in reqs)
    assert run["output_tokens_per_s"] > 0 and run["requests_per_s"] > 0 and run["window_s"] > 0
    assert run["output_tokens_per_s_late"] > 0  # the last token is in the second half
    if phase == "offline":
        assert run["rate"] is None and all(r["arrival_s"] == 0 for r in reqs)
    elif phase != "single":
        arrivals = [r["arrival_s"] for r in reqs]
        assert arrivals[0] == 0 and arrivals == sorted(arrivals) and run["rate"] > 0
        # sustained: the p99 TTFT of all requests under the limit (none unanswered here)
        assert run["ttft_p99_all_s"] == run["ttft_p99_s"]
        assert run["sustained"] == (run["ttft_p99_s"] < TINY["ttft_limit"])


def test_serve_tiny_both_backends_every_phase(tiny_run):
    data = json.loads((tiny_run / "serve.json").read_text())
    assert data["schema"] == SCHEMA and data["command"] == "serve"
    parts = {(p["backend"], p["phase"]): p for p in data["parts"]}
    assert set(parts) == {(b, ph) for b in BACKENDS for ph in PHASES}
    for (backend, phase), part in parts.items():
        assert part["status"] == "ok", (backend, phase, part.get("reason"))
        server = part["server"]
        assert server["backend"] == backend and server["model"]["name"] == "tiny"
        assert {"torch", "transformers", "git", "device"} <= set(server["environment"])
        assert part["startup_s"] > 0 and all(w["completed"] == 1 for w in part["warm_up"])
        assert (tiny_run / part["worker_log"]).is_file()
        for run in part["runs"]:
            _check_run(run, phase)
        # our server's counters over the phase; HF's server has none
        if backend == "minikv":
            e = part["engine"]
            # a step gives each live slot one token; the first comes with the prefill
            assert e["steps"] >= sum(r["tokens"] - 1 for run in part["runs"]
                                     for r in run["per_request"]) / TINY["max_batch_size"] > 0
            # the CPU runs eagerly: nothing compiled, captured or replayed, before or during
            assert e["compiles"] == e["captures"] == e["replays"] == 0
        else:
            assert "engine" not in part
    ours = parts[("minikv", "single")]["server"]
    assert ours["config"]["max_batch_size"] == TINY["max_batch_size"]
    assert ours["config"]["max_prompt_len"] == TINY["long_prompt"] and ours["kv_bytes"] > 0
    hf = parts[("hf", "single")]["server"]
    assert hf["attn_implementation"] and hf["continuous_batching_config"]["num_blocks"] > 0

    for backend in BACKENDS:
        b1 = parts[(backend, "single")]["batch1"]
        assert b1["completed"] == b1["requests"] == TINY["single_requests"] and b1["tokens_exact"]
        assert b1["step_ms"] > 0 and b1["e2e_mean_s"] > 0
        sweep = parts[(backend, "sweep")]
        rates = [r["rate"] for r in sweep["runs"]]
        assert 1 <= len(rates) <= TINY["max_rates"]
        sat = sweep["saturation"]
        sustained = [r["rate"] for r in sweep["runs"] if r["sustained"]]
        assert sat["rate"] == (max(sustained) if sustained else None)
        if sat["rate"] is not None:
            for phase in ("half", "long"):
                assert parts[(backend, phase)]["runs"][0]["rate"] == pytest.approx(sat["rate"] / 2)
        longs = [r for r in parts[(backend, "long")]["runs"][0]["per_request"] if r["long"]]
        assert len(longs) >= 2 and all(r["index"] % TINY["long_every"] == TINY["long_every"] - 1
                                       for r in longs)
        offline = parts[(backend, "offline")]["runs"][0]["per_request"]
        assert len(offline) == TINY["offline_requests"]

    summary = data["models"]["tiny"]
    assert set(summary["backends"]) == set(BACKENDS)
    targets = summary["targets"]
    assert len(targets) == 6 and all(t["status"] in ("met", "missed", "open", "not measured")
                                     for t in targets)
    offline = [t for t in targets if t["target"].startswith("offline")][0]
    ratio = (summary["backends"]["minikv"]["offline"]["output_tokens_per_s"]
             / summary["backends"]["hf"]["offline"]["output_tokens_per_s"])
    assert offline["value"] == pytest.approx(ratio)
    assert offline["status"] == ("met" if ratio >= 10 else "missed")
    md = (tiny_run / "serve.md").read_text()
    for heading in ("### Targets", "### Servers", "### Batch 1", "### Poisson sweep",
                    "### At half the saturation rate", "### Offline",
                    "### The engine during each phase"):
        assert heading in md
    assert "| minikv |" in md and "| hf |" in md


def test_report_rebuilds_serve_and_keeps_parts(tiny_run, tmp_path):
    """``report`` redraws serve.md from the parts; a phase that did not run later does not
    replace the part of an earlier run that did."""
    out = tmp_path / "copy"
    shutil.copytree(tiny_run, out)
    (out / "serve.md").unlink()
    assert main(["report", "--out", str(out)]) == 0
    assert "### Poisson sweep" in (out / "serve.md").read_text()
    store = PartStore(out)
    before = store.load("tiny", "minikv", "sweep")
    assert not store.save({"model": "tiny", "backend": "minikv", "phase": "sweep",
                           "status": "skipped", "reason": "time budget"})
    assert store.load("tiny", "minikv", "sweep") == before


@pytest.mark.parametrize("argv, message", [
    (["--backends", "vllm"], "--backends"),
    (["--phases", "sweep,warp"], "--phases"),
    (["--prompt-len", "64,16"], "--prompt-len"),
    (["--tiny", "--max-prompt-len", "32"], "--prompt-len"),
    (["--tiny", "--max-new-tokens", "8"], "--output-len"),
    (["--rates", "1,-2"], "--rates"),
    (["--tiny", "--min-requests", "9", "--requests", "4"], "--min-requests"),
    (["--budget-seconds", "0"], "--budget-seconds"),
])
def test_bad_arguments_exit_2(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--out", str(tmp_path / "x"), *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and message in err
    assert not (tmp_path / "x").exists()


def test_worker_bad_arguments_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve-worker", "--backend", "tgi", "--model", "tiny", "--port", "1"])
    assert exc.value.code == 2 and "--backend" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["serve-worker", "--backend", "minikv", "--model", "tiny", "--port", "1",
              "--preset", "fastest"])
    assert exc.value.code == 2 and "--preset" in capsys.readouterr().err


def test_a_folder_holds_one_config_of_the_engine(tiny_run, capsys):
    """Parts are named by model, backend and phase: a --preset run into a folder of the default
    config's parts (and the reverse) exits 2 before anything is overwritten."""
    before = {p.name: p.read_bytes() for p in (tiny_run / "serve-parts").iterdir()}
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--tiny", "--out", str(tiny_run), "--preset", "accurate"])
    assert exc.value.code == 2
    assert (f"--preset: {tiny_run} holds parts of this engine with the default config, expected "
            f"preset 'accurate' (one --out folder per config)") in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in (tiny_run / "serve-parts").iterdir()} == before


def test_a_preset_reaches_the_minikv_worker_and_its_config(tmp_path):
    """``perf serve --preset NAME``: the minikv worker's command carries it (HF's does not), and
    the worker's engine config is ``MiniKVConfig.preset(NAME)`` with the workload's capacity."""
    import argparse

    from minikv_compile import MiniKVConfig
    from minikv_compile.perf import serve_bench, serve_worker

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    serve_bench.add_parsers(sub)
    args = parser.parse_args(["serve", "--tiny", "--out", str(tmp_path), "--preset", "accurate"])
    serve_bench.apply_presets(parser, args)
    minikv, hf = (Worker(b, args, tmp_path / f"{b}.log") for b in ("minikv", "hf"))
    assert minikv.argv[-2:] == ["--preset", "accurate"] and "--preset" not in hf.argv
    worker_args = parser.parse_args(minikv.argv[minikv.argv.index("serve-worker"):])
    # random weights guess the next token at random: the resync off (it would pre-decode about
    # every other step)
    assert worker_args.model == "tiny"
    want = MiniKVConfig.preset("accurate", max_batch_size=args.max_batch_size,
                               max_prompt_len=args.max_prompt_len,
                               max_new_tokens=args.max_new_tokens, recall_resync="off")
    assert serve_worker.minikv_config(worker_args) == want
    assert want.recall_top_k == 64 and want.rotation == "hadamard"
    worker_args.preset = None  # without one: the library's default
    assert serve_worker.minikv_config(worker_args) == MiniKVConfig(
        max_batch_size=args.max_batch_size, max_prompt_len=args.max_prompt_len,
        max_new_tokens=args.max_new_tokens, recall_resync="off")


# -- the load generator's arithmetic ------------------------------------------------------------


def test_workload_is_seeded_and_within_its_ranges():
    w = Workload(16, 64, 4, 12, vocab=256, long_prompt=160, long_every=3, seed=1)
    a, b = w.requests(9, "x", long=True), w.requests(9, "x", long=True)
    assert [s.body for s in a] == [s.body for s in b]
    assert [s.body for s in w.requests(9, "y")] != [s.body for s in a]
    for s in a:
        body = json.loads(s.body)
        assert len(body["prompt"]) == s.prompt_len and body["max_tokens"] == s.max_tokens
        assert body["stream"] is True and body["temperature"] == 0
        assert min(body["prompt"]) >= 3 and max(body["prompt"]) < 256
        assert s.prompt_len == 160 if s.index % 3 == 2 else 16 <= s.prompt_len <= 64
    with pytest.raises(ValueError, match="min <= max"):
        Workload(64, 16, 4, 12, vocab=256)


def test_poisson_arrivals_have_the_asked_rate():
    t = poisson_arrivals(4000, 8.0, seed=0, stream="s")
    assert t[0] == 0 and t == sorted(t) and t == poisson_arrivals(4000, 8.0, seed=0, stream="s")
    assert (len(t) - 1) / t[-1] == pytest.approx(8.0, rel=0.06)


def test_a_chunk_of_several_tokens_spreads_its_gap():
    o = Outcome(0, 10, 5, False, 0.0)
    o._sent = 100.0
    o.record(100.5, 2)   # the first chunk carries 2 tokens: TTFT 0.5 s, then 0 apart
    o.record(100.6, 1)
    o.record(101.2, 2)   # 0.6 s for 2 tokens: 0.3 s each
    assert o.ttft_s == pytest.approx(0.5) and o.tokens == 5 and o.chunks == 3
    assert o.itl_ms == pytest.approx([0.0, 100.0, 300.0, 300.0])
    # the intervals add up to last - first token time
    assert sum(o.itl_ms) == pytest.approx(700.0)


def test_percentile_is_nearest_rank():
    v = list(range(1, 101))
    assert percentile(v, 0.5) == 50 and percentile(v, 0.99) == 99 and percentile(v, 1.0) == 100
    assert percentile([3.0], 0.99) == 3.0 and percentile([], 0.5) is None
    assert percentile([1.0, math.inf], 0.99) == math.inf


def _sat(rate, bound):
    return {"rate": rate, "bound": bound}


BETWEEN, FLAT = "between sustained and unsustained rates", "throughput saturated"
LOWER = "lower bound (no unsustained rate measured)"


@pytest.mark.parametrize("ours, hf, status", [
    (_sat(6.0, BETWEEN), _sat(1.0, FLAT), "met"),
    (_sat(4.0, BETWEEN), _sat(1.0, FLAT), "missed"),
    # ours only a lower bound: a ratio under 5 decides nothing, one over 5 is met
    (_sat(4.0, LOWER), _sat(1.0, FLAT), "open"),
    (_sat(6.0, LOWER), _sat(1.0, FLAT), "met"),
    # HF only a lower bound: a ratio over 5 decides nothing
    (_sat(6.0, FLAT), _sat(1.0, LOWER), "open"),
    (_sat(None, "none sustained"), _sat(1.0, FLAT), "not measured"),
    # a noisy sweep's note after the kind leaves the kind's rule as it was
    (_sat(4.0, LOWER + "; not monotonic: 3/s unsustained at or below the sustained 4/s"),
     _sat(1.0, FLAT), "open"),
])
def test_saturation_target_respects_bounds(ours, hf, status):
    rows = targets({"minikv": {"saturation": ours}, "hf": {"saturation": hf}}, "llama3.1-8b")
    assert rows[0]["status"] == status


def _runs(*sustained):
    return [{"rate": rate, "sustained": ok} for rate, ok in sustained]


@pytest.mark.parametrize("runs, lo, stop, hi, bound", [
    (_runs((2.0, True), (4.0, False)), 2.0, None, 4.0, BETWEEN),
    (_runs((2.0, True), (4.0, True)), 4.0, None, None, LOWER),
    (_runs((2.0, True), (4.0, True)), 4.0, "output tokens/s stopped growing", None, FLAT),
    (_runs((2.0, False), (1.0, False)), None, None, 1.0, "none sustained"),
    # one window's p99 is noisy: a failure at or below the highest pass is named after the kind
    (_runs((3.28, False), (3.69, True), (4.1, False)), 3.69, None, 4.1,
     BETWEEN + "; not monotonic: 3.28/s unsustained at or below the sustained 3.69/s"),
    (_runs((3.28, False), (3.69, True)), 3.69, None, None,
     LOWER + "; not monotonic: 3.28/s unsustained at or below the sustained 3.69/s"),
    (_runs((4.0, False), (2.0, True), (4.0, True), (8.0, False)), 4.0, None, 8.0,
     BETWEEN + "; not monotonic: 4/s unsustained at or below the sustained 4/s"),
])
def test_saturation_bound(runs, lo, stop, hi, bound):
    assert saturation(runs, lo, stop) == {"rate": lo, "first_unsustained": hi, "bound": bound,
                                          "stopped": stop}


def test_offline_target_uses_the_steady_state_when_a_run_was_cut():
    ours = {"output_tokens_per_s": 2000.0, "output_tokens_per_s_late": 2400.0,
            "cut_by_budget": False}
    hf = {"output_tokens_per_s": 100.0, "output_tokens_per_s_late": 300.0,
          "cut_by_budget": False}
    row = targets({"minikv": {"offline": ours}, "hf": {"offline": hf}}, "llama3.1-8b")[-1]
    assert row["value"] == pytest.approx(20.0) and row["status"] == "met"
    hf["cut_by_budget"] = True
    row = targets({"minikv": {"offline": ours}, "hf": {"offline": hf}}, "llama3.1-8b")[-1]
    assert row["value"] == pytest.approx(8.0) and row["status"] == "missed"
    assert "second half" in row["detail"]


def test_engine_counters_and_each_replicas_share_from_the_fronts_metrics(tiny_run, tmp_path,
                                                                        monkeypatch):
    """Behind a data-parallel front the counters keep the sums and add each replica's tokens and
    steps (its samples labelled replica="i"); serve.md shows the phase's shares per replica."""
    samples = {"minikv_decode_steps_total": 30.0, "minikv_cuda_graph_replays_total": 30.0,
               "minikv_compiled_graphs_total": 2.0, "minikv_cuda_graphs": 4.0,
               'minikv_decode_steps_total{replica="0"}': 20.0,
               'minikv_decode_steps_total{replica="1"}': 10.0,
               'minikv_completion_tokens_total{replica="1"}': 40.0,
               'minikv_completion_tokens_total{replica="0"}': 70.0,
               'minikv_requests_total{outcome="stop",replica="0"}': 3.0}
    worker = object.__new__(Worker)
    monkeypatch.setattr(worker, "metrics", lambda: samples)
    assert worker.counters() == {"steps": 30, "replays": 30, "compiles": 2, "captures": 4,
                                 "replicas": {0: {"steps": 20, "tokens": 70},
                                              1: {"steps": 10, "tokens": 40}}}
    one = {k: v for k, v in samples.items() if "replica" not in k}
    monkeypatch.setattr(worker, "metrics", lambda: one)
    assert "replicas" not in worker.counters()  # a single server: the sums alone
    # the report's table of shares, from a part that has them
    out = tmp_path / "copy"
    shutil.copytree(tiny_run, out)
    store = PartStore(out)
    part = store.load("tiny", "minikv", "sweep")
    part["replicas"] = {"0": {"tokens": 70, "steps": 20}, "1": {"tokens": 40, "steps": 10}}
    assert store.save(part)
    assert main(["report", "--out", str(out)]) == 0
    assert "| minikv | sweep | 70 / 40 | 20 / 10 |" in (out / "serve.md").read_text()
