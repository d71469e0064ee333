"""The runtime of slots: requests that join and leave a running batch, and the sampling rule.

CPU, fp32, tiny random models (tests/test_engine.py's `tiny`): a row's arithmetic does not
depend on the other rows, so "the same tokens as alone" is exact here.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers.generation.logits_process import (LogitsProcessorList,
                                                    RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from minikv_compile import minikv_compile
from minikv_compile.graphs.runtime import Request
from minikv_compile.graphs.sampling import Sampling, choose_tokens, exponential_noise
from configs import snapkv
from test_engine import prompt_of, tiny

CFG = dict(residual_length=32, max_prompt_len=128, max_new_tokens=120, max_batch_size=4,
           kept_floor=1)  # short prompts evicted from (the budgets alone)
SAMPLED = Sampling(greedy=False, temperature=1.3, top_k=40, top_p=0.9, seed=1234)


def alone(cm, request):
    """The tokens ``request`` gets in slot 0 of an otherwise empty engine."""
    rt = cm.runtime
    rt.release_all()
    rt.admit(0, request)
    while not rt.finished([0])[0]:
        rt.step()
    out = rt.outputs([0])[0]
    rt.release(0)
    return out


def run_until_done(rt, slots):
    while not all(rt.finished(slots)):
        rt.step()


@pytest.mark.parametrize("joining", [Sampling(), SAMPLED], ids=["greedy", "sampled"])
def test_a_request_joining_mid_generation_gets_its_tokens_alone(joining):
    cm = minikv_compile(tiny(), snapkv(**CFG))
    rt = cm.runtime
    running = [Request(prompt_of(100, seed=1), 120),
               Request(prompt_of(37, seed=2), 90, sampling=Sampling(greedy=False, seed=7))]
    late = Request(prompt_of(61, seed=3), 64, sampling=joining)
    want = [alone(cm, r) for r in running + [late]]
    assert want[2] != want[0][:64]
    for slot, r in enumerate(running):
        rt.admit(slot, r)
    for _ in range(50):  # the others are 50 tokens into their generation (one flush behind them)
        rt.step()
    assert rt.step_key() == (2, "sample")
    rt.admit(2, late)    # bucket 2 -> 4 from the next step on
    assert rt.step_key() == (4, "sample")
    run_until_done(rt, [0, 1, 2])
    assert rt.outputs([0, 1, 2]) == want


def test_released_slots_are_free_and_others_are_untouched():
    cm = minikv_compile(tiny(), snapkv(**CFG))
    rt = cm.runtime
    a, b, c = (Request(prompt_of(n, seed=n), 100) for n in (90, 20, 45))
    want_a, want_c = alone(cm, a), alone(cm, c)
    rt.admit(0, a)
    rt.admit(1, b)
    for _ in range(30):
        rt.step()
    rt.release(1)                      # cancelled mid-generation
    assert rt.free_slots() == [1, 2, 3]
    for _ in range(10):
        rt.step()
    rt.admit(1, c)                     # its slot, reused while slot 0 runs on
    run_until_done(rt, [0, 1])
    assert rt.outputs([0, 1]) == [want_a, want_c]
    with pytest.raises(ValueError, match="expected a free slot, got slot 0"):
        rt.admit(0, c)
    rt.release_all()
    with pytest.raises(ValueError, match="expected a slot holding a request, got free slot 1"):
        rt.release(1)
    with pytest.raises(ValueError, match=r"slot: expected an int in \[0, 4\), got 4"):
        rt.admit(4, c)
    with pytest.raises(RuntimeError, match="at least one admitted slot"):
        rt.step()


def _link_tree(src: Path, dst: Path) -> None:
    """Hard links under ``dst`` of the files under ``src``, but its saved steps and locks. The
    session's cache folder is shared by the xdist workers (conftest sets it before they start):
    a file another worker's inductor renames or removes meanwhile is left out."""
    for root, dirs, files in os.walk(src):
        dirs[:] = [d for d in dirs if d not in ("minikv_steps", "locks")]
        out = dst / Path(root).relative_to(src)
        out.mkdir(parents=True, exist_ok=True)
        for name in files:
            try:
                os.link(Path(root) / name, out / name)
            except FileNotFoundError:
                pass


def test_a_graph_compiled_mid_generation_and_a_rebuilt_engine_running_the_saved_steps(
        tmp_path, monkeypatch, caplog):
    # compile=True on the CPU: the first sampled request makes the runner compile the "sample"
    # step while a greedy request is 40 tokens in. Compiling runs the step for real (with every
    # slot masked) and must leave the running slot's cache and state as they were.
    # Each compiled variant of the step's parts is saved beside inductor's cache; an engine
    # built again on the same model and config (a restart) runs them without compiling and
    # gives the same tokens; a file that does not load is skipped with a warning and its kind
    # of call compiles again; another config has a folder of its own.
    # (One test, one set of compiles: the mid-generation engine is the first rebuilt one, and
    # its run, repeated on rebuilt engines, is what they must reproduce. As two tests they
    # compiled 17 variants; here 11.)
    # The cache folder: a copy (hard links) of this session's inductor cache without its saved
    # steps: inductor finds the kernels compiled before in this session (the same tiny model)
    # and only the saved steps are new.
    _link_tree(Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]), tmp_path)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    cfg = snapkv(**CFG, compile=True)
    greedy = Request(prompt_of(70, seed=4), 100)
    sampled = Request(prompt_of(30, seed=5), 40, sampling=SAMPLED)
    cm = minikv_compile(tiny(), cfg)
    want = [alone(cm, greedy), alone(cm, sampled)]
    # alone, both at batch 1 share the start and the layer: 4 compiles, nothing to load
    assert (cm.stats["compiles"], cm.stats["loaded"]) == (4, 0)

    def join(config=cfg):
        """A rebuilt engine: the sampled request joins the greedy one 40 tokens in."""
        fresh = minikv_compile(tiny(), config)
        fresh.runtime.admit(0, greedy)
        for _ in range(40):
            fresh.runtime.step()
        fresh.runtime.admit(1, sampled)  # (2, "sample") is compiled now, mid-generation
        run_until_done(fresh.runtime, [0, 1])
        assert sorted(fresh.stats["compile_seconds"]) == [(1, "greedy"), (2, "sample")]
        return fresh.runtime.outputs([0, 1]), fresh.stats["compiles"], fresh.stats["loaded"]

    # The start and the layer once per batch size (1, and 2 as a dynamic size), the choice
    # once per (batch size, mode): 6, of which the 3 at batch 1 are the saved ones of the
    # engine before (loaded, not compiled) and (2, "sample")'s 3 are compiled mid-generation.
    assert join() == (want, 6, 3)
    # rebuilt again: every part of both batch sizes loaded, none compiled, the same tokens
    assert join() == (want, 6, 6)
    saved = sorted(tmp_path.glob("minikv_steps/*/layer-*.bin"))
    assert len(saved) == 2
    saved[0].write_bytes(b"not a compiled function")
    with caplog.at_level("WARNING"):
        assert join() == (want, 6, 5)
    assert f"saved step part {saved[0]} not loaded" in caplog.text
    # another config: a folder of its own, none of the first one's variants loaded; and a
    # folder that cannot be written: the engine compiles and runs alone, with a warning (batch
    # 1 alone: the start, the layer and the choice)
    def refuse(self, data):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(type(tmp_path), "write_bytes", refuse)
    caplog.clear()
    other = minikv_compile(tiny(), snapkv(**CFG, compile=True, bits=4))
    with caplog.at_level("WARNING"):
        other.generate([greedy.prompt], max_new_tokens=20)
    assert (other.stats["compiles"], other.stats["loaded"]) == (3, 0)
    assert "not saved (" in caplog.text and "Permission denied" in caplog.text
    folders = sorted(tmp_path.glob("minikv_steps/*"))
    assert len(folders) == 2 and [list(f.iterdir()) for f in folders].count([]) == 1


def test_one_compiled_layer_serves_every_layer_of_each_plan():
    # The CUDA path's three plans, on the CPU: the fused projections (ops.fused_linear's
    # reference) at batch 1 and at 2..32 (the input norm split over launches), GEMMs at 33..64.
    # 8 layers, yet the layer compiles once per plan and kind of layer (the first takes no norm
    # share, the last hands none on: CompiledPart's kinds); the tokens are the eager step's.
    from minikv_compile.graphs.runtime import SlotRuntime
    from minikv_compile.models import get_adapter

    model = tiny(num_hidden_layers=8)
    cfg = snapkv(**{**CFG, "max_batch_size": 64, "max_new_tokens": 6})
    requests = [Request(prompt_of(30 + 2 * i, seed=i), 6) for i in range(40)]
    outputs, compiles = [], []
    for compile in (True, False):
        adapter = get_adapter(model, cfg.max_prompt_len + cfg.max_new_tokens,
                              fuse_projections=True)
        rt = SlotRuntime(adapter, cfg, device=torch.device("cpu"), dtype=torch.float32,
                         compile=compile, cuda_graphs=False)
        for n in (1, 3, 20, 40):  # buckets 1, 4, 32 and 64
            for slot in range(n):
                rt.admit(slot, requests[slot])
            run_until_done(rt, list(range(n)))
            outputs.append(rt.outputs(list(range(n))))
            compiles.append(rt.runner.compiles)
            rt.release_all()
    assert [rt.plans[b, "greedy"].path.split_norm for b in (1, 4, 32, 64)] == [
        False, True, True, False]
    assert outputs[:4] == outputs[4:]
    # the start, the layer and the choice at batch 1 (every layer one kind of call: the plan
    # does not split the norm, so no layer hands one on); at 2..32 the start, 3 kinds of layer
    # (the first takes no norm share, the last hands none on) and the choice (bucket 32 reuses
    # bucket 4's, the batch is dynamic); at 33..64 the GEMM layer alone (the start and the
    # choice see no plan)
    assert compiles[:4] == [3, 8, 8, 9]


def test_the_fused_plans_buckets_share_one_compile_in_bf16():
    # bf16 takes the tile rule's several-row branch inside the fused ops' fake functions (fp32
    # returns before it): no guard on the symbolic batch may come of it, so buckets 4 and 32
    # (one plan) run the same compiled layer.
    from minikv_compile.graphs.runtime import SlotRuntime
    from minikv_compile.models import get_adapter

    model = tiny(dtype=torch.bfloat16, num_hidden_layers=3)
    cfg = snapkv(**{**CFG, "max_batch_size": 32, "max_new_tokens": 2})
    adapter = get_adapter(model, cfg.max_prompt_len + cfg.max_new_tokens, fuse_projections=True)
    rt = SlotRuntime(adapter, cfg, device=torch.device("cpu"), dtype=torch.bfloat16,
                     compile=True, cuda_graphs=False)
    compiles = []
    for n in (3, 20):  # buckets 4 and 32
        for slot in range(n):
            rt.admit(slot, Request(prompt_of(20 + slot, seed=slot), 2))
        run_until_done(rt, list(range(n)))
        compiles.append(rt.runner.compiles)
        rt.release_all()
    plans = [rt.plans[b, "greedy"].path for b in (4, 32)]
    assert [(p.fused_linear, p.split_norm) for p in plans] == [(True, True)] * 2
    assert compiles[1] == compiles[0] > 0


def test_generate_seed_is_reproducible_alone_and_in_a_batch():
    cm = minikv_compile(tiny(), snapkv(**CFG))
    p, q = prompt_of(40, seed=8), prompt_of(90, seed=9)
    kw = dict(max_new_tokens=60, do_sample=True, temperature=1.2)
    first = cm.generate([p], seed=11, **kw).sequences[0]
    assert cm.generate([p], seed=11, **kw).sequences[0] == first
    # sequence i draws with seed + i, whatever else is in the batch
    assert cm.generate([q, p], seed=10, **kw).sequences[1] == first
    assert cm.generate([p], seed=12, **kw).sequences[0] != first


def test_finished_slots_change_nothing_teacher_mode_included():
    cm = minikv_compile(tiny(), snapkv(**CFG))
    rt = cm.runtime
    target = prompt_of(20, seed=9)
    rt.admit(0, Request(prompt_of(50, seed=8), 20, forced=target))
    run_until_done(rt, [0])
    logprobs, lens = rt.logprobs([0])[0], [lc.lens[0].clone() for lc in rt.cache.layers]
    assert logprobs.shape == (20,) and torch.isfinite(logprobs).all()
    for _ in range(5):  # stepped again while finished (a scheduler may, until it releases)
        rt.step()
    assert torch.equal(rt.logprobs([0])[0], logprobs)
    assert all(torch.equal(lc.lens[0], was) for lc, was in zip(rt.cache.layers, lens))
    assert rt.outputs([0])[0] == target


def test_an_eos_as_first_token_ends_the_request_at_admission():
    cm = minikv_compile(tiny(), snapkv(**CFG))
    p = prompt_of(40, seed=10)
    first = cm.generate([p], max_new_tokens=5).sequences[0][0]
    rt = cm.runtime
    rt.admit(0, Request(p, 30, eos_ids=(first,)))
    assert rt.finished([0]) == [True] and rt.outputs([0]) == [[first]]
    rt.release(0)
    got = cm.generate([p], max_new_tokens=30, eos_token_id=first)
    assert got.sequences == [[first]] and got.stop_reasons == ["eos"] and got.decode_steps == 0


@pytest.mark.parametrize("request_, match", [
    (Request([], 4), r"request.prompt: expected 1..128"),
    (Request([1] * 129, 4), r"request.prompt: expected 1..128"),
    (Request([1], 121), r"request.max_new_tokens: expected 1..120"),
    (Request([1], 0), r"request.max_new_tokens"),
    (Request([1], 4, min_new_tokens=5), r"request.min_new_tokens: expected 0..4"),
    (Request([1], 4, eos_ids=tuple(range(9))), r"request.eos_ids: expected up to 8"),
    (Request([1], 4, eos_ids=(101,)), r"request.eos_ids"),
    (Request([1], 4, forced=[1, 2]), r"request.forced: expected max_new_tokens=4"),
])
def test_admit_validates_the_request(request_, match):
    cm = minikv_compile(tiny(), snapkv(**CFG))
    with pytest.raises(ValueError, match=match):
        cm.runtime.admit(0, request_)
    assert cm.runtime.admitted == []


# -- the sampling rule against HF's own processors -----------------------------------------------

def _hf_probs(logits, seen_ids, temperature, top_k, top_p, penalty):
    procs = LogitsProcessorList()
    if penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(penalty))
    procs.append(TemperatureLogitsWarper(temperature))
    if top_k is not None:
        procs.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p))
    ids = torch.tensor([seen_ids])
    return procs(ids, logits[None].clone())[0].softmax(-1)


@pytest.mark.parametrize("temperature, top_k, top_p, penalty", [
    (1.0, None, 1.0, 1.0),
    (0.7, None, 1.0, 1.0),
    (1.0, 5, 1.0, 1.0),
    (1.0, None, 0.8, 1.0),
    (1.5, 6, 0.7, 1.0),       # top-p over the renormalized top 6
    (1.0, 2, 0.292, 1.0),     # HF keeps one token: p1 / (p1 + p2) > 0.292
    (0.9, None, 1.0, 1.8),    # repetition penalty on the raw logits, then temperature
])
def test_sampling_matches_hf_processors(temperature, top_k, top_p, penalty):
    V, N = 24, 6000
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(V, generator=g) * 2
    logits[3] = logits[7]  # a tie
    seen_ids = [1, 3, 5, 11]
    want = _hf_probs(logits, seen_ids, temperature, top_k, top_p, penalty)
    seen = torch.zeros(N, V, dtype=torch.bool)
    seen[:, seen_ids] = True
    row = lambda x, dt: torch.full((N,), x, dtype=dt)  # noqa: E731
    drawn = choose_tokens(logits.expand(N, V), greedy=row(False, torch.bool),
                          temperature=row(temperature, torch.float32),
                          top_k=row(V if top_k is None else top_k, torch.int64),
                          top_p=row(top_p if top_p < 1 else 2.0, torch.float32),
                          penalty=row(penalty, torch.float32), seen=seen,
                          seed=row(99, torch.int64), counter=torch.arange(N))
    freq = torch.bincount(drawn, minlength=V).double() / N
    assert (freq[want == 0] == 0).all()                   # what HF removes is never drawn
    # Multinomial standard error: sqrt(p (1 - p) / N) <= 0.0065 at N = 6000; 5 sigma.
    tol = 5 * (want.double() * (1 - want.double()) / N).sqrt() + 1e-9
    assert ((freq - want.double()).abs() <= tol).all(), (freq, want)
    # greedy rows take the first maximum of the penalized logits, as HF's greedy search does
    greedy = choose_tokens(logits[None], greedy=torch.tensor([True]),
                           temperature=row(1.0, torch.float32)[:1],
                           top_k=torch.tensor([V]), top_p=torch.tensor([2.0]),
                           penalty=row(penalty, torch.float32)[:1], seen=seen[:1],
                           seed=torch.tensor([0]), counter=torch.tensor([0]))
    assert greedy.item() == _hf_probs(logits, seen_ids, 1.0, None, 1.0, penalty).argmax().item()


def test_noise_is_a_function_of_seed_counter_and_token():
    ids = torch.arange(1000)[None].expand(3, -1)
    a = exponential_noise(torch.tensor([5, 5, 6]), torch.tensor([0, 1, 0]), ids)
    assert torch.equal(a, exponential_noise(torch.tensor([5, 5, 6]), torch.tensor([0, 1, 0]), ids))
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
    assert (a > 0).all() and torch.isfinite(a).all()
    assert abs(a.mean().item() - 1.0) < 0.05        # Exp(1): mean 1, 3000 draws
    big = exponential_noise(torch.tensor([2**62 + 3]), torch.tensor([2**40]), ids[:1])
    assert torch.isfinite(big).all()


# -- GPU ------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_join_and_capture_under_the_sync_guard():
    # bf16 on the GPU: bucket 1 and bucket 4 run other kernels (rounding differs), so a joining
    # request is compared with the same request joining again, not with a run alone.
    model = tiny(dtype=torch.bfloat16, device="cuda")
    cm = minikv_compile(model, snapkv(**CFG))
    rt = cm.runtime
    reqs = [Request(prompt_of(100, seed=1), 120), Request(prompt_of(61, seed=3), 64,
                                                          sampling=SAMPLED)]

    def join():
        rt.release_all()
        rt.admit(0, reqs[0])
        for _ in range(50):
            rt.step()
        rt.admit(1, reqs[1])  # the next step captures (2, "sample"), mid-generation
        run_until_done(rt, [0, 1])
        return rt.outputs([0, 1])

    first = join()
    replays = cm.stats["replays"]
    assert join() == first
    assert cm.stats["replays"] > replays
    # 3 graphs, 8 compiles: the start at batch 1 and at 2..32 (bucket 4's graph, reused by
    # bucket 2), the layer at batch 1 and at 2..32 (there the first and the last of the 2
    # layers, one each: the split norm's last layer hands none on), the choice for (1, greedy),
    # (2.., greedy) and (2.., sample).
    assert len(cm.stats["graphs"]) == 3 and cm.stats["compiles"] == 8


@pytest.mark.gpu
def test_gpu_a_host_sync_inside_the_step_fails_at_capture():
    from minikv_compile.graphs.graph_runner import GraphRunner

    x = torch.zeros(4, device="cuda")
    active = torch.zeros(4, dtype=torch.bool, device="cuda")

    def syncing_step(slots, mode):
        x.add_(float(x.sum().item()))  # .item(): a device-to-host sync

    def step(slots, mode):
        x.add_(1.0)

    runner = GraphRunner(lambda compile_part: syncing_step, device=torch.device("cuda"),
                         compile=False, cuda_graphs=True, state_buffers=[x, active],
                         active=active)
    with pytest.raises(RuntimeError):
        runner.prepare((1, "greedy"))
    clean = GraphRunner(lambda compile_part: step, device=torch.device("cuda"), compile=False,
                        cuda_graphs=True, state_buffers=[x, active], active=active)
    clean.prepare((1, "greedy"))
    x.zero_()
    for _ in range(3):
        clean.run((1, "greedy"))
    assert x.tolist() == [3.0] * 4 and clean.replays == 3


@pytest.mark.gpu
def test_gpu_admission_and_release_never_wait_for_the_gpu():
    # A scheduler launches a step, then a prefill layer, then reads the step before: anything
    # that waits for the GPU on the way (a Python scalar written into a device tensor by
    # indexing, an index tensor built from a host list) stalls every stream by the work queued.
    model = tiny(dtype=torch.bfloat16, device="cuda")
    cm = minikv_compile(model, snapkv(**CFG))
    rt = cm.runtime
    for bucket in rt.buckets:
        for mode in ("greedy", "sample"):
            rt.prepare(bucket, mode)
    joining = [Request(prompt_of(90, seed=2), 40, eos_ids=(5, 7), min_new_tokens=3,
                       sampling=SAMPLED),
               Request(prompt_of(70, seed=4), 30, sampling=Sampling(greedy=False, top_k=9))]

    def run(guard: bool):
        rt.release_all()
        rt.admit(0, Request(prompt_of(100, seed=1), 120))
        for _ in range(5):
            rt.step()
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error" if guard else previous)
        try:
            for _ in rt.admit_batch_in_pieces([1, 2], joining, 1):
                rt.step()
            for _ in range(3):
                rt.step()
            rt.finish(0)
            rt.release(0)
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        run_until_done(rt, [1, 2])
        return rt.outputs([1, 2])

    torch.manual_seed(0)
    want = run(guard=False)
    torch.manual_seed(0)  # (the second request's seed is drawn from the generator)
    assert run(guard=True) == want
