"""Automatic prefix reuse in the server: the real process on a loopback port (the tiny Llama and
word-level tokenizer of tests/test_serve.py), one server shared by the module's tests, and one
restart over its --prefix-cache-dir.

Every hit is compared with the Python API's cache path on the same saved model and config:
``cache_prompt(context)`` then ``generate(prompt, past_key_values=cache)`` for a context kept as
a prompt, and ``generate(..., return_dict_in_generate=True).past_key_values`` for a chat turn's
prompt and answer. ``kept_floor=1`` and a ring of 16 tokens: the contexts here (30-60 tokens) are
compressed (evicted from and quantized), so a context of other budgets holds other tokens.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from transformers import AutoModelForCausalLM  # noqa: E402

from minikv_compile import minikv_compile  # noqa: E402
from minikv_compile.graphs.runtime import Request  # noqa: E402
from minikv_compile.prefix_pool import PrefixPool, snapshot_bytes  # noqa: E402
from configs import snapkv  # noqa: E402
from test_serve import Reference as ServeReference  # noqa: E402
from test_serve import Server, metrics, model_dir, wait_for  # noqa: E402,F401 (a fixture)

FLAGS = dict(max_batch_size=2, max_prompt_len=96, max_new_tokens=64, residual_length=16,
             kept_floor=1)
WORDS = [f"w{i}" for i in range(58)]


def words(seed: int, n: int) -> str:
    g = torch.Generator().manual_seed(seed)
    return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (n,), generator=g).tolist())


class Reference(ServeReference):
    """The Python API on the same saved model and this module's config."""

    def __init__(self, model_dir: Path):
        super().__init__(model_dir, FLAGS)

    def text(self, prompt: list, tokens: list) -> str:
        decode = lambda t: self.tok.decode(t, skip_special_tokens=True)  # noqa: E731
        return decode(prompt + tokens)[len(decode(prompt)):]

    def context_bytes(self, n: int) -> int:
        """The pool's bytes of a context of ``n`` tokens."""
        cache = self.engine.cache_prompt([self.ids(words(999, n))])
        return snapshot_bytes(cache.sequences[0])


@pytest.fixture(scope="module")
def ref(model_dir) -> Reference:
    return Reference(model_dir)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix")
    return {"logs": root, "contexts": root / "contexts", "compiled": root / "compiled"}


# Room for two contexts of 40 tokens, not three: the LRU test relies on it.
CONTEXT = 40


@pytest.fixture(scope="module")
def bound(ref) -> int:
    return int(2.5 * ref.context_bytes(CONTEXT))


@pytest.fixture(scope="module")
def server(model_dir, folders, bound):
    srv = Server(model_dir, folders["logs"] / "server.log",
                 args=("--compile-cache", str(folders["compiled"])),
                 prefix_cache_gpu_bytes=bound, prefix_cache_dir=folders["contexts"],
                 preset="snapkv", **FLAGS)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60.0) as c:
        yield c


def complete(client, prompt, max_tokens=8, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def cached(out: dict) -> int:
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


def counters(client) -> dict:
    m = metrics(client)
    return {k: m[f"minikv_prefix_cache_{k}"] for k in (
        "queries_total", "hits_total", "entries", "evictions_total", "disk_loads_total")} | {
        "bytes": m['minikv_prefix_cache_bytes{tier="device"}']}


# -- the tests ---------------------------------------------------------------------------------


def test_a_shared_prefix_hits_with_the_python_apis_tokens(client, ref):
    doc = words(1, CONTEXT)
    ids = ref.ids(doc)
    before = counters(client)
    first = complete(client, doc, max_tokens=4)
    assert cached(first) == 0
    after_first = counters(client)
    assert after_first["queries_total"] - before["queries_total"] == len(ids)
    assert after_first["hits_total"] == before["hits_total"]
    assert after_first["entries"] == before["entries"] + 1

    cache = ref.engine.cache_prompt([ids])
    for seed, question in ((None, " w3 w5 w8"), (7, " w9 w1")):
        prompt = ref.ids(doc + question)
        sampling = {} if seed is None else {"temperature": 0.9, "top_k": 20, "top_p": 0.9,
                                            "seed": seed}
        out = complete(client, doc + question, max_tokens=12, **sampling)
        assert cached(out) == len(ids)
        assert out["usage"]["prompt_tokens"] == len(prompt)
        want = ref.engine.generate([prompt], past_key_values=cache, max_new_tokens=12,
                                   **({"do_sample": False} if seed is None else
                                      {"do_sample": True, "temperature": 0.9, "top_k": 20,
                                       "top_p": 0.9, "seed": seed}))
        assert out["choices"][0]["text"] == ref.text(prompt, want.sequences[0])
    m = counters(client)
    assert m["hits_total"] - after_first["hits_total"] == 2 * len(ids)
    assert m["queries_total"] - after_first["queries_total"] == sum(
        len(ref.ids(doc + q)) for q in (" w3 w5 w8", " w9 w1"))


def test_three_turn_chat_hits_on_turns_two_and_three(client, ref):
    # (a system text whose answers hold no special token: their text gives back their ids)
    messages = [{"role": "system", "content": words(5, 20)}]
    pkv, conversation = None, []
    for turn, question in enumerate((words(3, 5), words(4, 4), words(5, 4))):
        messages.append({"role": "user", "content": question})
        prompt = ref.chat_ids(messages)
        r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 6,
                                                       "temperature": 0})
        assert r.status_code == 200, r.text
        out = r.json()
        want = ref.engine.generate([prompt], past_key_values=pkv, max_new_tokens=6,
                                   do_sample=False, return_dict_in_generate=True)
        new = want.sequences[0, len(prompt):].tolist()
        new = new[: new.index(2) + 1] if 2 in new else new  # cut after the eos (<|im_end|>)
        answer = ref.text(prompt, new)
        assert out["choices"][0]["message"]["content"] == answer
        # turn 1 prefilled whole; turns 2 and 3 from the turn before's prompt and answer
        # (its fed tokens: the answer's last token is chosen, not fed)
        conversation.append(cached(out))
        if turn:
            assert cached(out) == len(pkv.token_ids[0])
        pkv = want.past_key_values
        messages.append({"role": "assistant", "content": answer})
    assert conversation[0] == 0 and all(c > 0 for c in conversation[1:])


def test_opt_out_and_another_salt_miss(client, ref):
    doc = words(6, CONTEXT)
    salted = {"minikv": {"cache_salt": "tenant-a"}}
    assert cached(complete(client, doc, max_tokens=2, **salted)) == 0
    assert cached(complete(client, doc + " w1 w2", **salted)) == len(ref.ids(doc))
    before = counters(client)
    assert cached(complete(client, doc + " w1 w2", minikv={"cache_salt": "tenant-b"})) == 0
    assert cached(complete(client, doc + " w1 w2")) == 0  # no salt: another tenant too
    # opted out: not looked up (no queries counted), and nothing kept
    out = complete(client, doc + " w1 w2", minikv={"cache_salt": "tenant-a",
                                                   "prefix_cache": False})
    assert cached(out) == 0
    m = counters(client)
    assert m["queries_total"] - before["queries_total"] == 2 * len(ref.ids(doc + " w1 w2"))
    assert m["hits_total"] == before["hits_total"]
    # the same salt still hits
    assert cached(complete(client, doc + " w3", **salted)) == len(ref.ids(doc))


def test_other_budgets_never_share_a_context(client, ref, model_dir):
    doc = words(7, CONTEXT)
    half = {"minikv": {"heavy_budget": 0.125, "recent_budget": 0.125}}
    assert cached(complete(client, doc, max_tokens=2, **half)) == 0
    assert cached(complete(client, doc + " w4", max_tokens=2)) == 0  # the engine's budgets
    out = complete(client, doc + " w4 w5", max_tokens=10, **half)
    assert cached(out) == len(ref.ids(doc))
    # the context it hit holds what those budgets keep
    config = snapkv(**{**FLAGS, "heavy_budget": 0.125, "recent_budget": 0.125})
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    small = minikv_compile(model, config)
    cache = small.cache_prompt([ref.ids(doc)])
    prompt = ref.ids(doc + " w4 w5")
    want = small.generate([prompt], past_key_values=cache, max_new_tokens=10, do_sample=False)
    assert out["choices"][0]["text"] == ref.text(prompt, want.sequences[0])


def test_the_byte_bound_evicts_the_least_recently_used(client, ref, bound):
    a, b, c = (words(s, CONTEXT) for s in (8, 9, 10))
    for doc in (a, b):
        complete(client, doc, max_tokens=1)
    # a prompt equal to a context: admitted from it (its last logits), nothing new kept;
    # a is now the most recently used
    assert cached(complete(client, a, max_tokens=1)) == len(ref.ids(a))
    before = counters(client)
    complete(client, c, max_tokens=1)  # room for two: b goes
    m = counters(client)
    assert m["evictions_total"] == before["evictions_total"] + 1
    assert 0 < m["bytes"] <= bound
    # a is resident; b comes back from the disk (--prefix-cache-dir), not from the pool
    assert cached(complete(client, a + " w2", max_tokens=1)) == len(ref.ids(a))
    assert counters(client)["disk_loads_total"] == m["disk_loads_total"]
    assert cached(complete(client, b + " w2", max_tokens=1)) == len(ref.ids(b))
    assert counters(client)["disk_loads_total"] == m["disk_loads_total"] + 1


def test_an_evicted_context_leaves_its_admitted_request_alone(ref):
    """A request admitted from a context holds a copy in its slot: the pool may evict the
    context and its memory be reused while the request decodes (here overwritten)."""
    engine, rt = ref.engine, ref.engine.runtime
    doc, prompt = ref.ids(words(11, CONTEXT)), ref.ids(words(11, CONTEXT) + " w5 w6")
    cache = engine.cache_prompt([doc])
    want = engine.generate([prompt], past_key_values=cache, max_new_tokens=20, do_sample=False,
                           eos_token_id=[]).sequences[0]
    pool = PrefixPool(snapshot_bytes(cache.sequences[0]))
    pool.add("s", engine.cache_prompt([doc]).sequences[0])
    other = engine.cache_prompt([ref.ids(words(12, CONTEXT))]).sequences[0]
    snap = pool.lookup("s", prompt)
    rt.admit(0, Request(prompt, 20, prefix=snap))
    try:
        pool.add("s", other)
        assert pool.evictions == 1 and pool.lookup("s", prompt) is None
        for layer in snap.layers:  # the evicted context's memory, reused
            for t in layer.values():
                t.zero_() if t.dtype in (torch.uint8, torch.int32) else t.fill_(float("nan"))
        for _ in range(19):
            rt.step()
        assert rt.outputs([0])[0] == want
    finally:
        rt.release_all()


def test_bad_minikv_fields_are_400(client):
    for field, value, param in (("prefix_cache", "no", "minikv.prefix_cache"),
                                ("cache_salt", "", "minikv.cache_salt"),
                                ("cache_salt", 5, "minikv.cache_salt"),
                                ("prefix", True, "minikv")):
        r = client.post("/v1/completions", json={"prompt": "w1", "max_tokens": 1,
                                                 "minikv": {field: value}})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param


def test_a_restart_hits_from_the_contexts_folder(model_dir, folders, ref, bound, client):
    doc = words(13, CONTEXT)
    saved = len(list(folders["contexts"].glob("*.safetensors")))
    complete(client, doc, max_tokens=1)  # kept, and saved to the folder (by a writer thread)
    assert wait_for(lambda: len(list(folders["contexts"].glob("*.safetensors"))) > saved)
    again = Server(model_dir, folders["logs"] / "restart.log",
                   args=("--compile-cache", str(folders["compiled"])),
                   prefix_cache_gpu_bytes=bound, prefix_cache_dir=folders["contexts"],
                   preset="snapkv", **FLAGS)
    try:
        with httpx.Client(base_url=again.url, timeout=60.0) as fresh:
            prompt = ref.ids(doc + " w7 w8")
            out = complete(fresh, doc + " w7 w8", max_tokens=10)
            assert cached(out) == len(ref.ids(doc))
            m = counters(fresh)
            assert m["disk_loads_total"] == 1 and m["hits_total"] == len(ref.ids(doc))
            cache = ref.engine.cache_prompt([ref.ids(doc)])
            want = ref.engine.generate([prompt], past_key_values=cache, max_new_tokens=10,
                                       do_sample=False)
            assert out["choices"][0]["text"] == ref.text(prompt, want.sequences[0])
    finally:
        again.stop()


def test_flags_are_checked(model_dir, folders, capsys):
    from minikv_compile.serve.cli import main
    for argv, message in (
            (["--prefix-cache-gpu-bytes", "-1"], "--prefix-cache-gpu-bytes: expected"),
            (["--prefix-cache-host-bytes", "5"], "host_bytes: expected 0 while gpu_bytes is 0"),
            (["--prefix-cache-dir", str(folders["contexts"])],
             "prefix_cache_dir: expected none while prefix_cache_gpu_bytes is 0")):
        with pytest.raises(SystemExit):
            main(["--model", str(model_dir), "--device", "cpu", *argv])
        assert message in capsys.readouterr().err


def test_start_up_refuses_a_pool_that_does_not_fit(ref, monkeypatch):
    """warm_up holds the pool's bytes and a slot's share more beside the longest prefill; out
    of memory there names the flag (the allocation failing stands in for a full GPU)."""
    from minikv_compile import scheduler as S

    held = []

    def empty(n, **kwargs):
        held.append(n)
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    sched = S.Scheduler(ref.engine, ref.tok, prefix_cache_gpu_bytes=10**6)
    monkeypatch.setattr(S.torch, "empty", empty)
    with pytest.raises(RuntimeError, match="prefix_cache_gpu_bytes: expected room for 1000000"):
        sched.warm_up()
    share = ref.engine.kv_memory().allocated_bytes // FLAGS["max_batch_size"]
    assert held == [10**6 + share + 4 * ref.engine.adapter.vocab_size]
    assert not sched.ready and not ref.engine.runtime.admitted


def test_a_chat_cut_by_a_stop_string_keeps_no_context(client, ref):
    messages = [{"role": "system", "content": words(14, 20)},
                {"role": "user", "content": words(15, 5)}]
    prompt = ref.chat_ids(messages)
    want = ref.engine.generate([prompt], max_new_tokens=6, do_sample=False).sequences[0]
    stop = ref.text(prompt, want).split()[0]  # the answer's first word
    body = {"messages": messages, "max_tokens": 6, "temperature": 0}
    before = counters(client)
    r = client.post("/v1/chat/completions", json={**body, "stop": stop})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop"
    kept = lambda m: m["entries"] + m["evictions_total"]  # noqa: E731  (an add may evict)
    assert kept(counters(client)) == kept(before)
    r = client.post("/v1/chat/completions", json=body)  # the same without the stop: kept
    assert r.status_code == 200 and kept(counters(client)) == kept(before) + 1


def test_warm_up_runs_the_tail_at_every_chunk_length(ref):
    """The first tail chunk of each length launches its kernels' variants for the first time
    (the first hits of the H200 benchmark took 1.5-3 s): warm_up runs every length, 1 .. R (the
    ring's length), then leaves every slot free."""
    from minikv_compile import scheduler as S

    rt = ref.engine.runtime
    sched = S.Scheduler(ref.engine, ref.tok, prefix_cache_gpu_bytes=10**6)
    rt.tail.chunk_lengths.clear()
    sched.warm_up()
    assert rt.tail.longest_chunk == FLAGS["residual_length"]
    assert rt.tail.chunk_lengths == set(range(1, FLAGS["residual_length"] + 1))
    assert sched.ready and not rt.admitted and len(rt.free_slots()) == FLAGS["max_batch_size"]


def test_a_tails_pieces_are_timed_as_chunks_through_every_layer(ref):
    """The prefill clock's pieces: a whole prefill's is a layer of its prompts (``"layer"``,
    their tokens), a hit's a chunk of at most R tokens through every layer (``"chunk"``),
    whatever the cached context's length."""
    from types import SimpleNamespace as H

    from minikv_compile import scheduler as S

    sched = S.Scheduler(ref.engine, ref.tok, prefix_cache_gpu_bytes=10**6)
    R = FLAGS["residual_length"]
    assert sched._piece_tokens([H(prompt_tokens=90, cached_tokens=0),
                                H(prompt_tokens=7, cached_tokens=0)]) == (97, "layer")
    assert sched._piece_tokens([H(prompt_tokens=90, cached_tokens=85)]) == (5, "chunk")
    assert sched._piece_tokens([H(prompt_tokens=90, cached_tokens=40)]) == (R, "chunk")
    assert sched._piece_tokens([H(prompt_tokens=90, cached_tokens=90)]) == (1, "chunk")


def test_a_hit_is_admitted_alone_and_looked_up_once(ref):
    """A hit's pieces are tail chunks, timed apart from prefill layers: it is never batched
    with whole prefills. Behind one, it waits for the next admission, looked up once."""
    from minikv_compile import scheduler as S

    sched = S.Scheduler(ref.engine, ref.tok, prefix_cache_gpu_bytes=10**7)
    doc = ref.ids(words(21, CONTEXT))
    first = S.ServeRequest(ref.ids(words(22, 10)), 4)
    hit = S.ServeRequest(ref.ids(words(21, CONTEXT) + " w5 w6"), 4)
    after = S.ServeRequest(ref.ids(words(23, 12)), 4)
    assert hit.prompt_ids[: len(doc)] == doc
    sched.pool.add(sched._scope(hit), ref.engine.cache_prompt([doc]).sequences[0])
    handles = [sched.submit(r) for r in (first, hit, after)]
    try:
        admitted = []
        while any(h.finish_reason is None for h in handles):
            if sched._admitting is None and sched._start_admission():
                admitted.append([handles.index(h) for h in sched._admitting[1]])
            sched._admit_piece()
            sched._step()
        assert admitted == [[0], [1], [2]]  # the hit alone; the request after it not with it
        assert handles[1].cached_tokens == len(doc) and handles[0].cached_tokens == 0
        assert sched.prefix_queries == sum(len(r.prompt_ids) for r in (first, hit, after))
        assert sched.prefix_hits == len(doc)
    finally:
        sched.shutdown()
        ref.engine.runtime.release_all()


@pytest.mark.parametrize("keep", ["prompt", "conversation"])
def test_a_context_that_cannot_be_kept_leaves_its_request_whole(ref, monkeypatch, keep):
    """Keeping a context (at admission, or at the end of a chat's answer) copies the slot: out
    of memory there keeps nothing, counted, and the requests end as they would (before, the
    request was never ended and the loop failed every other one)."""
    from minikv_compile import scheduler as S

    sched = S.Scheduler(ref.engine, ref.tok, prefix_cache_gpu_bytes=10**7)

    def no_room(slot):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(ref.engine.runtime, "snapshot", no_room)
    prompts = [ref.ids(words(31, 20)), ref.ids(words(32, 12))]
    requests = [S.ServeRequest(prompts[0], 4, keep=keep), S.ServeRequest(prompts[1], 4)]
    want = [ref.engine.generate([p], max_new_tokens=4, do_sample=False).sequences[0]
            for p in prompts]
    handles = [sched.submit(r) for r in requests]
    try:
        for _ in range(200):
            if all(h.finish_reason is not None for h in handles):
                break
            if sched._admitting is None:
                sched._start_admission()
            sched._admit_piece()
            sched._step()
        assert [h.result() for h in handles] == [(ref.text(p, w), "length")
                                                 for p, w in zip(prompts, want)]
        assert sched.metrics.keep_failures == 2 and len(sched.pool) == 0  # (each keeps one)
        assert sched.failure is None
    finally:
        sched.shutdown()
        ref.engine.runtime.release_all()
