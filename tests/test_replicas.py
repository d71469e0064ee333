"""Data-parallel replicas behind one front: ``python -m minikv_compile.serve --data-parallel 2``.

One front over two CPU replicas (each an ordinary server process on a loopback port) of the tiny
model of ``test_serve``, shared by every test here, driven over HTTP: the requests spread over
both replicas and get what one server gives (greedy: the same text on either replica), the
front's ``/metrics`` is each replica's samples and their sum, and a replica killed while it
streams fails its own request with an error naming it while the other's completes; the front
then says so in ``/health`` and ``/metrics`` and serves on. The last test kills a replica.
"""
from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from minikv_compile.serve.errors import ApiError  # noqa: E402
from minikv_compile.serve.replicas import Replica, Replicas, merge_metrics  # noqa: E402
from test_serve import Server, _save_tiny_llama  # noqa: E402

# Tokens of the streams of the last test: long enough that one is still running when the test
# kills its replica (~1.5 ms a step on an idle CPU; every step slower on a loaded one).
STREAMED = 400
FLAGS = dict(max_batch_size=4, max_prompt_len=64, max_new_tokens=STREAMED, residual_length=16)
START_TIMEOUT = 240.0  # the front, then two replicas started together on a small machine
PROMPT = "w1 w2 w3 w4 w5"


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama")
    _save_tiny_llama(folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 1024  # room for STREAMED (RoPE has no weights)
    (folder / "config.json").write_text(json.dumps(config))
    logs = tmp_path_factory.mktemp("logs")
    srv = Server(folder, logs / "front.log", args=("--data-parallel", "2", "--compile-cache",
                                                   str(logs / "compiled")),
                 timeout=START_TIMEOUT, **FLAGS)
    yield srv
    pids = [r["pid"] for r in httpx.get(srv.url + "/health", timeout=10).json()["replicas"]]
    srv.stop()
    assert not any(_alive(pid) for pid in pids)  # the front stopped its replicas


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (not ended; an ended child not yet reaped counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def _complete(url: str, max_tokens: int, stream: bool = False) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": max_tokens,
                                                     "temperature": 0, "stream": stream},
                      timeout=300)


def _samples(text: str) -> dict:
    """``name{labels}`` -> value of every sample line."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def test_the_front_is_ready_when_both_replicas_are(front):
    health = httpx.get(front.url + "/health", timeout=10)
    assert health.status_code == 200
    body = health.json()
    assert body["status"] == "ok" and [r["state"] for r in body["replicas"]] == ["ready"] * 2
    assert len({r["pid"] for r in body["replicas"]} | {front.proc.pid}) == 3
    models = httpx.get(front.url + "/v1/models", timeout=10).json()
    assert models["data"][0]["max_new_tokens"] == STREAMED


def test_requests_spread_over_the_replicas_and_get_one_servers_answer(front):
    """Four requests 50 ms apart: both replicas serve some (the rule itself:
    ``test_the_front_picks_the_ready_replica_with_the_fewest_in_flight``), and every one gets
    the same greedy text (the replicas are the same model)."""
    replies, errors = [None] * 4, []

    def send(i: int) -> None:
        try:
            replies[i] = _complete(front.url, 100)
        except Exception as e:  # noqa: BLE001 - shown by the assertion below
            errors.append(repr(e))

    threads = [threading.Thread(target=send, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join(timeout=300)
    assert not errors and all(r is not None and r.status_code == 200 for r in replies), errors
    assert {r.headers["x-minikv-replica"] for r in replies} == {"0", "1"}
    texts = {r.json()["choices"][0]["text"] for r in replies}
    assert len(texts) == 1 and all(r.json()["usage"]["completion_tokens"] == 100 for r in replies)


def test_the_front_picks_the_ready_replica_with_the_fewest_in_flight():
    replicas = Replicas([Replica(i, [], {}, 0) for i in range(3)])
    with pytest.raises(ApiError, match="no replica is ready"):
        replicas.pick()
    for r, state, busy in zip(replicas.replicas, ("ready", "ready", "starting"), (2, 1, 0)):
        r.state, r.in_flight = state, busy
    assert replicas.pick().index == 1                   # fewest in flight among the ready
    replicas.replicas[0].in_flight = 1
    assert [replicas.pick().index for _ in range(4)] == [1, 0, 1, 0]  # ties in turn
    replicas.replicas[1].state = "dead"
    assert replicas.pick().index == 0 and replicas.status() == (503, "starting")
    replicas.replicas[2].state = "ready"
    assert replicas.status() == (200, "degraded")
    replicas.replicas[0].state = replicas.replicas[2].state = "dead"
    assert replicas.status() == (503, "failed")


def test_metrics_give_each_replica_and_their_sum(front):
    text = httpx.get(front.url + "/metrics", timeout=30).text
    s = _samples(text)
    for name in ('minikv_requests_total{outcome="length"}', "minikv_completion_tokens_total",
                 "minikv_slots", "minikv_decode_steps_total", "minikv_ready"):
        head, _, labels = name.partition("{")
        each = [s[f'{head}{{replica="{i}"' + (f",{labels}" if labels else "}")] for i in (0, 1)]
        assert s[name] == sum(each), name
    assert s["minikv_slots"] == 2 * FLAGS["max_batch_size"] and s["minikv_ready"] == 2
    # the four requests of the test before (and nothing else yet): 100 tokens each
    assert s['minikv_requests_total{outcome="length"}'] == 4
    assert s["minikv_completion_tokens_total"] == 400
    routed = [s[f'minikv_replica_routed_total{{replica="{i}"}}'] for i in (0, 1)]
    assert sum(routed) == 4 and min(routed) >= 1
    for i in (0, 1):
        assert s[f'minikv_replica_up{{replica="{i}"}}'] == 1
    # one HELP and TYPE per family, the sum before the replicas' samples
    assert text.count("# TYPE minikv_slots gauge") == 1
    lines = text.splitlines()
    assert lines.index("minikv_slots 8") < lines.index('minikv_slots{replica="0"} 4')


def test_merge_metrics_sums_histograms_and_labelled_samples():
    a = ('# HELP m_seconds h\n# TYPE m_seconds histogram\nm_seconds_bucket{le="0.1"} 1\n'
         'm_seconds_bucket{le="+Inf"} 2\nm_seconds_sum 0.25\nm_seconds_count 2\n')
    b = a.replace("} 1\n", "} 3\n").replace("_sum 0.25", "_sum 0.5")
    lines = merge_metrics([(0, a), (1, b)])
    assert lines[:6] == ["# HELP m_seconds h", "# TYPE m_seconds histogram",
                         'm_seconds_bucket{le="0.1"} 4', 'm_seconds_bucket{le="+Inf"} 4',
                         "m_seconds_sum 0.75", "m_seconds_count 4"]
    assert 'm_seconds_bucket{replica="1",le="0.1"} 3' in lines
    assert 'm_seconds_count{replica="0"} 2' in lines
    # counters past a million stay exact
    big = merge_metrics([(0, "# TYPE c counter\nc 1234567\n"), (1, "# TYPE c counter\nc 1\n")])
    assert big[1] == "c 1234568"


def _stream(url: str, out: dict, started: threading.Event) -> None:
    """A streamed request: its replica, its text chunks and its last event, into ``out``."""
    body = {"prompt": PROMPT, "max_tokens": STREAMED, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as reply:
        out["replica"] = reply.headers["x-minikv-replica"]
        out["events"] = []
        for line in reply.iter_lines():
            if line.startswith("data: "):
                out["events"].append(line[6:])
                started.set()


def test_a_replica_killed_mid_stream_fails_its_own_request_and_the_front_serves_on(front):
    health = httpx.get(front.url + "/health", timeout=10).json()
    pids = {str(r["replica"]): r["pid"] for r in health["replicas"]}
    outs, threads = [{}, {}], []
    for out in outs:
        started = threading.Event()
        threads.append(threading.Thread(target=_stream, args=(front.url, out, started)))
        threads[-1].start()
        assert started.wait(120), "no first chunk"
    assert sorted(o["replica"] for o in outs) == ["0", "1"]  # one stream on each replica
    victim = outs[0]["replica"]
    os.kill(pids[victim], signal.SIGKILL)
    for t in threads:
        t.join(timeout=300)
    cut, whole = outs[0]["events"], outs[1]["events"]
    # the killed replica's stream: its chunks so far, then an error naming the replica, [DONE]
    assert cut[-1] == "[DONE]"
    error = json.loads(cut[-2])["error"]
    assert re.match(rf"replica {victim} \(pid {pids[victim]}\) died .* while serving this "
                    rf"request", error["message"]), error
    assert error["type"] == "server_error"
    assert 1 <= sum(1 for e in cut[:-2] if json.loads(e)["choices"][0]["text"]) < STREAMED
    # the other replica's stream: every token (a chunk may carry several), finished by length
    chunks = [json.loads(e) for e in whole[:-1]]
    assert whole[-1] == "[DONE]" and chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == STREAMED
    # the front says so, and serves on with the other replica
    health = httpx.get(front.url + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "degraded"
    states = {str(r["replica"]): (r["state"], r["exit_status"]) for r in health.json()["replicas"]}
    assert states[victim] == ("dead", -signal.SIGKILL)
    s = _samples(httpx.get(front.url + "/metrics", timeout=30).text)
    assert s[f'minikv_replica_up{{replica="{victim}"}}'] == 0
    assert s[f'minikv_replica_dead{{replica="{victim}"}}'] == 1
    assert s[f'minikv_replica_failed_total{{replica="{victim}"}}'] == 1
    for _ in range(3):
        reply = _complete(front.url, 20)
        assert reply.status_code == 200 and reply.headers["x-minikv-replica"] != victim
