"""SpeCache in the engine (``snapkv(recall_top_k=K)``): the host copy, the two-row step with
pre-decoding, the recall inside the step. CPU, fp32, tiny random models (test_engine's ``tiny``):
a row's arithmetic does not depend on the other rows, so "the same tokens as alone" is exact.

The independent reference for the whole method is HF itself: with K at least every token the
cache holds, every quantized position is recalled in full precision at every step (the step
after a flush too: the flushed ring's tokens are ranked from the step before), so the compressed
cache with recall must give the uncompressed model's greedy tokens exactly.
"""
from __future__ import annotations

import pytest
import torch

from minikv_compile import MiniKVConfig, minikv_compile
from minikv_compile.config import RESYNCS
from minikv_compile.graphs import cache as cache_module
from minikv_compile.graphs.runtime import Request
from minikv_compile.graphs.sampling import Sampling
from configs import snapkv
from test_engine import hf_greedy, prompt_of, tiny

# 2-bit, nothing evicted (KIVI's cache), a 32-token ring: 48 new tokens cross a flush.
KIVI = dict(bits=2, heavy_budget=1.0, recent_budget=1.0, residual_length=32, max_prompt_len=64,
            max_new_tokens=48, max_batch_size=4)
EVERYTHING = 128  # >= T_cap = 64 + 48


@pytest.mark.parametrize("kind,block,bits", [
    ("llama", 1, 2), ("llama", 16, 2), ("qwen3", 1, 2), ("qwen3", 16, 2), ("qwen2", 1, 2),
    ("qwen2", 16, 2), ("llama", 1, 1)])
def test_recalling_every_token_reproduces_hf_greedy(kind, block, bits):
    model = tiny(kind)
    prompts = [prompt_of(37), prompt_of(5, seed=1), prompt_of(64, seed=2)]
    want = [hf_greedy(model, p, 48) for p in prompts]
    kivi = {**KIVI, "bits": bits, "group_size": 16 if bits > 1 else 32}
    plain = minikv_compile(model, snapkv(**kivi)).generate(prompts, max_new_tokens=48)
    assert plain.sequences != want  # the low-bit cache alone does change the tokens here
    cm = minikv_compile(model, snapkv(**kivi, recall_top_k=EVERYTHING, recall_block=block))
    out = cm.generate(prompts, max_new_tokens=48)
    assert out.sequences == want
    # 47 tokens after the first and the pre-decoding step; with everything recalled only the
    # first guess (made on the low-bit cache alone) can miss: the resync's one step more
    assert out.decode_steps in (48, 49)


def test_teacher_forced_log_probs_with_every_token_recalled_are_the_full_caches():
    model = tiny()
    prompt = prompt_of(50, seed=4)
    target = prompt_of(40, seed=5)
    full = minikv_compile(model, snapkv(**{**KIVI, "bits": 16}))
    cm = minikv_compile(model, snapkv(**KIVI, recall_top_k=EVERYTHING))
    got = cm.teacher_force([prompt], [target])[0]
    torch.testing.assert_close(got, full.teacher_force([prompt], [target])[0], rtol=0, atol=1e-4)
    plain = minikv_compile(model, snapkv(**KIVI)).teacher_force([prompt], [target])[0]
    assert (plain - got).abs().max() > 1e-2  # (what recall fixes is visible)


def test_speculation_is_the_next_token_greedy_and_forced():
    """Greedy: after the pre-decoding step the speculation is the token the next step then
    chooses (every token recalled: the two rows are exact). Teacher mode: the forced token
    after the one the next step feeds."""
    cm = minikv_compile(tiny(), snapkv(**KIVI, recall_top_k=EVERYTHING))
    rt, st = cm.runtime, cm.runtime.state
    rt.admit(0, Request(prompt_of(30), 10))
    rt.step()                                        # pre-decoding: nothing recorded
    assert rt.outputs([0])[0] == [int(st.tokens[0])]
    for _ in range(5):
        spec = int(st.spec[0])
        rt.step()
        assert rt.outputs([0])[0][-1] == spec
    rt.release(0)
    forced = prompt_of(10, seed=7)
    rt.admit(0, Request(prompt_of(30), 10, forced=forced))
    for i in range(1, 6):
        rt.step()
        assert int(st.spec[0]) == forced[i]


@pytest.mark.parametrize("resync", [False, True])
def test_a_missed_guess_pre_decodes_the_chosen_token_with_resync(resync):
    """With 4 positions recalled the two rows are not exact and row 1's greedy guesses miss.
    With ``recall_resync="off"`` the step after a miss feeds row 1 the guess made from the wrong
    token; with ``"greedy"`` (the default), that step pre-decodes the chosen token in both rows
    (nothing recorded), and ``generate`` still gives every token asked for, in one step more a
    miss."""
    cm = minikv_compile(tiny(), snapkv(**KIVI, recall_top_k=4,
                                       recall_resync="greedy" if resync else "off"))
    rt, st = cm.runtime, cm.runtime.state
    rt.admit(0, Request(prompt_of(40, seed=3), 40))
    rt.step()                                        # admission's pre-decoding step
    misses = pre_steps = 0
    for _ in range(30):
        fed, guess, pre = int(st.tokens[0]), int(st.spec[0]), bool(st.pre[0])
        count = int(st.count[0])
        rt.step()
        if pre:  # nothing recorded; row 0's argmax is the new guess
            pre_steps += 1
            assert int(st.count[0]) == count and int(st.tokens[0]) == fed
            continue
        chosen = rt.outputs([0])[0][-1]
        if chosen != guess:
            misses += 1
            assert bool(st.pre[0]) == resync
            if resync:
                assert int(st.spec[0]) == chosen == int(st.tokens[0])
    pending = resync and bool(st.pre[0])  # a miss at the last step: its pre-decoding step to come
    assert misses > 0 and pre_steps == (misses - pending if resync else 0)
    rt.release(0)
    prompts = [prompt_of(37), prompt_of(20, seed=1)]
    out = cm.generate(prompts, max_new_tokens=48)
    assert [len(s) for s in out.sequences] == [48, 48]
    assert (out.decode_steps > 48) == resync  # 47 tokens after the first, the admission's step


def test_stopping_criteria_see_each_new_token_once_across_pre_decoding_steps():
    """A missed guess's pre-decoding step adds no token: the criteria are not asked about the
    same sequences twice (one that counts its calls, as a user's may, sees one call a token)."""
    from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

    class Lengths(StoppingCriteria):
        def __init__(self):
            self.seen = []

        def __call__(self, input_ids, scores, **kwargs):
            self.seen.append(input_ids.shape[1])
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    cm = minikv_compile(tiny(), snapkv(**KIVI, recall_top_k=4))  # "greedy": misses pre-decode
    criterion = Lengths()
    out = cm.generate([prompt_of(40, seed=3)], max_new_tokens=40,
                      stopping_criteria=StoppingCriteriaList([criterion]))
    assert out.decode_steps > 40  # some guesses missed (each a pre-decoding step)
    assert len(out.sequences[0]) == 40 and out.stop_reasons == ["length"]
    assert criterion.seen == sorted(set(criterion.seen))  # each length once, in order
    assert criterion.seen[-1] == 40 + 40  # the last token too (the prompt's ids included)


def test_the_greedy_resync_re_phases_the_greedy_slot_of_a_sampling_batch():
    """A batch of a greedy and a sampled request steps in sampling mode; ``"greedy"`` puts only
    the greedy slot's guess back in phase after its misses, the sampled one keeps its lag."""
    cm = minikv_compile(tiny(), snapkv(**KIVI, recall_top_k=4))  # the default: "greedy"
    rt, st = cm.runtime, cm.runtime.state
    rt.admit(0, Request(prompt_of(40, seed=3), 40))
    rt.admit(1, Request(prompt_of(30, seed=4), 40,
                        sampling=Sampling(greedy=False, temperature=1.5, seed=5)))
    rt.step()                                        # admission's pre-decoding step
    pre_steps, misses = [0, 0], [0, 0]
    for _ in range(30):
        pre, guess, count = st.pre[:2].tolist(), st.spec[:2].tolist(), st.count[:2].tolist()
        rt.step()
        for b, out in enumerate(rt.outputs([0, 1])):
            pre_steps[b] += pre[b]
            misses[b] += int(st.count[b]) > count[b] and out[-1] != guess[b]
    assert misses[0] > 0 and pre_steps[0] > 0
    assert misses[1] > 0 and pre_steps[1] == 0


def test_resync_changes_no_token_when_every_position_is_recalled():
    """Sampling (a drawn token is a miss wherever it is not row 1's greedy guess), every
    position recalled (the rows are exact whatever the ranking): with ``"always"`` the
    pre-decoding steps after the misses re-feed each token at its position, over the 32-token
    ring's flushes, without changing a single token of the same seeded draws; ``"greedy"``
    leaves sampled slots alone (the step count of ``"off"``)."""
    model = tiny()
    prompts = [prompt_of(37), prompt_of(20, seed=1)]
    out = {}
    for resync in RESYNCS:
        cm = minikv_compile(model, snapkv(**KIVI, recall_top_k=EVERYTHING, recall_resync=resync))
        torch.manual_seed(0)
        out[resync] = cm.generate(prompts, max_new_tokens=48, do_sample=True, temperature=1.5)
    assert out["always"].sequences == out["greedy"].sequences == out["off"].sequences
    assert [len(s) for s in out["always"].sequences] == [48, 48]
    assert out["always"].decode_steps > out["greedy"].decode_steps == out["off"].decode_steps == 48


@pytest.mark.parametrize("block", [1, 16])
def test_a_small_recall_with_eviction_is_slot_independent(block):
    """K = 16 of ~60 held tokens under the default selection (25% + 25%): a batch equals each
    prompt alone, and a request joining a running batch (its pre-decoding step runs beside the
    others' regular steps) gets its tokens alone, greedy and sampled."""
    cfg = snapkv(residual_length=32, max_prompt_len=128, max_new_tokens=60,
                       max_batch_size=4, recall_top_k=16, recall_block=block)
    cm = minikv_compile(tiny(), cfg)
    rt = cm.runtime
    reqs = [Request(prompt_of(100, seed=1), 60), Request(prompt_of(37, seed=2), 50),
            Request(prompt_of(120, seed=3), 40,
                    sampling=Sampling(greedy=False, temperature=1.2, top_k=20, seed=9))]

    def run(start, slots_reqs, join_after=None, late=None):
        rt.release_all()
        for slot, r in slots_reqs:
            rt.admit(slot, r)
        steps = 0
        while not all(rt.finished([s for s, _ in slots_reqs])) or late is not None:
            if steps == join_after and late is not None:
                rt.admit(*late)
                slots_reqs, late = slots_reqs + [late], None
            rt.step()
            steps += 1
        out = rt.outputs([s for s, _ in slots_reqs])
        rt.release_all()
        return out

    alone = [run(0, [(0, r)])[0] for r in reqs]
    assert run(0, [(0, reqs[0]), (1, reqs[1])], join_after=20, late=(2, reqs[2])) == alone
    greedy_plain = minikv_compile(tiny(), snapkv(
        residual_length=32, max_prompt_len=128, max_new_tokens=60)).generate(
        [list(reqs[0].prompt)], max_new_tokens=60).sequences[0]
    assert alone[0] != greedy_plain  # recall changed the tokens (so the test sees it run)


def test_compiled_two_row_step_equals_the_eager_one():
    """The step's parts through inductor (fullgraph, dynamic batch) give the eager step's
    tokens, across a flush and two buckets; the layer compiles once for every layer."""
    model = tiny(num_hidden_layers=3)
    cfg = dict(residual_length=16, max_prompt_len=64, max_new_tokens=40, max_batch_size=2,
               recall_top_k=8)
    prompts = [prompt_of(30, seed=1), prompt_of(45, seed=2)]
    eager = minikv_compile(model, snapkv(**cfg, compile=False))
    cm = minikv_compile(model, snapkv(**cfg, compile=True))
    for batch in ([prompts[0]], prompts):
        assert (cm.generate(batch, max_new_tokens=40).sequences
                == eager.generate(batch, max_new_tokens=40).sequences)
    # begin, layer, rank and choose at batch 1, and again for batches 2.. (dynamic); one layer
    # graph for the 3 layers of each (no norm handed on here)
    assert cm.stats["compiles"] == 8


def test_kv_memory_reports_device_and_host_bytes():
    model = tiny()
    cfg = snapkv(**KIVI, recall_top_k=16)
    cm = minikv_compile(model, cfg)
    report = cm.kv_memory(prompt_len=40, new_tokens=8, batch=2)
    H, D, Hq, L, K = 2, 64, 4, 2, 16
    # per slot and layer: recalled k and v, idx, lse_ref and the layer's mass plane (T_cap 112
    # + 33 ring rows, a byte each)
    per_layer = K * H * D * 4 * 2 + K * H * 4 + Hq * 4 + H * (112 + 33)
    assert report.recall_bytes == 2 * L * per_layer
    assert report.host_bytes == 2 * L * 48 * 2 * H * D * 4       # 40 + 8 tokens, fp32
    assert report.host_allocated_bytes == 4 * L * 112 * 2 * H * D * 4
    assert report.total_bytes == sum(x.total for x in report.layers)
    assert report.recall_bytes > 0 and "host copy (SpeCache)" in str(report)
    # the server's start-up line: the whole allocation, device and host (4 slots of 112 rows)
    host = 4 * L * 112 * 2 * H * D * 4
    assert report.allocation().endswith(f" on the device, host copy (recall) "
                                        f"{host / 2**30:.2f} GiB ({host:,} bytes) in host memory")


def test_host_memory_is_checked_before_anything_is_allocated(monkeypatch):
    monkeypatch.setattr(cache_module, "host_available_bytes", lambda: 10 * 2**20)
    allocated = []
    monkeypatch.setattr(cache_module.HostStore, "allocate",
                        classmethod(lambda cls, **kw: allocated.append(kw)))
    with pytest.raises(MemoryError, match=r"recall_top_k: the host copy .* needs 0.\d\d GiB"):
        minikv_compile(tiny(), snapkv(**{**KIVI, "max_batch_size": 64}, recall_top_k=16))
    assert allocated == []


@pytest.mark.parametrize("over,match", [
    (dict(bits=16), "recall_top_k: expected 0 with bits=16"),
    (dict(recall_block=16, recall_top_k=24), "recall_top_k: expected a multiple of recall_block=16"),
    (dict(recall_top_k=-1), "recall_top_k: expected an int >= 0"),
    (dict(recall_block=0), "recall_block: expected an int >= 1"),
    (dict(recall_top_k=2.0), "recall_top_k: expected an int"),
    (dict(recall_top_k=0, recall_resync="greedy"),
     "recall_resync: expected 'off' without recall \\(recall_top_k=0\\), got 'greedy'"),
    (dict(recall_resync=True), "recall_resync: expected one of \\('off', 'greedy', 'always'\\), got True"),
])
def test_bad_recall_config(over, match):
    with pytest.raises(ValueError, match=match):
        snapkv(**{"recall_top_k": 8, **over})


# -- GPU ------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("resync,sampled", [("off", False), ("greedy", False), ("greedy", True)])
def test_gpu_replayed_recall_step_equals_the_eager_step(resync, sampled):
    """bf16 on the GPU: the captured two-row step (pinned host copy, recall on the side
    stream) gives the tokens of the same compiled parts run without graphs, for a request
    joining mid-generation; the graphs are replayed and nothing recompiles on a second run.
    With ``recall_resync`` too (a missed guess's pre-decoding step set inside the graph), and
    with a sampled request joining the greedy one (the sampling step, the resync masked to the
    greedy slot)."""
    model = tiny(dtype=torch.bfloat16, device="cuda")
    cfg = dict(residual_length=32, max_prompt_len=128, max_new_tokens=80, max_batch_size=4,
               recall_top_k=16, recall_resync=resync)
    graphs = minikv_compile(model, snapkv(**cfg))
    eager = minikv_compile(model, snapkv(**cfg, cuda_graphs=False))  # same kernels
    drawn = Sampling(greedy=False, temperature=1.2, seed=7) if sampled else Sampling()
    reqs = [Request(prompt_of(100, seed=1), 80), Request(prompt_of(61, seed=3), 64, sampling=drawn)]

    def join(cm):
        rt = cm.runtime
        rt.release_all()
        rt.admit(0, reqs[0])
        for _ in range(40):
            rt.step()
        rt.admit(1, reqs[1])
        for _ in range(400):  # (at most 2 x 80 steps a request: a bad resync fails, not hangs)
            if all(rt.finished([0, 1])):
                return rt.outputs([0, 1])
            rt.step()
        raise AssertionError("the two requests did not finish within 400 steps")

    first = join(graphs)
    assert first == join(eager)
    compiles, replays = graphs.stats["compiles"], graphs.stats["replays"]
    assert join(graphs) == first
    assert graphs.stats["compiles"] == compiles and graphs.stats["replays"] > replays


@pytest.mark.gpu
def test_gpu_a_rebuilt_recall_engine_runs_its_saved_step(tmp_path, monkeypatch):
    """The two-row step (it holds a CUDA stream) is saved and loaded like the plain one: an
    engine built again on the same model and config compiles nothing and gives the same
    tokens from its replays."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    cfg = snapkv(residual_length=32, max_prompt_len=128, max_new_tokens=40,
                       max_batch_size=4, recall_top_k=16)
    prompts = [prompt_of(100, seed=1), prompt_of(61, seed=3)]

    def run():
        cm = minikv_compile(tiny(dtype=torch.bfloat16, device="cuda"), cfg)
        out = [cm.generate(b, max_new_tokens=40).sequences for b in (prompts[:1], prompts)]
        return out, cm.stats["compiles"], cm.stats["loaded"]

    tokens, compiled, loaded = run()
    assert compiled > 0 and loaded == 0
    assert run() == (tokens, compiled, compiled)


def test_the_default_config_streams_each_token_once():
    """The default recalls (a pre-decoding step that makes no token): a callable streamer gets
    every sequence's tokens once each, in order, as ``sequences`` holds them."""
    cm = minikv_compile(tiny(), MiniKVConfig(residual_length=16, max_prompt_len=64,
                                             max_new_tokens=12, max_batch_size=2))
    assert cm.config.recall_top_k == 64 and cm.config.rotation == "hadamard"
    steps = []
    out = cm.generate([prompt_of(40, 0), prompt_of(30, 1)], streamer=steps.append,
                      eos_token_id=[])
    assert all(any(t is not None for t in step) for step in steps)
    streamed = [[step[i] for step in steps if step[i] is not None] for i in range(2)]
    assert streamed == [list(s) for s in out.sequences] and len(streamed[0]) == 12
