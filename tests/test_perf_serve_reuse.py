"""``python -m minikv_compile.perf serve --phases reuse``: the plumbing of the prefix-cache phase
on the CPU (``--tiny``: one real server process on loopback, 4 users, 3 turns each, 2 shared
documents), and its arguments. The figures are the GPU's to give; here, what each request's
cached tokens must be: a user's first question is admitted from its document's upload, each
later one from the turn before it (that turn's prompt), and nothing with reuse off."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from minikv_compile.perf.__main__ import main  # noqa: E402


@pytest.fixture(scope="module")
def reuse_part(tmp_path_factory):
    out = tmp_path_factory.mktemp("serve_reuse")
    proc = subprocess.run([sys.executable, "-m", "minikv_compile.perf", "serve", "--tiny",
                           "--phases", "reuse", "--backends", "minikv", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    part = json.loads((out / "serve-parts" / "tiny.minikv.reuse.json").read_text())
    assert part["status"] == "ok", part.get("reason")
    return part, proc.stderr


def test_reuse_phase_off_then_on_with_each_turns_cached_tokens(reuse_part):
    part, stderr = reuse_part
    users, turns = part["users"], part["turns"]
    runs = part["runs"]
    assert [(r["load"], r["reuse"]) for r in runs] == [
        ("poisson", False), ("poisson", True), ("burst", False), ("burst", True)]
    for run in runs:
        assert run["completed"] == run["requests"] == users * turns
        assert run["tokens_exact"] and run["requests_per_s"] > 0
    for off, on, doc_lens in ((runs[0], runs[1], part["doc_lens"]),
                              (runs[2], runs[3], part["burst_doc_lens"])):
        # off: every request opted out, none looked up
        assert off["cached_tokens"] == 0 and off["pool_queries"] == 0 and off["pool_hits"] == 0
        # on: turn 1 from the document's upload, turn k from turn k - 1's prompt
        assert on["pool_evictions"] == 0  # (the tiny pool holds every context)
        rows = {r["index"]: r for r in on["per_request"]}
        for u in range(users):
            for k in range(turns):
                want = (doc_lens[u % len(doc_lens)] if k == 0
                        else rows[u * turns + k - 1]["prompt_len"])
                assert rows[u * turns + k]["cached_tokens"] == want, (u, k)
        assert on["cached_tokens"] == on["pool_hits"] == sum(r["cached_tokens"]
                                                             for r in rows.values())
        assert on["pool_queries"] == on["prompt_tokens"]
        assert on["hit_rate"] == pytest.approx(on["cached_tokens"] / on["prompt_tokens"])
        assert on["pool_bytes"] > 0 and on["pool_entries"] >= len(doc_lens) + users * turns
    # the burst's users arrive at once; the Poisson ones spread
    assert all(r["arrival_s"] < 1.0 for r in runs[2]["per_request"] if r["index"] % turns == 0)
    assert part["burst_doc_lens"] != part["doc_lens"]
    ratios = part["reuse"]
    assert ratios["ttft_p50_on_over_off"] == pytest.approx(runs[1]["ttft_p50_s"]
                                                           / runs[0]["ttft_p50_s"])
    assert ratios["requests_per_s_on_over_off_burst"] == pytest.approx(
        runs[3]["requests_per_s"] / runs[2]["requests_per_s"])
    assert "| burst | on |" in stderr and "| poisson | off |" in stderr


@pytest.mark.parametrize("argv, message", [
    (["--phases", "reuse"], "--phases reuse: expected alone with --backends minikv"),
    (["--phases", "reuse,single", "--backends", "minikv"], "--phases reuse: expected alone"),
    (["--phases", "reuse", "--backends", "minikv", "--max-prompt-len", "64"],
     "--max-prompt-len: expected room for phase reuse's last turn"),
])
def test_reuse_bad_arguments_exit_2(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--tiny", "--out", str(tmp_path / "x"), *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err
