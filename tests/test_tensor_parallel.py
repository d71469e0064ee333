"""Tensor parallel on the CPU: processes over gloo, each holding its share of a tiny random model.

The ranks run in fresh processes (``torch.multiprocessing``, a file store, gloo, a process-group
timeout), bounded in time as a whole. Two ranks run every scenario in one launch (a process
costs seconds to start on a small machine: a launch per scenario cost more than some scenarios);
four ranks run two cases on a wider model (one KV head each, a ragged vocabulary, biases rank 0
alone adds). A rank that raises fails the tests of the scenario it was in, and of those after
it, with its traceback. The reference is the single-process engine on the same model (and HF's
own greedy tokens for the uncompressed cache), computed while the two ranks run: fp32, greedy,
so the tokens must be equal, not close.
"""
from __future__ import annotations

import copy
import datetime
import gc
import json
import os
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp

from minikv_compile import MiniKVConfig, minikv_compile
from minikv_compile.graphs.runtime import Request, SlotRuntime
from minikv_compile.graphs.sampling import Sampling
from minikv_compile.graphs.step_plan import decode_path
from minikv_compile.models import TensorParallel, get_adapter, load_shard, shard_model
from minikv_compile.ranks import ReplicatedRuntime, follow
from minikv_compile import scheduler as scheduler_module
from minikv_compile.scheduler import Scheduler, ServeRequest
from configs import snapkv
from test_engine import FULL, hf_greedy, prompt_of, tiny
from test_scheduler import CharTokenizer

RANKS = 2
WIDE = 4                  # the four-rank launch
DEADLINE_S = 900          # every rank of one launch, from its start (on a loaded machine)
# A collective waiting for a rank that is gone gives up after this: above the lag of one rank's
# cold compile behind another's on a loaded 2-core machine (past 60 s there, the group broke).
GROUP_TIMEOUT_S = 300
FAILURE_TIMEOUT_S = 5     # the same in the scenario of failures (the last of its launch)
NCCL_DEADLINE_S = 420     # the GPU test: three engines compiled on a cold machine (200 s was short)

# kept_floor=1: the prompts here (20-120 tokens) are evicted from, as the ranks must agree on it
CAP = dict(residual_length=32, max_prompt_len=128, max_new_tokens=70, max_batch_size=4,
           kept_floor=1)
# The tiny model: 4 query / 2 KV heads (one KV head per rank over 2 ranks), intermediate 192,
# vocabulary 101 (ragged over 2 ranks: 51 + 50). Four ranks take the wide one, 8 query / 4 KV
# heads (one GQA group of 2 per rank; 48 features, 26 x 3 + 23 vocabulary rows a rank); it is a
# model of its own, not the two ranks' too: fp32 sums in another order part greedy tokens at a
# near-tie now and then (two of its six cases over two ranks, after 30 and 69 tokens).
WIDE_HEADS = dict(num_attention_heads=8, num_key_value_heads=4)
# name -> (tiny() arguments, MiniKVConfig fields).
CASES = {
    "full": ({}, dict(CAP, **FULL)),
    "minikv": ({}, dict(CAP)),                                  # 2 bit, SnapKV eviction
    "biases_hadamard": (dict(attention_bias=True, mlp_bias=True),  # o/down biases added once
                        dict(CAP, rotation="hadamard")),
    "qwen2": (dict(kind="qwen2"), dict(CAP, bits=4)),           # q/k/v biases
    "qwen3": (dict(kind="qwen3"), dict(CAP, budget_policy="pyramid")),  # q/k norms
    "specache": ({}, dict(CAP, heavy_budget=1.0, recent_budget=1.0, recall_top_k=16)),
}
# The cases four ranks run: one KV head a rank under eviction, and the biases rank 0 alone adds.
WIDE_CASES = ("minikv", "biases_hadamard")
# Compiled on the CPU (the ranks' collectives inside the compiled layer and choice): batch 1,
# where a cold compile of each part takes seconds, not the minutes of every bucket and mode.
COMPILED = dict(CAP, max_batch_size=1, compile=True)
PROMPTS = [prompt_of(n, seed=n) for n in (37, 100, 5)]
NEW = 70  # crosses two flushes of the 32-token ring
SAMPLED = dict(do_sample=True, temperature=1.3, top_k=40, top_p=0.9, seed=5)


def _model(kind: str = "llama", wide: bool = False, **over):
    """The tiny model (``wide``: ``WIDE_HEADS``), biases random."""
    model = tiny(kind, **(WIDE_HEADS if wide else {}), **over)
    _random_biases(model)
    return model


def _build(case: str, tp: int, wide: bool = False):
    over, fields = CASES[case]
    over = dict(over)
    return minikv_compile(_model(over.pop("kind", "llama"), wide, **over),
                          snapkv(**fields, tensor_parallel=tp))


def _random_biases(model) -> None:
    """HF initializes biases to zero, which would hide a bias added N times."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)


def _generate_and_join(case: str, tp: int, wide: bool = False) -> dict:
    """What the tests compare: greedy and sampled tokens of a batch, requests joining a
    running batch through the runtime, the KV bytes per layer."""
    cm = _build(case, tp, wide)
    out = {"greedy": cm.generate(PROMPTS, max_new_tokens=NEW).sequences,
           "sampled": cm.generate(PROMPTS, max_new_tokens=NEW, **SAMPLED).sequences}
    rt = cm.runtime
    running = [Request(prompt_of(90, seed=1), NEW),
               Request(prompt_of(30, seed=2), 50, sampling=Sampling(greedy=False, seed=9))]
    for slot, r in enumerate(running):
        rt.admit(slot, r)
    for _ in range(20):
        rt.step()
    rt.admit(2, Request(prompt_of(61, seed=3), 40))          # joins: bucket 2 -> 4
    for _ in range(10):
        rt.step()
    rt.release(1)                                            # leaves mid-generation
    rt.admit(1, Request(prompt_of(12, seed=4), 30))          # and its slot is reused
    while not all(rt.finished([0, 1, 2])):
        rt.step()
    out["joined"] = rt.outputs([0, 1, 2])
    rt.release_all()
    report = cm.kv_memory(prompt_len=100, new_tokens=NEW, batch=3)
    out["kv"] = [[layer.codes, layer.scale_zero, layer.ring, layer.recall, layer.host]
                 for layer in report.layers]
    out["kv_notes"] = report.notes
    # A sampled request without a seed, each rank's generator seeded differently: the ranks
    # must still agree (rank 0's draw is every rank's seed).
    torch.manual_seed(100 + (dist.get_rank() if tp > 1 else 0))
    out["unseeded"] = cm.generate(PROMPTS[:1], max_new_tokens=30,
                                  **dict(SAMPLED, seed=None)).sequences
    return out


def _every_case(tp: int, cases=tuple(CASES), wide: bool = False) -> dict:
    return {case: _generate_and_join(case, tp, wide) for case in cases}


def _compiled(tp: int) -> dict:
    """Greedy then sampled, compiled (``tp == 1``: the eager reference); the compile count after
    each."""
    cm = minikv_compile(_model(), snapkv(**dict(COMPILED, compile=tp > 1),
                                               tensor_parallel=tp))
    out = {"greedy": [cm.generate([p], max_new_tokens=NEW).sequences[0] for p in PROMPTS]}
    out["greedy_compiles"] = cm.stats["compiles"]
    out["sampled"] = cm.generate(PROMPTS[1:2], max_new_tokens=NEW, **SAMPLED).sequences
    out["compiles"] = cm.stats["compiles"]
    return out


def _failures(tp: int) -> dict:
    """Ranks that disagree fail together; a rank that is stuck makes the others fail after the
    group's timeout, and every later call at once (the group is broken): never hang."""
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=FAILURE_TIMEOUT_S))
    cm = _build("minikv", tp)
    rank = dist.get_rank()
    out = {}
    try:
        cm.generate([prompt_of(20 + rank)], max_new_tokens=5)  # a different prompt per rank
    except ValueError as e:
        out["mismatch"] = str(e)
    if rank == 1:  # stuck elsewhere for longer than the timeout, then gone
        time.sleep(FAILURE_TIMEOUT_S + 3)
        return out
    for what in ("stuck", "after"):
        start = time.perf_counter()
        try:
            cm.generate(PROMPTS[:1], max_new_tokens=5)
        except Exception as e:  # noqa: BLE001 - whatever the transport raises, it must raise
            out[what] = f"{type(e).__name__}: {e}"
        out[what + "_seconds"] = time.perf_counter() - start
    return out


def _fused(tp: int) -> dict:
    """The CUDA path's fused projections over the ranks (``ops.fused_linear``'s reference on the
    CPU): the residual in rank 0's launches alone, the norm not split; batches of 1 and 3 on
    the fused plan, 40 on the GEMM plan."""
    model = _model(attention_bias=True, mlp_bias=True)
    cfg = snapkv(**dict(CAP, max_batch_size=64, max_new_tokens=40))
    adapter = get_adapter(model, cfg.max_prompt_len + cfg.max_new_tokens, fuse_projections=True,
                          tp=TensorParallel.from_default_group(tp))
    rt = SlotRuntime(adapter, cfg, device=torch.device("cpu"), dtype=torch.float32,
                     compile=False, cuda_graphs=False)
    out = {"plans": [[p.fused_linear, p.split_norm]
                     for p in (decode_path(adapter, b, torch.float32) for b in (1, 4, 64))]}
    for n in (1, 3, 40):
        for slot in range(n):
            rt.admit(slot, Request(prompt_of(20 + 2 * slot, seed=slot), 40))
        while not all(rt.finished(list(range(n)))):
            rt.step()
        out[n] = rt.outputs(list(range(n)))
        rt.release_all()
    return out


SERVED = [(prompt_of(n, seed=n), m) for n, m in ((90, 40), (17, 12), (60, 31), (120, 8), (33, 25))]
SAMPLED_REQUEST = Sampling(greedy=False, temperature=1.2, seed=3)


def _scheduler(tp: int) -> dict:
    """Requests through rank 0's scheduler (the other rank follows its runtime's calls): idle
    heartbeats, three requests, then two joining the running ones, prompts prefilled a layer
    between two steps, one cancelled mid-stream, one too long for the engine (refused on rank 0
    alone), a sampled one with a seed; then the slots reused."""
    cm = _build("minikv", tp)
    if tp > 1 and dist.get_rank() != 0:
        follow(cm)
        return {}
    heartbeat = scheduler_module.HEARTBEAT_S
    scheduler_module.HEARTBEAT_S = 0.01  # idle rank 0 tells the other rank so (a no-op call)
    sched = Scheduler(cm, CharTokenizer(), max_queue=8, prefill_layers=1)
    sched.warm_up()
    sched.start()
    time.sleep(0.2)  # idle: heartbeats
    handles = [sched.submit(ServeRequest(p, m)) for p, m in SERVED[:3]]
    cancelled = sched.submit(ServeRequest(prompt_of(40, seed=8), 40))
    next(iter(cancelled))
    cancelled.cancel()
    too_long = sched.submit(ServeRequest(prompt_of(200, seed=9), 5))
    time.sleep(0.05)
    handles += [sched.submit(ServeRequest(p, m)) for p, m in SERVED[3:]]
    sampled = sched.submit(ServeRequest(SERVED[0][0], 20, SAMPLED_REQUEST))
    out = {"texts": [h.result() for h in handles], "cancelled": cancelled.result()[1],
           "too_long": too_long.result()[1], "sampled": sampled.result()}
    out["again"] = sched.submit(ServeRequest(*SERVED[1])).result()  # a reused slot
    out["slots_in_use"] = sched.slots_in_use
    sched.shutdown()
    scheduler_module.HEARTBEAT_S = heartbeat
    return out


def _scheduler_reference() -> dict:
    """What the single-process engine's generate gives each served request alone, as a stream
    ends it: without a last half character (test_scheduler's rule)."""
    cm, tok = _build("minikv", 1), CharTokenizer()
    want = [tok.decode(cm.generate([p], max_new_tokens=m, eos_token_id=[]).sequences[0])
            .rstrip("\ufffd") for p, m in SERVED]
    rt = cm.runtime  # the sampled request alone, on the single process's runtime
    rt.admit(0, Request(SERVED[0][0], 20, sampling=SAMPLED_REQUEST))
    while not rt.finished([0])[0]:
        rt.step()
    return {"texts": want, "sampled": tok.decode(rt.outputs([0])[0])}


# Each launch's scenarios in order: "failures" breaks the group, so it comes last.
SCENARIOS = {"every_case": _every_case, "fused": _fused, "scheduler": _scheduler,
             "compiled": _compiled, "failures": _failures,
             "wide": lambda tp: _every_case(tp, WIDE_CASES, wide=True)}
LAUNCHES = {RANKS: ("every_case", "fused", "scheduler", "compiled", "failures"),
            WIDE: ("wide",)}


def _rank_main(rank: int, world: int, store: str, out_dir: str, scenarios):
    torch.set_num_threads(1)  # several ranks on a small CPU machine
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    for scenario in scenarios:
        torch.manual_seed(0)
        path = os.path.join(out_dir, f"{scenario}.rank{rank}.json")
        try:
            result = SCENARIOS[scenario](world)
        except BaseException:
            with open(path, "w") as f:  # the traceback for the tests of this scenario
                json.dump({"error": traceback.format_exc()}, f)
            raise
        with open(path, "w") as f:
            json.dump(result, f)
    if scenarios[-1] == "failures":
        # gone without a word, as a crashed rank is (a group whose peer is gone aborts in
        # its destructors at a normal exit: the result is already written)
        os._exit(0)
    dist.destroy_process_group()
    # Not the interpreter's teardown: there, c10d's gloo threads abort the process now and then
    # (SIGABRT, "terminate called without an active exception", ~1 run in 10 of any scenario,
    # after the result is written and the group destroyed).
    os._exit(0)


def _join_within(ctx, seconds: float, what: str, progress=()) -> None:
    """Wait for every process of ``ctx`` (a failed one raises with its traceback); past
    ``seconds`` kill them all and fail naming ``what``, with the text of those ``progress``
    files that exist."""
    deadline = time.monotonic() + seconds
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            notes = "".join(f.read_text() for f in progress if f.exists())
            pytest.fail(f"{what} still running after {seconds} s"
                        + (f"; their progress:\n{notes}" if notes else ""))


class Launch:
    """The ranks of one launch: ``world`` fresh processes running ``LAUNCHES[world]`` in order."""

    def __init__(self, tmp_path, world: int):
        self.dir, self.world, self.error = tmp_path, world, None
        self.start = time.monotonic()
        self.ctx = mp.start_processes(_rank_main, nprocs=world, join=False, start_method="spawn",
                                      args=(world, str(tmp_path / "store"), str(tmp_path),
                                            LAUNCHES[world]))

    def join(self) -> "Launch":
        """Wait until ``DEADLINE_S`` after the start; a rank that failed is kept as ``error``
        (its scenario's file holds the traceback), the results of the scenarios before it stay
        readable."""
        try:
            _join_within(self.ctx, DEADLINE_S - (time.monotonic() - self.start),
                         f"{self.world} ranks")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            self.error = str(e)
        return self

    def results(self, scenario: str) -> list:
        """Every rank's result of ``scenario``, or the test fails with what stopped it."""
        paths = [self.dir / f"{scenario}.rank{r}.json" for r in range(self.world)]
        results = [json.loads(p.read_text()) if p.exists() else None for p in paths]
        errors = [r["error"] for r in results if isinstance(r, dict) and "error" in r]
        if errors or None in results:
            pytest.fail(f"{scenario} on {self.world} ranks: "
                        + (errors[0] if errors else f"no result ({self.error})"))
        return results


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """(the two-rank launch, the four-rank launch, the single process's references): the
    references computed while the two ranks run (they wait in their collectives much of the
    time), the four ranks launched after them (six processes on a small machine would only
    wait for each other)."""
    two = Launch(tmp_path_factory.mktemp("ranks2"), RANKS)
    try:
        alone = json.loads(json.dumps({
            "every_case": _every_case(1), "fused": _fused(1), "compiled": _compiled(1),
            "scheduler": _scheduler_reference(), "wide": _every_case(1, WIDE_CASES, wide=True)}))
    except BaseException:
        for p in two.ctx.processes:
            p.kill()
        raise
    two.join()
    return two, Launch(tmp_path_factory.mktemp("ranks4"), WIDE).join(), alone


def _check_case(ranks: list, alone: dict, case: str, kv_heads: int) -> None:
    world = len(ranks)
    ranks = [r[case] for r in ranks]
    for key in ("greedy", "sampled", "joined"):
        for rank in ranks:
            assert rank[key] == alone[key], key
    # an unseeded sampled request: one seed (rank 0's draw) on every rank
    assert all(rank["unseeded"] == ranks[0]["unseeded"] for rank in ranks)
    # each rank's cache holds its share of the KV heads: 1 / world of every per-head byte
    for rank in ranks:
        for mine, whole in zip(rank["kv"], alone["kv"]):
            assert [world * b for b in mine] == whole
        assert any(f"its {kv_heads // world} of {kv_heads} KV heads" in note
                   for note in rank["kv_notes"])


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_give_the_single_process_tokens(launched, case):
    two, _, alone = launched
    _check_case(two.results("every_case"), alone["every_case"][case], case, kv_heads=2)
    if case == "full":  # and the uncompressed cache's tokens are HF's own
        model = _model()
        assert alone["every_case"][case]["greedy"] == [hf_greedy(model, p, NEW) for p in PROMPTS]


@pytest.mark.parametrize("case", WIDE_CASES)
def test_four_ranks_give_the_single_process_tokens(launched, case):
    _, four, alone = launched
    _check_case(four.results("wide"), alone["wide"][case], case, kv_heads=4)


def test_two_compiled_ranks_give_the_single_process_tokens_and_compile_as_often(launched):
    two, _, alone = launched
    ranks, alone = two.results("compiled"), alone["compiled"]
    # the eager single process's tokens (the compiled step's equal them: test_engine)
    for key in ("greedy", "sampled"):
        for rank in ranks:
            assert rank[key] == alone[key], key
    # the start, the layer, the choice; then the sampling choice: the collectives inside the
    # compiled parts cost no compile, and nothing recompiles over the three requests and 210
    # steps
    for rank in ranks:
        assert (rank["greedy_compiles"], rank["compiles"]) == (3, 4)


def test_two_ranks_on_the_fused_projections_give_the_single_process_tokens(launched):
    two, _, alone = launched
    ranks, alone = two.results("fused"), alone["fused"]
    # one rank splits the norm at several rows; two ranks cannot (h is a sum over them)
    assert alone["plans"] == [[True, False], [True, True], [False, False]]
    for rank in ranks:
        assert rank["plans"] == [[True, False], [True, False], [False, False]]
        for n in ("1", "3", "40"):
            assert rank[n] == alone[n], n


def test_requests_through_rank_0s_scheduler_give_the_single_process_tokens(launched):
    """The server's path: rank 0's scheduler drives both ranks; every request gets what the
    single-process engine's generate gives it alone."""
    two, _, alone = launched
    rank0, want = two.results("scheduler")[0], alone["scheduler"]["texts"]
    assert [tuple(t) for t in rank0["texts"]] == [(w, "length") for w in want]
    assert tuple(rank0["again"]) == (want[1], "length")
    assert rank0["cancelled"] == "cancelled" and rank0["too_long"].startswith("error: ")
    assert tuple(rank0["sampled"]) == (alone["scheduler"]["sampled"], "length")
    assert rank0["slots_in_use"] == 0


def test_ranks_that_disagree_or_are_gone_fail_instead_of_hanging(launched):
    ranks = launched[0].results("failures")
    for rank in ranks:
        assert "requests: expected the same arguments on every rank (rank 0's), got different " \
               "ones on ranks [1]" in rank["mismatch"]
    # rank 1 stuck: rank 0's collective gives up after the group's timeout, and its next call
    # fails at once (gloo closed the pairs)
    first, second = ranks[0]["stuck_seconds"], ranks[0]["after_seconds"]
    assert "Timed out" in ranks[0]["stuck"] and FAILURE_TIMEOUT_S - 1 < first < FAILURE_TIMEOUT_S + 5
    assert "after" in ranks[0] and second < 1, ranks[0]


def test_heads_and_features_that_do_not_divide_by_the_ranks_are_refused():
    half = TensorParallel(rank=0, world=2)  # the checks come before any collective
    for over, name, given in ((dict(hidden_size=192, num_attention_heads=6, num_key_value_heads=3),
                               "num_key_value_heads", 3),
                              (dict(intermediate_size=191), "intermediate_size", 191)):
        model = tiny(**over)
        before = model.model.layers[0].self_attn.q_proj.weight.clone()
        with pytest.raises(ValueError, match=f"tensor_parallel=2: expected {name} divisible by "
                                             f"2 .*, got {given}"):
            get_adapter(model, 256, tp=half)
        assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, before)  # untouched


def test_tensor_parallel_needs_a_process_group_of_its_size():
    with pytest.raises(ValueError, match="tensor_parallel: expected torch.distributed "
                                         "initialized with 2 ranks .*, got no process group"):
        minikv_compile(tiny(), snapkv(tensor_parallel=2))
    with pytest.raises(ValueError, match="tensor_parallel: expected an int >= 1, got 0"):
        snapkv(tensor_parallel=0)


def test_rank_0s_runtime_refuses_what_would_run_on_rank_0_alone():
    cm = minikv_compile(tiny(), snapkv(**CAP))
    rt = ReplicatedRuntime(cm)  # (no collective until a call is made)
    assert rt.buckets == cm.runtime.buckets and rt.free_slots() == [0, 1, 2, 3]
    for name in ("admit", "admit_batch", "release_all", "finish"):
        with pytest.raises(AttributeError, match=f"ReplicatedRuntime.{name}: expected a call "
                                                 f"every rank makes .* would leave the ranks"):
            getattr(rt, name)
    with pytest.raises(ValueError, match="follow: expected a rank other than 0"):
        follow(cm)


def test_a_shard_cut_on_the_meta_device_then_materialized_is_the_ranks_shard():
    """What a model larger than the host's memory needs: the shard cut from a model on the meta
    device, then materialized, has the parameters of the shard of the whole model (names and
    shapes; loaded from it, strictly), the adapter takes it as it is, and refuses another
    rank's shard or a second cut."""
    whole = tiny(attention_bias=True, mlp_bias=True)
    _random_biases(whole)
    for rank in (0, 1):
        tp = TensorParallel(rank=rank, world=2)
        real = copy.deepcopy(whole)
        shard_model(real, tp)
        with torch.device("meta"):
            meta = tiny(device="meta", attention_bias=True, mlp_bias=True)
        shard_model(meta, tp)
        meta.to_empty(device="cpu")
        meta.load_state_dict(real.state_dict())
        for (name, a), (_, b) in zip(meta.named_buffers(), real.named_buffers()):
            a.copy_(b)  # the non-persistent ones (RoPE's inv_freq) are computed, not loaded
        assert {n: p.shape for n, p in meta.named_parameters()} == {
            n: p.shape for n, p in real.named_parameters()}
        q_rows = meta.model.layers[0].self_attn.q_proj.weight.shape[0]
        adapter = get_adapter(meta, 256, tp=tp)
        assert meta.model.layers[0].self_attn.q_proj.weight.shape[0] == q_rows  # not cut again
        assert (adapter.num_q_heads, adapter.num_kv_heads) == (2, 1)
        with pytest.raises(ValueError, match=f"model: expected a whole model or the shard of "
                                             f"rank {1 - rank} of 2, got the shard of rank "
                                             f"{rank} of 2"):
            get_adapter(meta, 256, tp=TensorParallel(rank=1 - rank, world=2))
        with pytest.raises(ValueError, match="model: expected a whole model, got the shard"):
            shard_model(meta, tp)
        with pytest.raises(ValueError, match="got the shard of rank"):
            get_adapter(meta, 256)  # one rank: the whole model


@pytest.mark.parametrize("tied", [False, True], ids=["own-head", "tied-head"])
def test_a_shard_read_from_the_checkpoint_is_the_ranks_shard_of_the_whole_model(tmp_path, tied):
    """``load_shard`` reads each rank's share of a checkpoint (here split over several files)
    and gets exactly what ``shard_model`` cuts out of the whole model loaded by HF, biases,
    a vocabulary that does not divide by the ranks (101) and a tied LM head included."""
    from transformers import AutoModelForCausalLM

    whole = tiny(attention_bias=True, mlp_bias=True, tie_word_embeddings=tied)
    _random_biases(whole)
    whole.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    for rank in (0, 1):
        tp = TensorParallel(rank=rank, world=2)
        want = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
        shard_model(want, tp)
        got = load_shard(tmp_path, tp, "cpu", torch.float32)
        assert got.minikv_shard == (rank, 2) and not got.training
        want_p, got_p = dict(want.named_parameters()), dict(got.named_parameters())
        assert want_p.keys() == got_p.keys()
        for name, p in want_p.items():
            assert torch.equal(got_p[name], p), name
        for (name, a), (_, b) in zip(got.named_buffers(), want.named_buffers()):
            assert torch.equal(a, b), name


def test_load_shard_names_what_the_checkpoint_lacks(tmp_path):
    tp = TensorParallel(rank=0, world=2)
    with pytest.raises(ValueError, match="expected an HF model directory with model.safetensors"):
        load_shard(tmp_path, tp, "cpu", torch.float32)
    from safetensors.torch import load_file, save_file

    whole = tiny()
    whole.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="to hold 'model.layers.1.mlp.up_proj.weight', got no "
                                         "such tensor"):
        load_shard(tmp_path, tp, "cpu", torch.float32)


def test_the_tensor_parallel_benchmark_runs_under_torchrun(tmp_path):
    """``bench_tp --tiny`` end to end over two gloo ranks (its plumbing: the figures on the CPU
    are not performance figures): a row per case, each rank's bytes its share, then HF's own
    tensor parallelism on the same ranks (random weights without a checkpoint) and each engine
    row against it. 2 warm and 16 timed tokens a row, not 8 and 64: the figures are not
    checked, only that each row has them (9.0 -> 7.7 s, 15.1 -> 13.0 CPU-s)."""
    import subprocess
    import sys

    out = tmp_path / "tp.json"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", "-m", "minikv_compile.perf.bench_tp", "--tiny",
                          "--methods", "minikv,hf-static", "--warm-tokens", "2",
                          "--timed-tokens", "16", "--out", str(out)],
                         capture_output=True, text=True, timeout=DEADLINE_S)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [(r["method"], r["batch"], r["prompt_len"], r["ranks"]) for r in result["rows"]] == [
        ("minikv", 1, 96, 2), ("minikv", 2, 64, 2), ("hf-static", 1, 96, 2),
        ("hf-static", 2, 64, 2)]
    hf = {(r["batch"], r["prompt_len"]): r["ms_per_token"] for r in result["rows"][2:]}
    for row in result["rows"][:2]:
        assert row["x_hf"] == {"hf-static": pytest.approx(
            row["ms_per_token"] / hf[row["batch"], row["prompt_len"]])}
    from minikv_compile.perf.harness import meta_model, model_summary

    whole = model_summary(meta_model("tiny"))["parameters"]
    # every layer's projections and the LM head are split; the embeddings and norms are not
    assert whole / 2 < result["summary_per_rank"]["parameters"] < whole
    for row in result["rows"][:2]:
        assert row["ms_per_token"] > 0 and row["step_collectives_ms"] > 0
        assert row["weight_bytes_per_rank"] == result["summary_per_rank"][
            "weight_bytes_read_per_step"]


# -- GPU: NCCL collectives inside the compiled, captured step, on one device ------------------

class _OneRankCollectives(TensorParallel):
    """One rank that runs its collectives anyway (over a one-rank NCCL group they return their
    input), so that one GPU checks what two need: funcol's all-reduce and all-gather traced
    by torch.compile into the step and captured with NCCL in its CUDA graphs."""

    def all_reduce(self, x):
        return funcol.all_reduce(x, "sum", self.group)

    def gather_vocab(self, logits, vocab_size):
        return funcol.all_gather_tensor(logits, 0, self.group)[:, :vocab_size]


def _nccl_one_rank(rank: int, store: str, out_path: str) -> None:
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    cfg = snapkv(**CAP)
    out = {}
    for name in ("plain", "collectives"):
        cm = minikv_compile(tiny(dtype=torch.bfloat16, device="cuda"), cfg)
        if name == "collectives":
            cm.adapter.tp = _OneRankCollectives(rank=0, world=1, group=dist.group.WORLD)
        alone = [cm.generate([p], max_new_tokens=NEW).sequences[0] for p in PROMPTS]  # bucket 1
        batch = cm.generate(PROMPTS, max_new_tokens=NEW).sequences                     # bucket 4
        out[name] = dict(alone=alone, batch=batch, compiles=cm.stats["compiles"],
                         graphs=len(cm.stats["graphs"]), replays=cm.stats["replays"])
    with open(out_path, "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()
    os._exit(0)


@pytest.mark.gpu
@pytest.mark.skipif(not dist.is_nccl_available(), reason="needs NCCL")
def test_gpu_nccl_collectives_compile_and_capture_in_the_step(tmp_path):
    out_path = tmp_path / "out.json"
    ctx = mp.start_processes(_nccl_one_rank, nprocs=1, join=False,
                             start_method="spawn", args=(str(tmp_path / "store"), str(out_path)))
    _join_within(ctx, DEADLINE_S, "the rank")
    out = json.loads(out_path.read_text())
    plain, coll = out["plain"], out["collectives"]
    assert coll["alone"] == plain["alone"] and coll["batch"] == plain["batch"]
    assert (coll["compiles"], coll["graphs"]) == (plain["compiles"], plain["graphs"])
    assert coll["replays"] == plain["replays"] > 0


def _gpu_ranks() -> int:
    """The ranks of the multi-GPU test: four where four GPUs are present, else two (the wide
    model's four KV heads divide by neither three nor more than four)."""
    return WIDE if torch.cuda.device_count() >= WIDE else RANKS


def _sums(world: int) -> dict:
    """``TensorParallel.all_reduce`` on this rank's bf16 rows against every rank's rows gathered
    and added here in rank order: 1 and 8 rows of 4096 (one-shot: the same adds, so the same
    bits) and 40 rows (over ``ONE_SHOT_BYTES``: NCCL, its own order of adds)."""
    tp = TensorParallel.from_default_group(world)
    out = {"one_shot": tp.one_shot}
    for rows in (1, 8, 40):
        gen = torch.Generator("cuda").manual_seed(100 * rows + tp.rank)
        x = torch.randn(rows, 4096, generator=gen, device="cuda").bfloat16()
        got = tp.all_reduce(x)
        every = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(every, x)
        want = every[0]
        for other in every[1:]:
            want = want + other
        exact = torch.stack([e.float() for e in every]).sum(0)
        out[rows] = {"bits": torch.equal(got, want),
                     "off": (got.float() - exact).abs().max().item(),
                     "bf16_off": (want.float() - exact).abs().max().item()}
    return out


def _nccl_ranks(rank: int, world: int, store: str, out_dir: str) -> None:
    """Rank ``rank`` on GPU ``rank``: the compiled, captured engine over ``world`` NCCL ranks;
    then, the group destroyed by every rank together (an NCCL communicator's destruction waits
    for every rank's), rank 0 alone runs the single-GPU engine on the same model, in bf16 and
    (log-probabilities only) in fp16. The CUDA kernels take no fp32."""
    t0 = time.monotonic()

    def mark(what: str) -> None:  # what the test's failure message shows if a rank stalls
        with open(os.path.join(out_dir, f"progress{rank}.txt"), "a") as f:
            f.write(f"rank {rank} {time.monotonic() - t0:6.1f} s: {what}\n")

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    targets = [prompt_of(NEW, seed=50 + i) for i in range(len(PROMPTS))]
    out = {"sums": _sums(world)}
    for name, tp, dtype in (("ranks", world, torch.bfloat16), ("alone", 1, torch.bfloat16),
                            ("fp16", 1, torch.float16)):
        if tp == 1 and dist.is_initialized():
            cm = None
            gc.collect()  # the N-rank engine's graphs (it lives in reference cycles)
            dist.barrier()
            dist.destroy_process_group()
            mark("group destroyed")
            if rank != 0:
                break
        mark(f"{name}: building")
        cm = minikv_compile(_model(wide=True, dtype=dtype, device=f"cuda:{rank}"),
                            snapkv(**CAP, tensor_parallel=tp))
        out[name] = run = {}
        if name != "fp16":
            run["alone"] = [cm.generate([p], max_new_tokens=NEW).sequences[0]
                            for p in PROMPTS]                                         # bucket 1
            run["batch"] = cm.generate(PROMPTS, max_new_tokens=NEW).sequences          # bucket 4
            run["compiles"], run["replays"] = cm.stats["compiles"], cm.stats["replays"]
            run["again"] = cm.generate(PROMPTS, max_new_tokens=NEW).sequences
            run.update(compiles_after=cm.stats["compiles"], graphs=len(cm.stats["graphs"]),
                       replays_after=cm.stats["replays"],
                       kv=[[layer.codes, layer.scale_zero, layer.ring, layer.recall]
                           for layer in cm.kv_memory(prompt_len=100, new_tokens=NEW,
                                                     batch=3).layers])
            mark(f"{name}: generated")
        run["forced"] = [lp.tolist() for lp in cm.teacher_force(PROMPTS, targets)]
        mark(f"{name}: teacher-forced")
    with open(os.path.join(out_dir, f"nccl{rank}.json"), "w") as f:
        json.dump(out, f)
    os._exit(0)


def _deviation(a, b):
    """(max, mean) absolute difference of two lists of log-probability lists."""
    d = torch.cat([torch.tensor(x) - torch.tensor(y) for x, y in zip(a, b)]).abs()
    return d.max().item(), d.mean().item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2
                    or not dist.is_nccl_available(), reason="needs two GPUs and NCCL")
def test_gpu_nccl_ranks_compute_what_one_gpu_does(tmp_path):
    """Four GPUs (two where fewer are present), one rank each: the step with its all-reduces
    (one-shot or NCCL's) and NCCL's logits gather compiled and captured per bucket, replayed, never
    recompiled, computing what the single-GPU engine computes. In bf16 each rank's partial sum
    is rounded before they are added, and greedy tokens part after a few steps (the gloo tests
    check exact tokens in fp32 on the CPU), so the check against one GPU is on teacher-forced
    log-probabilities over 70 steps and two flushes: the ranks may move them no more than bf16
    itself does (one GPU in bf16 against fp16). On the CPU over two ranks the same comparison
    measured 0.033 mean / 0.23 max against bf16's own 0.12 / 0.53; a head or a sum dropped or
    misplaced moves them by whole units."""
    world = _gpu_ranks()
    ctx = mp.start_processes(_nccl_ranks, nprocs=world, join=False, start_method="spawn",
                             args=(world, str(tmp_path / "store"), str(tmp_path)))
    _join_within(ctx, NCCL_DEADLINE_S, f"{world} ranks",
                 [tmp_path / f"progress{r}.txt" for r in range(world)])
    ranks = [json.loads((tmp_path / f"nccl{r}.json").read_text()) for r in range(world)]
    # the all-reduce alone: one-shot where the GPUs reach each other's memory, else NCCL
    peers = os.environ.get("MINIKV_ONE_SHOT") != "0" and all(
        torch.cuda.can_device_access_peer(i, j)
        for i in range(torch.cuda.device_count()) for j in range(torch.cuda.device_count())
        if i != j)
    for sums in (r["sums"] for r in ranks):
        assert bool(sums["one_shot"]) == peers, (sums["one_shot"], peers)
        if peers:
            assert sums["1"]["bits"] and sums["8"]["bits"], sums
        assert sums["40"]["off"] <= 4 * sums["40"]["bf16_off"], sums  # bf16 rounding, not a rank
    for other in ranks[1:]:
        assert other["ranks"] == ranks[0]["ranks"]  # every token and log-prob, every count
    mine, alone = ranks[0]["ranks"], ranks[0]["alone"]
    assert mine["again"] == mine["batch"] and alone["again"] == alone["batch"]
    tp_max, tp_mean = _deviation(mine["forced"], alone["forced"])
    own_max, own_mean = _deviation(alone["forced"], ranks[0]["fp16"]["forced"])
    assert tp_mean <= own_mean and tp_max <= own_max, (tp_mean, own_mean, tp_max, own_max)
    # the start, the layer and the choice at 1 and at 2..4 (the ranks never split the norm:
    # one kind of layer call): the collectives inside the compiled parts cost no compile; a
    # second batch compiles nothing more and replays every step
    assert (mine["compiles"], mine["graphs"]) == (6, alone["graphs"])
    assert mine["compiles_after"] == mine["compiles"]
    assert mine["replays_after"] - mine["replays"] == (
        alone["replays_after"] - alone["replays"]) > 0
    for m, a in zip(mine["kv"], alone["kv"]):  # each rank holds its share of the 4 KV heads
        assert [world * b for b in m] == a
