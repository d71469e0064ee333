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
    users, turns, doc_lens = part["users"], part["turns"], part["doc_lens"]
    off, on = part["runs"]
    assert (off["reuse"], on["reuse"]) == (False, True)
    for run in (off, on):
        assert run["completed"] == run["requests"] == users * turns
        assert run["tokens_exact"]
    # off: every request opted out, none looked up
    assert off["cached_tokens"] == 0 and off["pool_queries"] == 0 and off["pool_hits"] == 0
    # on: turn 1 from the document's upload, turn k from turn k - 1's prompt
    assert on["pool_evictions"] == 0  # (the tiny pool holds every context)
    rows = {r["index"]: r for r in on["per_request"]}
    for u in range(users):
        for k in range(turns):
            want = doc_lens[u % len(doc_lens)] if k == 0 else rows[u * turns + k - 1]["prompt_len"]
            assert rows[u * turns + k]["cached_tokens"] == want, (u, k)
    assert on["cached_tokens"] == on["pool_hits"] == sum(r["cached_tokens"] for r in rows.values())
    assert on["pool_queries"] == on["prompt_tokens"]
    assert on["hit_rate"] == pytest.approx(on["cached_tokens"] / on["prompt_tokens"])
    assert on["pool_bytes"] > 0 and on["pool_entries"] >= len(doc_lens) + users * turns
    assert "| on |" in stderr and "| off |" in stderr


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
