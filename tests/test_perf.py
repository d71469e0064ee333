"""``python -m minikv_compile.perf`` on the CPU: plumbing, exact memory figures, bad input.

Every subcommand runs end to end in ``--tiny`` mode (2-layer random Llama, a few tokens) and must
leave a finished JSON report with the environment block and its expected keys. GPU figures are
not checked here: without CUDA, memory and NVML fields are recorded as absent, with the reason.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minikv_compile.perf import harness as H
from minikv_compile.perf import measure as M
from minikv_compile.perf import report as R
from minikv_compile.perf.__main__ import main


def _experiment(name: str):
    """A script of ``perf/experiments/`` (no package: it does not ship), loaded from the tree."""
    path = Path(__file__).resolve().parent.parent / "perf" / "experiments" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pytestmark = pytest.mark.usefixtures("one_thread")


ENV_KEYS = {"timestamp", "python", "torch", "torch_cuda", "triton", "transformers", "git", "device", "nvml"}


def run_cli(out, *argv, expect=0):
    code = main([*argv, "--out", str(out)])
    assert code == expect
    data = json.loads((out / f"{argv[0]}.json").read_text())
    assert data["schema"] == R.SCHEMA and data["command"] == argv[0]
    assert ENV_KEYS <= set(data["environment"])
    assert (out / f"{argv[0]}.md").read_text().startswith(f"# `{argv[0]}`")
    return data


def rows(data, experiment):
    return [r for r in data["results"] if r.get("experiment") == experiment]


def ok_or_noise(row):
    # HF ms/token is a difference of two wall times; on a loaded 2-core CPU it can be swamped.
    return row["status"] == "ok" or (row["status"] == "error" and row["reason"].startswith("timing noise"))


# -- every subcommand, tiny, on the CPU ---------------------------------------------------------


def test_engine_vs_hf_tiny(tmp_path):
    data = run_cli(tmp_path, "engine-vs-hf", "--tiny")
    assert data["finished"] and data["context"]["model"]["name"] == "tiny"
    dec = rows(data, "decode")
    assert {(r["method"], r["batch"], r["prompt_len"]) for r in dec} == {
        (m, b, L) for m in ("hf-static", "minikv") for b, L in ((1, 96), (2, 64))}
    for r in dec:
        assert ok_or_noise(r), r
        if r["status"] == "ok":
            assert r["ms_per_token"] > 0 and r["decode_tokens_per_s"] > 0 and r["prefill_s"] >= 0
            assert r["kv_bytes"] > 0 and r["weight_bytes_read"] > 0 and r["kv_bytes_read"] > 0
            # no GPU: no memory figures, no floor, each with its reason
            assert r["peak_allocated_bytes"] is None and r["nvml"] is None and r["nvml_reason"]
            assert "floor_ms" not in r
    assert all(r["status"] == "ok" for r in dec if r["method"] == "minikv")
    assert data["context"]["bandwidth"]["reason"] == "no CUDA device"
    assert data["environment"]["nvml"] == {"available": False, "reason": "no CUDA device"}


def test_every_engine_vs_hf_method_has_a_config_and_a_label():
    from minikv_compile.perf.__main__ import ALL_METHODS, SPECACHE_METHODS
    for method in ALL_METHODS + SPECACHE_METHODS:
        assert method in H.METHOD_LABELS
        if method not in H.HF_METHODS:
            H.engine_config(method)  # raises on a name without a config, or a config refused
    assert set(H.ENGINE_METHODS) <= set(ALL_METHODS + SPECACHE_METHODS)


def test_latency_tiny(tmp_path):
    data = run_cli(tmp_path, "latency", "--tiny")
    lat = rows(data, "latency")
    assert {(r["method"], r["sweep"], r["batch"], r["prompt_len"]) for r in lat} == {
        (m, sweep, b, L) for m in ("hf-static", "minikv")
        for sweep, b, L in (("context", 1, 32), ("context", 1, 64), ("batch", 2, 48))}
    for r in lat:
        assert r["status"] == "ok", r
        st = r["ms_per_token_stats"]
        assert st["n"] == 4 == len(r["raw"]["token_ms"])  # --timed-tokens 4 intervals
        assert st["p10"] <= st["p50"] <= st["p90"] <= st["max"] and r["ttft_s"] > 0


def test_throughput_tiny(tmp_path):
    data = run_cli(tmp_path, "throughput", "--tiny")
    limits = {r["method"]: r for r in rows(data, "limit")}
    assert set(limits) == {"hf-static", "minikv"}
    for lim in limits.values():
        # no CUDA: the memory model cannot see free memory, so --max-batch is tried
        assert lim["predicted_limit"] is None and "no CUDA device" in lim["prediction_note"]
        assert lim["bytes_per_sequence"] > 0 and lim["attempts"][0][0] == 3
    mk = limits["minikv"]
    assert mk["status"] == "ok" and mk["verified_limit"] == 3 and mk["best_batch"] in (1, 3)
    tp = [r for r in rows(data, "throughput") if r["method"] == "minikv"]
    assert sorted(r["batch"] for r in tp) == [1, 3]
    for r in tp:
        assert r["decode_tokens_per_s"] > 0 and r["e2e_tokens_per_s"] > 0 and r["gen_tokens"] == 8


def test_max_prompt_tiny(tmp_path):
    data = run_cli(tmp_path, "max-prompt", "--tiny")
    cap = data["context"]["memory_cap"]
    assert cap["emulated"] is True and cap["cap_bytes"] > 0
    summary = {r["method"]: r for r in rows(data, "max-prompt")}
    assert set(summary) == {"hf-static", "minikv"}
    for method, s in summary.items():
        probes = [r for r in rows(data, "probe") if r["method"] == method]
        assert s["probes"] == len(probes) <= 5
        fits = [r["prompt_len"] for r in probes if r["fits"]]
        fails = [r["prompt_len"] for r in probes if r["fits"] is False]
        assert s["longest_prompt"] == (max(fits) if fits else None)
        assert s["shortest_failing"] == (min(fails) if fails else None)
        if fits and fails:
            assert max(fits) < min(fails)
        for r in probes:  # a probe fits exactly when its estimated need is under the cap
            assert r["fits"] == (r["need_bytes"] <= cap["cap_bytes"])


def test_prefill_tiny(tmp_path):
    data = run_cli(tmp_path, "prefill", "--tiny")
    pf = rows(data, "prefill")
    assert {(r["method"], r["prompt_len"]) for r in pf} == {
        (m, L) for m in ("minikv", "full", "hf-eager", "hf-eager-attn") for L in (32, 64)}
    for r in pf:
        assert r["status"] == "ok", r
        assert r["prefill_s"] > 0 and r["kv_bytes"] > 0


def test_memory_claim_tiny(tmp_path):
    data = run_cli(tmp_path, "memory-claim", "--tiny")
    mc = {r["method"]: r for r in rows(data, "memory-claim")}
    assert set(mc) == {"full", "kivi", "minikv", "minikv-pyramid"}
    for r in mc.values():
        assert r["total_bytes"] == r["quantized_region_bytes"] + r["ring_bytes"] + r["counters_bytes"]


# -- the paper's memory claim, exact ------------------------------------------------------------


def test_memory_claim_llama2_7b_exact(tmp_path):
    """LLaMA2-7B shape, prompt 4096 + 512 generated, 25% / 25%: 2.4 GB vs 0.33 GB (App. I)."""
    data = run_cli(tmp_path, "memory-claim")  # real shape: a meta-device model, no GPU needed
    fp16 = 2 * 32 * 4096 * (4096 + 512) * 2
    formula = 32 * 4096 * (2048 + 512)
    assert fp16 == 2_415_919_104 and formula == 335_544_320
    paper = data["context"]["paper"]
    assert paper["fp16_bytes"] == fp16 and paper["minikv_bytes"] == formula
    mc = {r["method"]: r for r in rows(data, "memory-claim")}
    mk = mc["minikv"]
    assert mk["fp16_bytes"] == fp16 and mk["formula_bytes"] == formula
    assert mk["fp16_matches_paper"] and mk["formula_matches_paper"]
    # allocated = the formula's quantized region + a 128-token bf16 ring (K and V, 32 layers)
    ring = 32 * 2 * 128 * 4096 * 2
    assert mk["ring_bytes"] == ring and mk["padding_bytes"] == 0
    assert mk["quantized_region_bytes"] == formula
    assert mk["total_bytes"] == formula + ring + mk["counters_bytes"]
    assert mk["over_paper_minikv_bytes"] == ring + mk["counters_bytes"]
    assert mc["full"]["codes_bytes"] == fp16
    md = (tmp_path / "memory-claim.md").read_text()
    assert "2.4 GB" in md and "0.33 GB" in md and "ring" in md


def test_paper_formulas():
    assert H.paper_fp16_kv_bytes(32, 4096, 4096, 512) == 2 * 32 * 4096 * (4096 + 512) * 2
    assert H.paper_minikv_kv_bytes(32, 4096, 4096, 512) == 32 * 4096 * (2048 + 512)


def test_bytes_read_per_step_llama31_8b():
    """The floor at 1 x 32k (Llama-3.1-8B shape): 4.3 GB of fp16 KV read per step, 0.54 GB of
    MiniKV KV."""
    meta = H.meta_model("llama3.1-8b")
    facts = H.model_summary(meta)
    assert facts["parameters"] == 8_030_261_248 and facts["weight_bytes"] == 16_060_522_496
    # the input embedding table is not read by a step (only B rows of it)
    assert facts["weight_bytes_read_per_step"] == facts["weight_bytes"] - 128256 * 4096 * 2
    assert H.kv_bytes_read(meta, "hf-static", 32768, 0, 1) == 2 * 32 * 1024 * 32768 * 2
    # prefill leaves the last 64 kept tokens in the bf16 ring (2 bytes per value instead of
    # half a byte), 16 generated tokens join them
    kv_32k = 32 * 2 * 1024 * ((16384 - 64) // 2 + 64 * 2)
    assert H.kv_bytes_read(meta, "minikv", 32768, 0, 1) == kv_32k
    assert H.kv_bytes_read(meta, "minikv", 4096, 16, 8) == 8 * 32 * 2 * 1024 * (
        (2048 - 64) // 2 + (64 + 16) * 2)
    bw = {"bytes_per_s": 4.27e12}
    f = H.floor_figures(meta, "minikv", 32768, 1, 0, 4.0, bw)
    weights = facts["weight_bytes_read_per_step"]
    assert f["floor_ms"] == pytest.approx(1e3 * (weights + kv_32k) / 4.27e12)
    assert f["x_floor"] == pytest.approx(4.0 / f["floor_ms"])


def test_copy_bandwidth_takes_the_fastest_block_median():
    # A disturbed stretch of copies (the second block) must not lower the figure: a low copy
    # bandwidth raises the floor and flatters every ratio to it.
    times = [5.1, 5.0, 5.2, 6.1, 6.0, 6.3, 5.0, 4.9, 5.1]
    assert M.fastest_block_median(times, 3) == (5.0, [5.1, 6.1, 5.0])
    # markdown: the new record names its blocks; reports written before it keep their wording
    base = {"command": "engine-vs-hf", "argv": [], "environment": {}}
    new = {"bytes_per_s": 4.2e12, "iters": 200, "blocks": 5, "per_block": 40}
    md = R.render_markdown({**base, "context": {"bandwidth": new}})
    assert "4.20 TB/s (bytes read + written, the fastest of 5 medians of 40 copies)" in md
    md = R.render_markdown({**base, "context": {"bandwidth": {"bytes_per_s": 4.2e12, "iters": 100}}})
    assert "4.20 TB/s (bytes read + written, median of 100)" in md


# -- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    ([], "required"),
    (["latency"], "--out"),
    (["warp-speed", "--out", "x"], "invalid choice"),
    (["latency", "--out", "x", "--contexts", "1024,0"], "expected a positive integer"),
    (["latency", "--out", "x", "--contexts", "lots"], "expected a positive integer"),
    (["engine-vs-hf", "--out", "x", "--shapes", "1by32768"], "BATCHxPROMPT"),
    (["throughput", "--out", "x", "--methods", "minikv,vllm"], "expected comma-separated methods"),
    (["memory-claim", "--out", "x", "--methods", "hf-static"], "expected comma-separated methods"),
    (["max-prompt", "--out", "x", "--memory-cap-gb", "-24"], "expected a positive number"),
    (["prefill", "--out", "x", "--budget-seconds", "nan"], "expected a positive number"),
    (["throughput", "--out", "x", "--retries", "-1"], "--retries"),
    (["latency", "--out", "x", "--model", "gpt-5"], "invalid choice"),
    (["memory-claim", "--out", "/proc/no/such/dir"], "cannot write reports"),
    (["report", "--out", "/no/such/folder"], "expected a folder of reports"),
])
def test_invalid_arguments_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and message in err and "Traceback" not in err


def test_usage_error_through_python_dash_m(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "minikv_compile.perf", "latency", "--out", str(tmp_path),
                           "--batches", "4,-1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "usage:" in proc.stderr and "--batches" in proc.stderr and "Traceback" not in proc.stderr


# -- failures are results -----------------------------------------------------------------------


def test_injected_oom_is_recorded_not_raised(tmp_path, monkeypatch):
    real = H.make_runner

    def runner_that_ooms(model, method, **kw):
        if method == "minikv":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return real(model, method, **kw)

    monkeypatch.setattr(H, "make_runner", runner_that_ooms)
    data = run_cli(tmp_path, "throughput", "--tiny", "--methods", "minikv,hf-eager")
    assert data["finished"]
    mk = [r for r in rows(data, "throughput") if r["method"] == "minikv"]
    assert [r["batch"] for r in mk] == [3, 2]  # the OOM at 3 was retried once at 3 * 0.75
    assert all(r["status"] == "oom" and "out of memory" in r["reason"] for r in mk)
    assert all(r["error_type"] == "OutOfMemoryError" for r in mk)
    limit = {r["method"]: r for r in rows(data, "limit")}
    assert limit["minikv"]["status"] == "oom" and limit["minikv"]["verified_limit"] is None
    assert limit["minikv"]["attempts"] == [[3, "oom"], [2, "oom"]]
    assert ok_or_noise(next(r for r in rows(data, "throughput") if r["method"] == "hf-eager"))
    assert "out of memory" in (tmp_path / "throughput.md").read_text()


def test_is_oom_sees_wrapped_errors():
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory")
        except Exception as inner:
            raise RuntimeError("backend compiler failed") from inner
    except RuntimeError as outer:
        assert H.is_oom(outer)
    assert H.is_oom(RuntimeError("CUDA error: out of memory"))
    assert not H.is_oom(ValueError("bad shape"))


def test_interrupted_run_keeps_what_it_measured(tmp_path, monkeypatch):
    real, calls = H.time_stream, []

    def stream_then_interrupt(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("signal 15")
        return real(*args, **kw)

    monkeypatch.setattr(H, "time_stream", stream_then_interrupt)
    data = run_cli(tmp_path, "latency", "--tiny", "--methods", "minikv", expect=130)
    assert not data["finished"] and "signal 15" in data["interrupted"]
    assert [r["status"] for r in rows(data, "latency")] == ["ok"]


def test_time_budget_skips_and_still_reports(tmp_path):
    data = run_cli(tmp_path, "latency", "--tiny", "--budget-seconds", "1e-9")  # spent at once
    assert data["finished"]
    assert data["results"] and all(r["status"] == "skipped" and "time budget" in r["reason"]
                                   for r in data["results"])


def test_real_shape_without_gpu_is_skipped_with_reason(tmp_path):
    data = run_cli(tmp_path, "engine-vs-hf")
    assert data["finished"] and len(data["results"]) == 4
    assert all(r["status"] == "skipped" and "no CUDA device" in r["reason"] for r in data["results"])


def test_budget_uses_what_a_kind_took():
    b = H.Budget(100.0)
    assert b.check("engine") is None  # never seen: starts while a quarter of the budget is left
    b.start -= 80.0
    assert "time budget" in b.check("engine")
    b.start += 80.0
    b.note("engine", 150.0)
    assert "time budget" in b.check("engine")
    assert b.check("other") is None
    assert H.Budget(None).check("anything") is None


# -- reports ------------------------------------------------------------------------------------


def test_report_subcommand_and_plots_degrade(tmp_path, monkeypatch, capsys):
    run_cli(tmp_path, "memory-claim", "--tiny")
    monkeypatch.setattr(R, "_pyplot", lambda: None)
    assert main(["report", "--out", str(tmp_path)]) == 0
    assert "matplotlib is not importable" in capsys.readouterr().err
    summary = (tmp_path / "summary.md").read_text()
    assert "[`memory-claim`](memory-claim.md)" in summary
    data = json.loads((tmp_path / "memory-claim.json").read_text())
    assert data["plots"] == []


def test_targets_report_the_margin():
    def tp(method, batch, tps):
        return {"experiment": "throughput", "method": method, "batch": batch, "prompt_len": 4096,
                "status": "ok", "decode_tokens_per_s": tps}
    data = {"command": "throughput", "results": [tp("hf-static", 32, 1000.0), tp("hf-static", 48, 1200.0),
                                                 tp("minikv", 128, 3000.0), tp("minikv", 64, 2000.0)]}
    (t,) = R.targets([data])
    assert t["value"] == pytest.approx(2.5) and t["met"] is False
    assert t["margin"] == pytest.approx(2.5 / 3 - 1)  # missed by 17%
    assert "batch 128" in t["detail"] and "batch 48" in t["detail"]


# -- GPU-only logic, driven on the CPU through fakes --------------------------------------------


def test_throughput_limit_is_predicted_confirmed_and_refined(tmp_path, monkeypatch):
    """With fake device memory: predict 2 sequences, confirm 2, then the measured bytes per
    sequence (a quarter of the prediction) say 8 fit, and 8 is run and confirmed."""
    from minikv_compile.perf.__main__ import _bytes_per_sequence

    model = H.build_model("tiny", torch.device("cpu"), torch.float32)
    per_seq, fixed = _bytes_per_sequence(H, model, "minikv", 48, 9)  # capacity: 2 + 6 + 1 tokens
    margin = 2**30
    usable = margin + fixed + 2 * per_seq + 10
    monkeypatch.setattr(H, "device_memory", lambda device, cap=None: {
        "total_bytes": 8 * 2**30, "free_bytes": usable, "allocated_bytes": 0, "usable_bytes": usable})

    class FakeWatch:
        def __init__(self, device, sampler):
            self.result = {}

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.result = {"allocated_before_bytes": 0, "peak_allocated_bytes": (usable - margin) * 2 // 8,
                           "nvml": None, "nvml_reason": "fake"}
            return False

    monkeypatch.setattr(H, "MemoryWatch", FakeWatch)
    data = run_cli(tmp_path, "throughput", "--tiny", "--methods", "minikv", "--max-batch", "8")
    (limit,) = rows(data, "limit")
    assert limit["predicted_limit"] == 2 and not limit["capped_by_max_batch"]
    assert limit["refit_limit"] == 8 and limit["attempts"] == [[2, "ok"], [8, "ok"]]
    assert limit["verified_limit"] == 8
    # --batches 1 (the tiny preset) adds the curve's point below the limit
    assert sorted(r["batch"] for r in rows(data, "throughput")) == [1, 2, 8]


class _FakeNvml:
    NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 1, 2, 0

    def __init__(self):
        self.used = 1000

    def nvmlDeviceGetMemoryInfo(self, handle):
        self.used += 1000  # memory grows while the sampler runs
        return type("Mem", (), {"used": self.used, "total": 80 * 2**30})()

    def nvmlDeviceGetPowerUsage(self, handle):
        return 350_000  # mW

    def nvmlDeviceGetClockInfo(self, handle, kind):
        return 1980

    def nvmlDeviceGetMaxClockInfo(self, handle, kind):
        return 1980

    def nvmlDeviceGetName(self, handle):
        return b"NVIDIA H100 80GB HBM3"

    def nvmlSystemGetDriverVersion(self):
        return "580.00"

    def nvmlSystemGetCudaDriverVersion(self):
        return 13000

    def nvmlDeviceGetEnforcedPowerLimit(self, handle):
        return 700_000

    def nvmlDeviceGetTemperature(self, handle, kind):
        raise RuntimeError("not supported")  # one failing query must not lose the others

    nvmlDeviceGetPerformanceState = nvmlDeviceGetPersistenceMode = nvmlDeviceGetTemperature


def test_nvml_sampler_and_environment_with_a_fake_nvml(monkeypatch):
    fake = _FakeNvml()
    monkeypatch.setattr(M, "_nvml", lambda: fake)
    monkeypatch.setattr(M, "_nvml_handle", lambda p, device: "handle")
    dev = torch.device("cuda", 0)
    sampler = M.NvmlSampler(dev, interval_s=0.005)
    assert sampler.available
    sampler.start()
    import time
    time.sleep(0.05)
    out = sampler.stop()["nvml"]
    assert out["samples"] >= 3 and out["peak_used_bytes"] == fake.used > out["start_used_bytes"]
    assert out["max_power_w"] == pytest.approx(350.0) and out["max_sm_clock_mhz"] == 1980
    info = M.nvml_info(dev)
    assert info["available"] and info["name"] == "NVIDIA H100 80GB HBM3" and info["driver_version"] == "580.00"
    assert info["power_limit_w"] == pytest.approx(700.0) and info["temperature_c"] is None


def test_nvml_unavailable_is_a_reason_not_an_error(monkeypatch):
    def broken():
        raise ImportError("No module named 'pynvml'")
    monkeypatch.setattr(M, "_nvml", broken)
    sampler = M.NvmlSampler(torch.device("cuda", 0))
    assert not sampler.available and "NVML unavailable" in sampler.reason
    assert sampler.stop() == {"nvml": None, "nvml_reason": sampler.reason}
    assert M.nvml_info(torch.device("cuda", 0))["available"] is False


def test_ncu_summary_counts_wavefronts_and_finds_the_conflicted_instruction(tmp_path, capsys):
    """The ncu helper sums ncu's per-instruction source page by opcode and lists the
    instructions whose shared-memory wavefronts exceed the conflict-free ideal."""
    summarize = _experiment("ncu_decode_attention").summarize

    cols = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
            "L1 Wavefronts Shared", "L1 Wavefronts Shared Ideal"]
    rows = [["0x10", "LDSM.16.MT88.4 R32, [R5]", "30", "100", "800", "400"],
            ["0x20", "LDSM.16.MT88.4 R28, [R5+0x800]", "10", "100", "400", "400"],
            ["0x30", "@!P0 STS.128 [R9], R24", "20", "50", "200", "200"],
            ["0x40", "HFMA2 R1, R2, R3, R4", "40", "300", "0", "0"]]
    path = tmp_path / "source.csv"
    path.write_text('"Kernel Name","k",\n' + "\n".join(
        ",".join(f'"{c}"' for c in r) for r in [cols] + rows) + "\n")
    summarize(str(path))
    out = capsys.readouterr().out
    assert "550 warp instructions, 1,400 shared-memory wavefronts (1,000 conflict-free)" in out
    by_op = {line.split()[0]: line.split()[1:] for line in out.splitlines()
             if line.startswith(("LDSM", "STS", "HFMA2"))}
    assert by_op["LDSM.16"] == ["40.0", "1,200", "800", "200"]
    assert by_op["STS.128"] == ["20.0", "200", "200", "50"]  # predicate dropped
    assert by_op["HFMA2"][0] == "40.0"
    conflicted = out.split("instruction")[-1]
    assert "[R5] " in conflicted and "0x800" not in conflicted and "STS" not in conflicted
