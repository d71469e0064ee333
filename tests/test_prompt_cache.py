"""Prompt caches (issue 46): ``cache_prompt``, ``generate(..., past_key_values=cache)``, the
multi-turn cache of ``return_dict_in_generate``, ``save`` / ``load_prompt_cache``, and every
refusal. CPU, fp32, tiny random models (eager: these tests are about the cache, not the
compile); one engine per configuration for the module.

The 16-bit cache with nothing evicted is checked against HF's greedy tokens on the whole prompt;
the compressed ones against the engine's decode path (the tail's tokens join the cache as
generated tokens do, so teacher-forcing them through decode steps gives the same
log-probabilities), and their uses against each other.
"""
from __future__ import annotations

import copy
import io
import json
import os
import stat
import struct
import tempfile

import pytest
import torch
from safetensors import safe_open

from minikv_compile import MiniKVConfig, PromptCache, minikv_compile
from minikv_compile import prompt_cache as pc
from minikv_compile.perf.__main__ import main
from configs import snapkv
from test_engine import FULL, hf_greedy, prompt_of, tiny

# ring 32 (two groups of 16): docs and tails longer than it cross flushes
RING = dict(residual_length=32, max_prompt_len=224, max_new_tokens=16)
# the compressed engines teacher-force tails and answers through decode steps (80 tokens)
LONG = dict(max_prompt_len=224, max_new_tokens=80)
# the compressed configs evict from prompts of any length (a floor of kept tokens, where the
# config has one, would keep these short prompts whole)
EVICT = {"kept_floor": 1} if "kept_floor" in MiniKVConfig.__dataclass_fields__ else {}
DOC, QUESTION = prompt_of(90, 1), prompt_of(45, 2)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return tiny()


@pytest.fixture(scope="module")
def full(model):
    return minikv_compile(model, snapkv(**FULL, **RING, max_batch_size=2))


@pytest.fixture(scope="module")
def minikv(model):
    """The library default at 2 bits, evicting half of the prompt."""
    return minikv_compile(model, snapkv(residual_length=32, **LONG, **EVICT))


@pytest.fixture(scope="module")
def rotated(model):
    """KIVI-2 at group 64 with the Hadamard rotation."""
    return minikv_compile(model, snapkv(bits=2, group_size=64, rotation="hadamard",
                                              heavy_budget=1.0, recent_budget=1.0,
                                              residual_length=64, **LONG))


@pytest.fixture(scope="module")
def accurate(model):
    """The 'accurate' preset: the same with SpeCache's recall (the host copy)."""
    return minikv_compile(model, MiniKVConfig.preset("accurate", residual_length=64, **LONG))


def _tensors(cache: PromptCache) -> dict:
    return {f"{i}.{k}": t.clone() for i, s in enumerate(cache.sequences)
            for k, t in s.tensors().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_bits16_continuation_gives_hf_greedy_tokens(model, full, tmp_path):
    cache = full.cache_prompt([DOC])
    assert cache.token_ids == [DOC] and cache.lengths == [90] and len(cache) == 1
    before = _tensors(cache)
    want = hf_greedy(model, DOC + QUESTION, 16)
    got = full.generate([DOC + QUESTION], past_key_values=cache, max_new_tokens=16)
    assert got.sequences[0] == want
    # asked again: the cache did not change by use, the answer neither
    assert _same(_tensors(cache), before)
    assert full.generate([DOC + QUESTION], past_key_values=cache,
                         max_new_tokens=16).sequences[0] == want
    # a prompt equal to the cached tokens: the first token from the stored logits; one token
    # after them: a chunk of one row
    assert full.generate([DOC], past_key_values=cache, max_new_tokens=16
                         ).sequences[0] == hf_greedy(model, DOC, 16)
    assert full.generate([DOC + QUESTION[:1]], past_key_values=cache, max_new_tokens=16
                         ).sequences[0] == hf_greedy(model, DOC + QUESTION[:1], 16)
    # saved and loaded: the same tensors, the same tokens
    path = tmp_path / "doc.safetensors"
    cache.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["doc.safetensors"]  # no temporary left
    loaded = full.load_prompt_cache(path)
    assert _same(_tensors(loaded), before) and loaded.token_ids == [DOC]
    assert full.generate([DOC + QUESTION], past_key_values=loaded,
                         max_new_tokens=16).sequences[0] == want


def test_bits16_batch_of_two(model, full):
    # a tail crossing the ring's flushes beside an empty one (the stored logits)
    docs, tails = [DOC, prompt_of(60, 7)], [QUESTION, []]
    cache = full.cache_prompt(docs)
    out = full.generate([d + t for d, t in zip(docs, tails)], past_key_values=cache,
                        max_new_tokens=10)
    assert out.sequences == [hf_greedy(model, d + t, 10) for d, t in zip(docs, tails)]


def test_multi_turn_equals_a_fresh_run_over_the_conversation(model, full):
    conversation = DOC + QUESTION
    cache = None
    for turn in range(3):
        out = full.generate([conversation], past_key_values=cache, max_new_tokens=12,
                            return_dict_in_generate=True)
        answer = out.sequences[0, len(conversation):].tolist()
        assert answer == hf_greedy(model, conversation, 12), turn
        assert answer == full.generate([conversation], max_new_tokens=12).sequences[0]
        cache = out.past_key_values
        # the prompt and every new token but the last, which is chosen, not fed (as HF's cache)
        assert cache.token_ids == [conversation + answer[:-1]]
        assert full.generate([conversation], max_new_tokens=2, return_dict_in_generate=True,
                             use_cache=False).past_key_values is None
        conversation = conversation + answer + prompt_of(7, 20 + turn)


def _decode_path_logprobs(cm, doc, tail, answer):
    """log p(answer | doc + tail) with the tail teacher-forced through decode steps."""
    return cm.teacher_force([doc], [tail + answer])[0][len(tail):]


@pytest.mark.parametrize("engine", ["minikv", "rotated", "accurate"])
def test_compressed_tail_joins_the_cache_as_decode_steps_do(engine, request, tmp_path):
    cm = request.getfixturevalue(engine)
    cache = cm.cache_prompt([DOC])
    assert cache.nbytes < cache.memory().fp16_bytes  # the fp16 cache of the same tokens
    assert (cache.host_nbytes > 0) == (engine == "accurate")
    before = _tensors(cache)
    answer = cm.generate([DOC + QUESTION], past_key_values=cache, max_new_tokens=12).sequences[0]
    # reuse, and save / load, give identical tokens; the cache is not changed by use
    assert cm.generate([DOC + QUESTION], past_key_values=cache,
                       max_new_tokens=12).sequences[0] == answer
    assert _same(_tensors(cache), before)
    cache.save(tmp_path / "c.safetensors")
    loaded = cm.load_prompt_cache(tmp_path / "c.safetensors")
    assert _same(_tensors(loaded), before)
    assert cm.generate([DOC + QUESTION], past_key_values=loaded,
                       max_new_tokens=12).sequences[0] == answer
    if engine == "accurate":
        return  # the tail ranks its recall per chunk, a decode step by the step before's mass
    # the tail's 45 tokens in chunks (two flushes of the 32-token ring) give the log-probs
    # of the same tokens fed one decode step at a time
    tail_path = cm.teacher_force([DOC + QUESTION], [answer], past_key_values=cache)[0]
    decode_path = _decode_path_logprobs(cm, DOC, QUESTION, answer)
    torch.testing.assert_close(tail_path, decode_path, rtol=1e-4, atol=1e-4)
    # and a multi-turn cache continues as the conversation fed through decode steps
    out = cm.generate([DOC + QUESTION], past_key_values=cache, max_new_tokens=12,
                      return_dict_in_generate=True)
    turn = prompt_of(9, 30)
    conversation = DOC + QUESTION + answer + turn
    second = cm.generate([conversation], past_key_values=out.past_key_values,
                         max_new_tokens=8).sequences[0]
    got = cm.teacher_force([conversation], [second], past_key_values=out.past_key_values)[0]
    torch.testing.assert_close(
        got, _decode_path_logprobs(cm, DOC, QUESTION + answer + turn, second),
        rtol=1e-4, atol=1e-4)


def _every_position_against_full(model, full):
    """Teacher-forced log-probs of two sequences (a document each, cached, then a tail and an
    answer; slot 1's tail reads slot 1's host rows) through a 2-bit cache whose recall covers
    every quantized position, and through ``full``: (got, want) per sequence."""
    every = minikv_compile(model, snapkv(bits=2, heavy_budget=1.0, recent_budget=1.0,
                                               recall_top_k=256, **RING, max_batch_size=2))
    docs, tails = [DOC, prompt_of(70, 4)], [QUESTION, prompt_of(30, 5)]
    answers = [prompt_of(12, 3), prompt_of(9, 6)]
    prompts = [d + q for d, q in zip(docs, tails)]
    got = every.teacher_force(prompts, answers, past_key_values=every.cache_prompt(docs))
    want = full.teacher_force(prompts, answers, past_key_values=full.cache_prompt(docs))
    return list(zip(got, want))


def test_tail_recalling_every_position_gives_the_full_caches_log_probs(model, full):
    """Recall in the tail prefill: with K covering every quantized position (and so every
    decode step's recall too), a 2-bit cache's tail and answer after a cached document get the
    16-bit cache's log-probabilities: the tail attends to the host rows, not the codes (without
    its recall, these log-probabilities differ by up to 0.21)."""
    for got, want in _every_position_against_full(model, full):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_saved_file_holds_the_metadata_and_only_the_valid_rows(full, minikv, tmp_path):
    cache = minikv.cache_prompt([DOC])
    path = tmp_path / "m.safetensors"
    cache.save(path)
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
        stored = sum(f.get_tensor(k).nbytes for k in f.keys()
                     if k not in ("seq0.tokens", "seq0.logits"))
        assert f.get_tensor("seq0.tokens").tolist() == DOC
    assert json.loads(meta["fingerprint"]) == minikv.fingerprint
    assert json.loads(meta["config"])["bits"] == 2 and json.loads(meta["lengths"]) == [90]
    assert json.loads(meta["versions"])["format"] == 1
    assert stored == cache.nbytes
    # the slot's valid rows, not its capacity: less than one slot's allocation
    slot_bytes = sum(t.nbytes for layer in minikv.runtime.cache.layers for t in layer)
    assert cache.nbytes < slot_bytes // minikv.config.max_batch_size
    report = cache.memory()
    assert report.tokens == 90 and f"{report.ratio:9.4f}" in str(report)


def test_chunked_transfers_move_every_byte(monkeypatch):
    """The staging path of save / load on CUDA (``_write_from_device``, ``_read_to_device``)
    run on the CPU with a chunk smaller than the data (and not dividing it): every byte
    arrives, in order; a file that ends early is refused."""
    monkeypatch.setattr(pc, "STAGING_CHUNK", 1000)
    data = torch.randint(0, 256, (10_007,), dtype=torch.uint8, generator=torch.Generator(
        ).manual_seed(0))
    f = io.BytesIO()
    f.write(b"head")
    pc._write_from_device(f, data)
    assert f.getvalue() == b"head" + data.numpy().tobytes()
    f.seek(4)
    back = torch.zeros_like(data)
    pc._read_to_device(f, back)
    assert torch.equal(back, data) and f.read() == b""
    f.seek(4 + 500)
    with pytest.raises(ValueError, match="truncated"):
        pc._read_to_device(f, torch.zeros_like(data))


def _header(path) -> dict:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


def _rewrite(path, out, edit) -> None:
    """``path``'s file with its header changed by ``edit(header)``, written to ``out``."""
    header = _header(path)
    with open(path, "rb") as f:
        f.seek(8 + struct.unpack("<Q", f.read(8))[0])
        data = f.read()
    edit(header)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    out.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def test_a_cpu_engines_file_loads_anywhere_and_readers_other_than_its_owner_read_it(
        full, tmp_path):
    """The device tensors are written together by name, whatever the engine's device (the CUDA
    loader streams that span to the GPU); the file's mode is the umask's, not owner-only."""
    cache = full.cache_prompt([DOC, QUESTION])  # a batch of two: tokens between the sequences
    path = tmp_path / "two.safetensors"
    mask = os.umask(0o022)
    try:
        cache.save(path)
    finally:
        os.umask(mask)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    entries = {k: v["data_offsets"] for k, v in _header(path).items() if k != "__metadata__"}
    device = sorted(v for k, v in entries.items() if not pc._on_host(k))
    assert all(a[1] == b[0] for a, b in zip(device, device[1:]))  # one span
    assert all(v[0] >= device[-1][1] for k, v in entries.items() if pc._on_host(k))
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_a_damaged_file_is_a_value_error_naming_what(full, tmp_path):
    cache = full.cache_prompt([DOC])
    path, bad = tmp_path / "c.safetensors", tmp_path / "bad.safetensors"
    cache.save(path)

    def meta(key, value):
        return lambda h: h["__metadata__"].__setitem__(key, value)

    def entry(change):
        return lambda h: change(h["seq0.layer0.k_ring"])

    for edit, match in [
            (entry(lambda e: e.__setitem__("shape", [e["shape"][0] + 1, *e["shape"][1:]])),
             r"tensor 'seq0.layer0.k_ring' in a known dtype with a shape whose bytes fit"),
            (entry(lambda e: e.__setitem__("dtype", "I64")), r"'seq0.layer0.k_ring'"),
            (lambda h: h.__setitem__("seq0.layer0.k_ring", [1, 2]), r"'seq0.layer0.k_ring'"),
            (meta("versions", "[1]"), r"path.versions: expected a JSON dict"),
            (meta("lengths", "3"), r"path.lengths: expected a JSON list of token counts"),
            (lambda h: h.__setitem__("__metadata__", [1]), r"path.format: expected"),
            (lambda h: h["seq0.layer1.v_cache"].update(  # its bytes as another dtype
                dtype="F16", shape=[2, 64, 2 * 64]),
             r"path: sequence 0: layer 1's v_cache: expected \(2, 64, 64\) in torch.float32, "
             r"got \(2, 64, 128\) in torch.float16")]:
        _rewrite(path, bad, edit)
        with pytest.raises(ValueError, match=match):
            full.load_prompt_cache(bad)
    assert full.load_prompt_cache(path).token_ids == [DOC]


def test_refusals_name_what_differs_before_any_work(model, full, minikv, tmp_path):
    cache = full.cache_prompt([DOC])
    before = _tensors(cache)

    def refused(match, cm=full, **kw):
        with pytest.raises(ValueError, match=match):
            cm.generate(**{"input_ids": [DOC + QUESTION], "past_key_values": cache,
                           "max_new_tokens": 4, **kw})
        assert not cm.runtime.admitted

    refused(r"input_ids\[0\]: expected to start with the cache's 90 tokens .* position 5",
            input_ids=[DOC[:5] + [(DOC[5] + 1) % 101] + DOC[6:]])
    refused(r"input_ids\[0\]: expected to start .* got 40 tokens", input_ids=[DOC[:40]])
    refused(r"past_key_values: expected one cached sequence per prompt \(2\), got a cache of 1",
            input_ids=[DOC + QUESTION, DOC])
    refused(r"past_key_values.config.bits: expected this engine's 2, got 16", cm=minikv)
    refused(r"past_key_values: expected a minikv_compile.PromptCache", past_key_values=[DOC])
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.model.embed_tokens.weight[0, 0] += 1.0
    with pytest.raises(ValueError, match=r"past_key_values.fingerprint.weights_sha256"):
        minikv_compile(other, full.config).generate([DOC + QUESTION], past_key_values=cache)
    elsewhere = PromptCache(cache.sequences, fingerprint=cache.fingerprint, config=cache.config,
                            device=torch.device("meta"))
    refused(r"past_key_values.device: expected this engine's cpu, got meta",
            past_key_values=elsewhere)
    future = PromptCache(cache.sequences, fingerprint=cache.fingerprint, config=cache.config,
                         device=cache.device, versions={**cache.versions, "format": 99})
    refused(r"past_key_values.versions.format: expected 1, got 99", past_key_values=future)
    # the tail and the new tokens must fit the slot: the evicting engine's slot holds half
    # of its longest prompt and the new tokens (112 + 80), the cached doc 45 of its 90
    small = minikv.cache_prompt([DOC])
    refused(r"input_ids\[0\].prefix: layer 0 holds 45 tokens .* with 150 more .* is 195, "
            r"expected at most the slot's capacity of 192",
            cm=minikv, input_ids=[DOC + prompt_of(134, 9)], max_new_tokens=16,
            past_key_values=small)
    # a multi-turn cache keeps no logits of its last token: something must follow it
    out = full.generate([DOC], max_new_tokens=3, return_dict_in_generate=True)
    with pytest.raises(ValueError, match=r"expected at least one token after the prefix's 92"):
        full.generate([DOC + out.sequences[0, 90:].tolist()[:2]],
                      past_key_values=out.past_key_values, max_new_tokens=2)
    assert _same(_tensors(cache), before)
    # files: another config, not a cache at all
    path = tmp_path / "full.safetensors"
    cache.save(path)
    with pytest.raises(ValueError, match=r"path.config.bits: expected this engine's 2, got 16"):
        minikv.load_prompt_cache(path)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=r"path: expected a safetensors file"):
        full.load_prompt_cache(tmp_path / "junk.safetensors")
    with pytest.raises(ValueError, match=r"path: expected a saved prompt cache file"):
        full.load_prompt_cache(tmp_path / "missing.safetensors")


def test_perf_prompt_cache_runs_tiny(tmp_path):
    """The GPU benchmark's plumbing on the CPU (``--tiny``): every measurement ran and the
    report holds its figures and the target lines."""
    assert main(["prompt-cache", "--tiny", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "prompt-cache.json").read_text())
    rows = {r["measure"]: r for r in data["results"] if r.get("measure")}
    assert {"cache_prompt", "ttft_cached", "ttft_fresh", "chat_cached", "chat_reprefill",
            "save", "load"} <= set(rows)
    assert all(r["status"] == "ok" and r["time_s"] > 0 for r in rows.values())
    assert rows["save"]["file_bytes"] > rows["cache_prompt"]["cache_bytes"] > 0
    assert rows["save"]["efficiency"] > 0 and rows["load"]["disk_read_s"] > 0
    notes = "\n".join(data["notes"])
    for target in ("TTFT cached / fresh", "chat total", "file / fp16 cache", "target save",
                   "target load"):
        assert target in notes
    # the saved caches and the bandwidth files are removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompt-cache.json", "prompt-cache.md"]


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [2, 16])
def test_gpu_tail_path_gives_the_decode_paths_log_probs(bits, monkeypatch):
    """On CUDA (bf16, the compiled and captured decode step, the Triton tail kernel): reuse and
    save / load give identical tokens, and the tail path's log-probabilities are the decode
    path's within bf16's rounding (the tail's K/V come from one GEMM over the chunk, the decode
    path's from one GEMV a token)."""
    model = tiny(dtype=torch.bfloat16, device="cuda")
    budgets = dict(heavy_budget=1.0, recent_budget=1.0) if bits == 16 else EVICT
    cm = minikv_compile(model, snapkv(bits=bits, residual_length=32, **LONG, **budgets))
    cache = cm.cache_prompt([DOC])
    assert cache.device.type == "cuda" and cache.sequences[0].layers[0]["k_ring"].is_cuda
    answer = cm.generate([DOC + QUESTION], past_key_values=cache, max_new_tokens=12).sequences[0]
    assert cm.generate([DOC + QUESTION], past_key_values=cache,
                       max_new_tokens=12).sequences[0] == answer
    # save / load through staging chunks much smaller than the file (the chunked pinned path)
    monkeypatch.setattr(pc, "STAGING_CHUNK", 4096 + 8)
    with tempfile.TemporaryDirectory() as folder:
        cache.save(f"{folder}/c.safetensors")
        assert os.path.getsize(f"{folder}/c.safetensors") > 4 * pc.STAGING_CHUNK
        loaded = cm.load_prompt_cache(f"{folder}/c.safetensors")
    assert _same(_tensors(loaded), _tensors(cache))
    assert cm.generate([DOC + QUESTION], past_key_values=loaded,
                       max_new_tokens=12).sequences[0] == answer
    tail = cm.teacher_force([DOC + QUESTION], [answer], past_key_values=cache)[0]
    decode = _decode_path_logprobs(cm, DOC, QUESTION, answer)
    assert (tail - decode).abs().mean() < 0.05 and (tail - decode).abs().max() < 0.3


@pytest.mark.gpu
def test_gpu_tail_recalling_every_position_gives_the_full_caches_log_probs():
    """On CUDA (bf16, the compiled tail layer with the slot's pinned host rows as inputs, the
    rows stored by ``recall_store_rows`` and gathered back by the next chunk, the tail kernel
    under RECALL): with K covering every quantized position, two sequences' tails and answers
    get the 16-bit cache's log-probabilities within bf16's rounding (the same rule as the tail
    path against the decode path above; without the tail's recall the two sequences are 0.08
    and 0.14 apart on average in fp32 on the CPU, past the mean's bound)."""
    model = tiny(dtype=torch.bfloat16, device="cuda")
    full = minikv_compile(model, snapkv(**FULL, **RING, max_batch_size=2))
    for got, want in _every_position_against_full(model, full):
        diff = (got - want).abs()
        assert diff.mean() < 0.05 and diff.max() < 0.3, diff
