"""Data-parallel replicas behind one front: ``python -m minikv_compile.serve --data-parallel 2``.

One front over two CPU replicas (each an ordinary server process on a loopback port) of the tiny
model of ``test_serve``, shared by every test here, driven over HTTPS with an API key (the
front's door: its TLS, key, Host check and body limit) and a prefix cache on each replica: the
requests spread over both replicas and get what one server gives (greedy: the same text on
either replica), the front's ``/metrics`` is each replica's samples and their sum, the turns of
a conversation follow its first turn to one replica and hit its prefix cache (another cache
salt does not), unrelated requests spread, and a replica killed while it streams fails its own
request with an error naming it while the other's completes; the front then says so in
``/health`` and ``/metrics`` and serves on. The last test kills a replica.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from minikv_compile.serve.affinity import (  # noqa: E402
    MAX_ROUTE, Affinity, hashes_of, route_of)
from minikv_compile.serve.errors import ApiError  # noqa: E402
from minikv_compile.serve.replicas import (FALLBACK_BODY_BYTES, Replica,  # noqa: E402
                                           Replicas, counters_only, create_front, kept,
                                           merge_metrics, prompt_tokens, replica_commands,
                                           without_tls)
from minikv_compile.serve.security import ServeOptions  # noqa: E402
from test_serve import (  # noqa: E402
    Server, _read_until_closed, _save_tiny_llama, self_signed_cert)

# Tokens of the streams of the last test: long enough that one is still running when the test
# kills its replica (~1.5 ms a step on an idle CPU; every step slower on a loaded one).
STREAMED = 400
FLAGS = dict(max_batch_size=4, max_prompt_len=64, max_new_tokens=STREAMED, residual_length=16)
START_TIMEOUT = 240.0  # the front, then two replicas started together on a small machine
PROMPT = "w1 w2 w3 w4 w5"
KEY = "sk-minikv-front-0123456789"
GOOD_ORIGIN = "http://good.example"
NO_REUSE = {"prefix_cache": False}  # routed by load alone, answered without a kept context
# The default body limit of test_serve's tiny model: 64 tokens x 13 characters x 12 B + 64 KiB.
LIMIT = 64 * 13 * 12 + 65536


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama")
    _save_tiny_llama(folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 1024  # room for STREAMED (RoPE has no weights)
    (folder / "config.json").write_text(json.dumps(config))
    logs = tmp_path_factory.mktemp("logs")
    key, cert = self_signed_cert(logs)
    srv = Server(folder, logs / "front.log", args=("--data-parallel", "2", "--compile-cache",
                                                   str(logs / "compiled"),
                                                   "--allowed-origins", GOOD_ORIGIN),
                 timeout=START_TIMEOUT, cert=cert, env={"MINIKV_API_KEY": KEY},
                 ssl_keyfile=key, ssl_certfile=cert, prefix_cache_gpu_bytes=4 << 20,
                 preset="snapkv", **FLAGS)
    yield srv
    pids = [r["pid"] for r in httpx.get(srv.url + "/health", timeout=10,
                                        verify=srv.verify).json()["replicas"]]
    srv.stop()
    assert not any(_alive(pid) for pid in pids)  # the front stopped its replicas


@pytest.fixture(scope="module")
def client(front):
    with httpx.Client(base_url=front.url, verify=front.verify, timeout=300.0,
                      headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (not ended; an ended child not yet reaped counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def _complete(client, max_tokens: int) -> httpx.Response:
    return client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": max_tokens,
                                                "temperature": 0, "minikv": NO_REUSE})


def _samples(text: str) -> dict:
    """``name{labels}`` -> value of every sample line."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def test_the_front_is_ready_when_both_replicas_are(front, client):
    health = client.get("/health")
    assert health.status_code == 200
    body = health.json()
    assert body["status"] == "ok" and [r["state"] for r in body["replicas"]] == ["ready"] * 2
    assert len({r["pid"] for r in body["replicas"]} | {front.proc.pid}) == 3
    models = client.get("/v1/models").json()
    assert models["data"][0]["max_new_tokens"] == STREAMED
    assert models["data"][0]["max_body_bytes"] == LIMIT


def test_requests_spread_over_the_replicas_and_get_one_servers_answer(client):
    """Without prefix reuse (so without affinity): a request sent while another streams goes
    to the other replica (fewest in flight), the next two one to each (ties in turn; the rule
    itself: ``test_the_front_picks_the_ready_replica_with_the_fewest_in_flight``), and all four
    get the same greedy text (the replicas are the same model). One request a replica at a
    time: a batch of two compiles its own step on the CPU (~20 s, cold)."""
    out, started = {}, threading.Event()
    streaming = threading.Thread(target=_stream, args=(client, out, started, _body(PROMPT, 100)))
    streaming.start()
    assert started.wait(120), "no first chunk"
    replies = [_complete(client, 100)]
    streaming.join(timeout=300)
    assert replies[0].status_code == 200
    assert replies[0].headers["x-minikv-replica"] != out["replica"]
    replies += [_complete(client, 100) for _ in range(2)]
    assert all(r.status_code == 200 for r in replies)
    assert {r.headers["x-minikv-replica"] for r in replies[1:]} == {"0", "1"}
    texts = {r.json()["choices"][0]["text"] for r in replies} | {_text(out["events"])}
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


def test_the_front_weighs_the_prompt_tokens_ahead_before_the_requests_in_flight():
    replicas = Replicas([Replica(i, [], {}, 0) for i in range(3)], slots=4)
    for r, pending, busy in zip(replicas.replicas, (32000, 0, 0), (0, 3, 2)):
        r.state, r.pending, r.in_flight = "ready", pending, busy
    assert replicas.pick().index == 2                    # no prompt ahead, fewer in flight
    replicas.replicas[2].in_flight = 4                   # full: of the others, no prompt ahead
    assert replicas.pick().index == 1
    # affinity holds while the prompt ahead of it, less what it keeps, is no more than the
    # least loaded's
    assert replicas.pick(prefer=0, cached=32000).index == 0 and replicas.yielded == 0
    assert replicas.pick(prefer=0, cached=31999).index == 1 and replicas.yielded == 1


def test_an_affinity_match_keeps_its_share_of_the_prompt_tokens():
    affinity = Affinity()
    first, second = {"prompt": list(range(300))}, {"prompt": list(range(400))}
    scope, route = route_of("/v1/completions", first)
    last, match = affinity.find(scope, route)
    assert kept(prompt_tokens("/v1/completions", first), match, last) == (None, 0)
    affinity.remember_last(scope, *last, 1)              # the first turn answered by replica 1
    last, match = affinity.find(*route_of("/v1/completions", second))
    assert kept(prompt_tokens("/v1/completions", second), match, last) == (1, 300)
    # text: the matched characters' share of the tokens counted at 4 characters each
    assert kept(prompt_tokens("/v1/completions", {"prompt": "a" * 400}), (0, 100),
                (400, 7)) == (0, 25)


def test_prompt_tokens_counts_ids_exactly_and_text_at_four_characters():
    assert prompt_tokens("/v1/completions", {"prompt": [5, 6, 7]}) == 3
    assert prompt_tokens("/v1/completions", {"prompt": "abcdefghi"}) == 3
    chat = {"messages": [{"role": "system", "content": "abcd"},
                         {"role": "user", "content": [{"type": "text", "text": "efghi"}]}]}
    assert prompt_tokens("/v1/chat/completions", chat) == 3
    for junk in ([], {"prompt": 3}, {"messages": "hi"}, {"prompt": [[1, 2], [3]]},
                 {"prompt": ["a", "b"]}):  # the replica answers the 400
        assert prompt_tokens("/v1/completions", junk) == 0
        assert prompt_tokens("/v1/chat/completions", junk) == 0


def test_metrics_give_each_replica_and_their_sum(client):
    text = client.get("/metrics").text
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
        # every request has streamed: no prompt token is counted ahead of a replica
        assert s[f'minikv_replica_pending_prompt_tokens{{replica="{i}"}}'] == 0
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


def test_a_dead_replicas_counters_stay_and_its_gauges_go():
    text = ('# HELP g_slots s\n# TYPE g_slots gauge\ng_slots 4\n'
            '# HELP c_total c\n# TYPE c_total counter\nc_total{outcome="eos"} 5\n'
            '# HELP h_seconds h\n# TYPE h_seconds histogram\nh_seconds_bucket{le="+Inf"} 2\n'
            'h_seconds_sum 0.5\nh_seconds_count 2\nuntyped 1\n')
    assert counters_only(text).splitlines() == [
        "# HELP c_total c", "# TYPE c_total counter", 'c_total{outcome="eos"} 5',
        "# HELP h_seconds h", "# TYPE h_seconds histogram", 'h_seconds_bucket{le="+Inf"} 2',
        "h_seconds_sum 0.5", "h_seconds_count 2"]
    assert counters_only(None) is None


# -- stand-in replicas (tests/fake_replica.py): an engine failure, a refused connection, a cut
# stream, which real replicas do not give on cue ------------------------------------------------

FAKE = str(Path(__file__).with_name("fake_replica.py"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _until(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture
def fakes(tmp_path):
    """Two stand-in replicas, started and ready; (the Replicas, each one's failure flag file)."""
    ports, flags = [_free_port(), _free_port()], [tmp_path / "failed0", tmp_path / "failed1"]
    replicas = Replicas([Replica(i, [sys.executable, FAKE, str(port), str(flag)],
                                 dict(os.environ), port)
                         for i, (port, flag) in enumerate(zip(ports, flags))], slots=4)
    replicas.start()
    try:
        _until(lambda: all(r.state == "ready" for r in replicas.replicas))
        yield replicas, flags
    finally:
        replicas.stop()


def test_a_replica_whose_engine_failed_is_stopped_and_the_front_serves_on(fakes):
    replicas, flags = fakes
    victim = replicas.replicas[1]
    flags[1].write_text("CUDA error: an illegal memory access was encountered")
    _until(lambda: victim.state == "dead")
    assert victim.failure == "CUDA error: an illegal memory access was encountered"
    assert replicas.status() == (200, "degraded")
    assert "replica 1 dead (its engine failed: CUDA error" in replicas.summary()
    assert victim.proc.wait(timeout=20) == -signal.SIGTERM  # stopped by the front
    assert {replicas.pick().index for _ in range(4)} == {0}
    flags[0].write_text("out of memory")
    _until(lambda: replicas.status() == (503, "failed"))


def test_a_refused_connection_goes_to_another_replica_and_a_cut_event_ends_before_the_error(
        fakes):
    from starlette.testclient import TestClient

    replicas, _ = fakes
    live = replicas.replicas[0]
    refusing = Replica(2, [], {}, _free_port(), state="ready")  # its process runs, its port is shut
    replicas.replicas.append(refusing)
    with TestClient(create_front(replicas), base_url="http://127.0.0.1") as client:
        for _ in range(4):  # each refused connection retried on the live replica
            reply = client.post("/v1/completions", json={"prompt": [1, 2, 3]})
            assert reply.status_code == 200 and reply.json() == {"replica_port": live.port}
        assert refusing.routed == refusing.in_flight == refusing.pending == 0
        assert live.in_flight == live.pending == 0 and live.routed >= 2
        # a stream cut in the middle of an event: that event ends before the error's
        with client.stream("POST", "/v1/completions",
                           json={"prompt": [1, 2, 3], "stream": True}) as reply:
            text = reply.read().decode()
        events = [e for e in text.split("\n\n") if e]
        assert events[0] == 'data: {"n": 1}' and events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert re.match(r"the connection to replica \d broke while serving this request",
                        error["message"]) and error["type"] == "server_error"
        assert all(r.in_flight == r.pending == 0 for r in replicas.replicas)
        # no replica takes it: 503 with OpenAI's error body
        replicas.replicas[:] = [refusing]
        reply = client.post("/v1/completions", json={"prompt": [1, 2, 3]})
        assert reply.status_code == 503 and reply.json()["error"]["type"] == "server_error"
        assert "no replica is ready" in reply.json()["error"]["message"]


def test_a_dead_replicas_gauges_leave_the_fronts_sums(fakes):
    from starlette.testclient import TestClient

    replicas, flags = fakes
    with TestClient(create_front(replicas), base_url="http://127.0.0.1") as client:
        s = _samples(client.get("/metrics").text)
        assert s["fake_slots_in_use"] == 6 and s["fake_requests_total"] == 14
        flags[1].write_text("failed")
        _until(lambda: replicas.replicas[1].state == "dead")
        s = _samples(client.get("/metrics").text)
        assert s["fake_slots_in_use"] == 3 and 'fake_slots_in_use{replica="1"}' not in s
        assert s["fake_requests_total"] == 14  # its counter as it last was
        assert s['minikv_replica_up{replica="1"}'] == 0
        assert s['minikv_replica_dead{replica="1"}'] == 1
        info = client.get("/info")  # a replica's /info that is no JSON: a 502 in OpenAI's shape
        assert info.status_code == 502 and info.json()["error"]["message"] == (
            "replica 0's /info gave no JSON object")


def test_affinity_holds_while_its_replica_has_a_free_slot_or_is_least_loaded():
    replicas = Replicas([Replica(i, [], {}, 0) for i in range(3)], slots=2)
    for r in replicas.replicas:
        r.state = "ready"
    busy = replicas.replicas[1]
    busy.in_flight = 1                                   # a free slot left: affinity holds
    assert replicas.pick(prefer=1) is busy and (busy.affine, replicas.yielded) == (1, 0)
    busy.in_flight = 2                                   # full, others less loaded: by load
    assert replicas.pick(prefer=1).index in (0, 2) and replicas.yielded == 1
    for r in replicas.replicas:
        r.in_flight = 3 if r is busy else 2              # all full, it the busiest: by load
    assert replicas.pick(prefer=1).index in (0, 2) and replicas.yielded == 2
    busy.in_flight = 2                                   # all full, none less loaded: holds
    assert replicas.pick(prefer=1) is busy and busy.affine == 2
    busy.state = "dead"                                  # its replica gone: by load, and
    assert replicas.pick(prefer=1).index in (0, 2) and replicas.yielded == 2  # not a yield
    assert replicas.pick().index in (0, 2) and busy.affine == 2  # no preference: by load


def _scope_and_hashes(path: str, body: dict):
    scope, route = route_of(path, body)
    return scope, hashes_of(route)


def _remember(affinity: Affinity, path: str, body: dict, replica: int) -> None:
    scope, hashes = _scope_and_hashes(path, body)
    affinity.remember_last(scope, len(hashes), int(hashes[-1]), replica)


def test_affinity_keys_on_the_scope_and_the_longest_remembered_start():
    """A conversation's route text starts with its earlier turns'; a prompt's with the prompts
    it extends (text, or token ids); another salt or budget is another scope; no reuse, no
    route; the LRU keeps ``max_entries`` and forgets a dead replica's entries."""
    chat = "/v1/chat/completions"
    turn1 = {"messages": CONVERSATION[:1]}
    turn2 = {"messages": CONVERSATION[:3]}
    affinity = Affinity(max_entries=3)
    _remember(affinity, chat, turn1, 1)
    assert affinity.lookup(*_scope_and_hashes(chat, turn2)) == 1
    salted = {**turn2, "minikv": {"cache_salt": "tenant-b"}}
    assert affinity.lookup(*_scope_and_hashes(chat, salted)) is None
    budget = {**turn2, "minikv": {"heavy_budget": 0.1}}
    assert affinity.lookup(*_scope_and_hashes(chat, budget)) is None
    assert route_of(chat, {**turn2, "minikv": NO_REUSE}) is None
    assert route_of(chat, {"messages": "w1"}) is None and route_of(chat, [1]) is None
    # another first message is another conversation; a longer first message too (its
    # template's end-of-turn comes later: not a token prefix either)
    other = {"messages": [{"role": "user", "content": "w9 w9"}] + CONVERSATION[1:3]}
    assert affinity.lookup(*_scope_and_hashes(chat, other)) is None
    longer = {"messages": [{"role": "user", "content": CONVERSATION[0]["content"] + " w1"}]}
    assert affinity.lookup(*_scope_and_hashes(chat, longer)) is None
    # completions: the longest remembered start wins; ids and text are apart
    done = "/v1/completions"
    _remember(affinity, done, {"prompt": "w1 w2"}, 0)
    _remember(affinity, done, {"prompt": "w1 w2 w3"}, 2)
    assert affinity.lookup(*_scope_and_hashes(done, {"prompt": "w1 w2 w3 w4"})) == 2
    assert affinity.lookup(*_scope_and_hashes(done, {"prompt": "w1 w2 w4"})) == 0
    assert affinity.lookup(*_scope_and_hashes(done, {"prompt": [5, 6, 7]})) is None
    assert len(affinity) == 3
    _remember(affinity, done, {"prompt": [5, 6]}, 1)  # 4 > 3: LRU out
    assert len(affinity) == 3
    assert affinity.lookup(*_scope_and_hashes(done, {"prompt": [5, 6, 7]})) == 1
    assert affinity.lookup(*_scope_and_hashes(chat, turn2)) is None  # turn1's, least recent
    affinity.forget_replica(2)
    assert affinity.lookup(*_scope_and_hashes(done, {"prompt": "w1 w2 w3 w4"})) == 0
    assert len(affinity) == 2
    # what the front keeps of a routed request: its length and last hash, as remember_last takes
    # and the replica and length of the longest remembered start ("w1 w2", on replica 0)
    key, match = affinity.find(*route_of(done, {"prompt": "w1 w2 w3 w4"}))
    assert match == (0, len("w1 w2"))
    assert key == (len("w1 w2 w3 w4"), int(hashes_of("w1 w2 w3 w4")[-1]))
    affinity.remember_last(route_of(done, {"prompt": "w7"})[0], *affinity.find(
        *route_of(done, {"prompt": "w7"}))[0], 1)
    assert affinity.lookup(*_scope_and_hashes(done, {"prompt": "w7 w8"})) == 1
    # a route longer than MAX_ROUTE is routed by load alone (its hashes cost the front memory)
    assert route_of(done, {"prompt": "w" * MAX_ROUTE}) is not None
    assert route_of(done, {"prompt": "w" * (MAX_ROUTE + 1)}) is None
    assert route_of(done, {"prompt": [7] * (MAX_ROUTE + 1)}) is None


def test_the_fronts_body_limit_is_its_flag_else_the_replicas_and_none_before_them():
    """In process (no replica is reached: every answer comes before the body is read)."""
    from starlette.testclient import TestClient

    replicas = Replicas([Replica(i, [], {}, 0) for i in range(2)])
    big = {"prompt": "w1 " * 1000}  # ~3 kB
    with TestClient(create_front(replicas)) as c:
        r = c.post("/v1/completions", json=big)            # every replica still starting
        assert r.status_code == 503 and "no replica is ready" in r.json()["error"]["message"]
        replicas.replicas[0].state, replicas.replicas[0].max_body_bytes = "ready", 2048
        r = c.post("/v1/completions", json=big)
        assert r.status_code == 413 and "expected at most 2048 bytes" in r.text
        replicas.replicas[0].max_body_bytes = None        # a replica that gives none
        assert replicas.max_body_bytes() == FALLBACK_BODY_BYTES
    with TestClient(create_front(replicas, ServeOptions(max_body_bytes=1024))) as c:
        r = c.post("/v1/completions", json=big)
        assert r.status_code == 413 and "expected at most 1024 bytes" in r.text


def test_each_replica_process_gets_its_share_of_the_cores(monkeypatch):
    """Torch's default, a thread per core in every process, makes the replicas' OpenMP threads
    wait on each other (GPU replicas too: recall's host copies); torchrun's ranks take the value
    given (its own default would be 1); an explicit setting is kept."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)), raising=False)
    gpus = ["0", "1", "2", "3"]
    cuda = replica_commands(["--model", "x"], 4, 1, "cuda", [1, 2, 3, 4], visible=gpus)
    assert [env["OMP_NUM_THREADS"] for _, env in cuda] == ["8"] * 4
    assert [env["CUDA_VISIBLE_DEVICES"] for _, env in cuda] == ["0", "1", "2", "3"]
    tp = replica_commands(["--model", "x"], 2, 2, "cuda", [1, 2], visible=gpus)
    assert [env["OMP_NUM_THREADS"] for _, env in tp] == ["8", "8"]  # 2 x 2 rank processes
    assert "--nproc-per-node" in tp[0][0]
    cpu = replica_commands(["--model", "x"], 3, 1, "cpu", [1, 2, 3])
    assert [env["OMP_NUM_THREADS"] for _, env in cpu] == ["10"] * 3
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    kept_setting = replica_commands(["--model", "x"], 4, 1, "cuda", [1, 2, 3, 4], visible=gpus)
    assert {env["OMP_NUM_THREADS"] for _, env in kept_setting} == {"5"}


def test_the_replicas_serve_plain_http_without_the_fronts_tls_flags():
    argv = ["--model", "m", "--ssl-keyfile", "k.pem", "--ssl-certfile=c.pem", "--port", "1"]
    assert without_tls(argv) == ["--model", "m", "--port", "1"]


# One conversation of three turns, short enough for max_prompt_len 64 with the template.
CONVERSATION = [{"role": "user", "content": "w3 w7 w9"}, {"role": "assistant", "content": ""},
                {"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": ""},
                {"role": "user", "content": "w8 w2"}]


def _chat(client, messages, salt=None, max_tokens=4) -> httpx.Response:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
    if salt is not None:
        body["minikv"] = {"cache_salt": salt}
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    return reply


def test_a_conversation_follows_its_first_turn_and_hits_the_prefix_cache(client):
    """Each turn (the earlier turns, their answers, a new message) goes to the replica of the
    first and gets its prompt cached: without affinity the front's turn-taking would send
    turn 2 to the other, idle replica. The same turn under another cache salt inherits
    nothing; an unrelated request sent while another streams goes to the other replica."""
    affine = lambda: {k: v for k, v in _samples(client.get("/metrics").text).items()  # noqa
                      if k.startswith("minikv_replica_affine_total")}
    before = affine()
    messages, replicas, cached = [CONVERSATION[0]], [], []
    for turn in range(3):
        reply = _chat(client, messages)
        out = reply.json()
        replicas.append(reply.headers["x-minikv-replica"])
        cached.append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
        if turn < 2:
            messages = messages + [{"role": "assistant",
                                    "content": out["choices"][0]["message"]["content"]},
                                   CONVERSATION[2 * turn + 2]]
    assert len(set(replicas)) == 1, replicas
    assert cached[0] == 0 and all(c > 0 for c in cached[1:]) and cached[2] > cached[1], cached
    after = affine()
    key = f'minikv_replica_affine_total{{replica="{replicas[0]}"}}'
    assert after[key] - before[key] == 2 and sum(after.values()) - sum(before.values()) == 2
    # the last turn again under another salt: no affinity (routed by load), nothing cached
    salted = _chat(client, messages, salt="tenant-b").json()
    assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert affine() == after
    # unrelated requests (prefix reuse on): one sent while another streams goes by load
    out, started = {}, threading.Event()
    streaming = threading.Thread(target=_stream, args=(client, out, started,
                                                       _body("w40 w41 w42", 100, {})))
    streaming.start()
    assert started.wait(120), "no first chunk"
    other = _chat(client, [{"role": "user", "content": "w43 w44"}])
    streaming.join(timeout=300)
    assert other.headers["x-minikv-replica"] != out["replica"] and out["events"][-1] == "[DONE]"
    assert affine() == after


def test_the_front_is_the_door(front, client):
    """The front's own TLS, API key, Host check, CORS and body limit (the replicas' default:
    413 before the body is read), in front of replicas that serve plain HTTP on loopback."""
    with pytest.raises(httpx.TransportError):  # plain HTTP to the front's TLS port
        httpx.get(f"http://127.0.0.1:{front.port}/health", timeout=5)
    for r in client.get("/health").json()["replicas"]:
        assert httpx.get(f"http://127.0.0.1:{r['port']}/health", timeout=5).status_code == 200
    anon = httpx.post(front.url + "/v1/completions", json={"prompt": PROMPT}, verify=front.verify,
                      timeout=30)
    assert anon.status_code == 401 and "--api-key" in anon.json()["error"]["message"]
    assert client.get("/v1/models", headers={"Host": "other.test"}).status_code == 400
    preflight = client.options("/v1/completions", headers={
        "Origin": GOOD_ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == GOOD_ORIGIN
    r = client.post("/v1/completions", headers={"Origin": GOOD_ORIGIN},
                    json={"prompt": PROMPT, "max_tokens": 2, "minikv": NO_REUSE})
    assert r.status_code == 200
    assert r.headers.get_list("access-control-allow-origin") == [GOOD_ORIGIN]
    evil = client.post("/v1/completions", headers={"Origin": "http://evil.example"},
                       json={"prompt": PROMPT, "max_tokens": 2})
    assert evil.status_code == 403 and "--allowed-origins" in evil.text
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}"
            f"\r\nContent-Type: application/json\r\nContent-Length: 50000000\r\n\r\n").encode()
    t0 = time.monotonic()
    sock = front.verify.wrap_socket(socket.create_connection(("127.0.0.1", front.port), 10),
                                    server_hostname="127.0.0.1")
    sock.sendall(head + b'{"prompt": "' + b"w1 " * 300)
    got, closed = _read_until_closed(sock, t0 + 5)
    sock.close()
    assert got.startswith(b"HTTP/1.1 413 ") and closed is not None and closed - t0 < 1.0, got
    assert f"expected at most {LIMIT} bytes (--max-body-bytes)".encode() in got

    def chunks():  # no Content-Length: counted as it comes
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"w1 " * 1000
    r = client.post("/v1/completions", content=chunks(),
                    headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["message"].endswith("got more")
    assert _complete(client, 4).status_code == 200


def _body(prompt: str, max_tokens: int, minikv: dict = NO_REUSE) -> dict:
    """A streamed completion's body."""
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "minikv": minikv}


def _text(events: list) -> str:
    """The text of a streamed completion's events."""
    return "".join(c["choices"][0]["text"] for c in map(json.loads, events[:-1])
                   if c["choices"])


def _stream(client, out: dict, started: threading.Event, body: dict) -> None:
    """A streamed request: its replica, its text chunks and its last event, into ``out``."""
    with client.stream("POST", "/v1/completions", json=body) as reply:
        out["replica"] = reply.headers["x-minikv-replica"]
        out["events"] = []
        for line in reply.iter_lines():
            if line.startswith("data: "):
                out["events"].append(line[6:])
                started.set()


def test_a_replica_killed_mid_stream_fails_its_own_request_and_the_front_serves_on(client):
    health = client.get("/health").json()
    pids = {str(r["replica"]): r["pid"] for r in health["replicas"]}
    outs, threads = [{}, {}], []
    for out in outs:
        started = threading.Event()
        threads.append(threading.Thread(target=_stream, args=(client, out, started,
                                                              _body(PROMPT, STREAMED))))
        threads[-1].start()
        assert started.wait(120), "no first chunk"
    assert sorted(o["replica"] for o in outs) == ["0", "1"]  # one stream on each replica
    # a stream that has begun counts no prompt tokens ahead of its replica, while in flight
    streaming = [r for r in client.get("/health").json()["replicas"] if r["in_flight"]]
    assert streaming and all(r["pending"] == 0 for r in streaming), streaming
    victim = outs[1]["replica"]  # the later stream: the most tokens left when killed
    os.kill(pids[victim], signal.SIGKILL)
    for t in threads:
        t.join(timeout=300)
    cut, whole = outs[1]["events"], outs[0]["events"]
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
    health = client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "degraded"
    states = {str(r["replica"]): (r["state"], r["exit_status"]) for r in health.json()["replicas"]}
    assert states[victim] == ("dead", -signal.SIGKILL)
    s = _samples(client.get("/metrics").text)
    assert s[f'minikv_replica_up{{replica="{victim}"}}'] == 0
    assert s[f'minikv_replica_dead{{replica="{victim}"}}'] == 1
    assert s[f'minikv_replica_failed_total{{replica="{victim}"}}'] == 1
    for _ in range(3):
        reply = _complete(client, 20)
        assert reply.status_code == 200 and reply.headers["x-minikv-replica"] != victim
