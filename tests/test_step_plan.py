"""One plan per (bucket, mode) (``graphs/step_plan.py``): what a bucket's ``StepPlan`` holds,
that ``stats["kernels"]`` prints it, and that the decode step runs what it says and derives
nothing itself (eager CPU runtimes: the ops' references take the launches and ignore them; the
GPU test checks the kernels' launches)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from minikv_compile import minikv_compile, ops
from minikv_compile.graphs import step_plan
from minikv_compile.graphs.runtime import Request, SlotRuntime
from minikv_compile.graphs.step_plan import StepPlan
from minikv_compile.models import get_adapter
from minikv_compile.ops import attention_decode, linear
from configs import snapkv
from test_engine import prompt_of, tiny

CFG = dict(residual_length=32, max_prompt_len=64, max_new_tokens=4, max_batch_size=64)
# tiny()'s shapes: 4 query heads, 2 KV heads, head dim 64, hidden 128, intermediate 192
SHAPES = {"qkv": (512, 128), "o": (128, 256), "gate_up": (384, 128), "down": (128, 192)}


def runtime(dtype=torch.float32, device="cpu", **over) -> SlotRuntime:
    cfg = snapkv(**{**CFG, **over})
    adapter = get_adapter(tiny(dtype=dtype, device=device),
                          cfg.max_prompt_len + cfg.max_new_tokens, fuse_projections=True)
    return SlotRuntime(adapter, cfg, device=torch.device(device), dtype=dtype, compile=False,
                       cuda_graphs=False)


@pytest.fixture(scope="module")
def rt() -> SlotRuntime:
    return runtime()


def admit(rt: SlotRuntime, n: int) -> None:
    rt.release_all()
    for slot in range(n):
        rt.admit(slot, Request(prompt_of(20 + slot, seed=slot), 4))


def test_a_buckets_plan_holds_every_choice_of_its_step(rt):
    cache = rt.cache
    for bucket, fused, split in ((1, True, False), (4, True, True), (64, False, False)):
        plan = rt.plan(bucket, "greedy")
        assert rt.plan(bucket, "greedy") is plan  # built once
        assert (plan.bucket, plan.mode, plan.rows, plan.recall) == (bucket, "greedy", bucket,
                                                                    False)
        assert (plan.path.fused_linear, plan.path.split_norm) == (fused, split)
        if fused:  # each projection's launch: the op's rule at this bucket's rows and shapes
            for name, (n, k) in SHAPES.items():
                want = linear.launch_config(bucket, n, k, torch.float32)
                assert plan.linears[name] == want
                assert getattr(plan.path, name).tolist() == [int(want[key])
                                                             for key in linear.LAUNCH_KEYS]
        else:
            assert plan.linears == {} and plan.path == (False, False, None, None, None, None)
        want = [attention_decode._plan(cache.device, torch.float32, cache.bits, cache.group_size,
                                       64, bucket, 4, 2, kv.capacity, 1) for kv in cache.layers]
        assert list(plan.attention) == want
        assert [t.tolist() for t in plan.attention_launch] == [
            [0, p.num_splits, p.block_n, p.num_warps, p.num_stages, p.maxnreg or 0, p.half2,
             p.prefetch] for p in want]
        with pytest.raises(dataclasses.FrozenInstanceError):
            plan.rows = 2
    with pytest.raises(ValueError, match="bucket: expected one of"):
        rt.prepare(3, "greedy")


def test_recall_doubles_the_rows_and_fp16_keeps_its_norms():
    rec = runtime(bits=2, heavy_budget=1.0, recent_budget=1.0, recall_top_k=16, max_batch_size=4)
    plan = rec.plan(2, "greedy")
    assert (plan.rows, plan.recall, plan.path.split_norm) == (4, True, True)
    assert plan.linears["down"] == linear.launch_config(4, 128, 192, torch.float32)
    kv = rec.cache.layers[0]
    assert plan.attention[0] == attention_decode._plan(
        rec.cache.device, torch.float32, 2, rec.cache.group_size, 64, 2, 4, 2, kv.capacity, 1,
        rows=2, recall=True)
    assert "minikv::decode_attention_recall" in "\n".join(plan.kernels())
    half = runtime(torch.float16, max_batch_size=4)
    path = half.plan(4, "greedy").path
    assert (path.fused_linear, path.split_norm) == (True, False)  # fp16: rms_norm launches
    assert "fused_linear gate/up (minikv::rms_norm first, SiLU-gate)" in "\n".join(
        half.plan(4, "greedy").kernels())


def test_kernels_name_every_launch_with_its_choice(rt):
    lines = rt.plan(4, "sample").kernels()
    text = "\n".join(lines)
    for name, (n, k) in SHAPES.items():
        cfg = linear.launch_config(4, n, k, torch.float32)
        assert f"{cfg['BLOCK_M']} x {cfg['BLOCK_N']} x {cfg['BLOCK_K']} tiles" in text
    for kernel in ("minikv::cache_begin_step", "fused_linear q/k/v", "minikv::cache_write_ring",
                   "fused_linear o_proj", "fused_linear gate/up", "fused_linear down",
                   "lm_head, sampling"):
        assert kernel in text
    splits = rt.plan(4, "sample").attention[0].num_splits
    assert f"layers 0-1: minikv::decode_attention [Triton split kernel, {splits} splits" in text
    assert "GEMM" in "\n".join(rt.plan(64, "greedy").kernels())


def test_stats_kernels_print_the_plans():
    cm = minikv_compile(tiny(), snapkv(**{**CFG, "max_batch_size": 4}))
    kernels = cm.stats["kernels"]
    assert sorted(kernels) == [(1, "greedy"), (2, "greedy"), (4, "greedy")]
    assert kernels[(2, "greedy")] == cm.runtime.plan(2, "greedy").kernels()
    cm.generate([prompt_of(10), prompt_of(12, seed=1)], max_new_tokens=2, do_sample=True,
                seed=3)
    kernels = cm.stats["kernels"]
    assert kernels[(2, "sample")] == cm.runtime.plans[2, "sample"].kernels()
    assert kernels[(2, "sample")][-1].startswith("end: final norm, lm_head, sampling")


def test_the_step_runs_its_plan_and_derives_nothing(rt, monkeypatch):
    calls = {"attention": [], "linear": []}
    attend, fused_linear = ops.decode_attention, ops.fused_linear

    def spy_attention(*args, launch=None, **kw):
        calls["attention"].append(launch)
        return attend(*args, launch=launch, **kw)

    def spy_linear(*args, launch=None, **kw):
        calls["linear"].append(launch)
        return fused_linear(*args, launch=launch, **kw)

    admit(rt, 3)
    plan = rt.plan(4, "greedy")
    rt.prepare(4, "greedy")
    monkeypatch.setattr(ops, "decode_attention", spy_attention)
    monkeypatch.setattr(ops, "fused_linear", spy_linear)

    def derived(*args, **kw):
        raise AssertionError("a plan derived while the step runs")

    for module, name in ((step_plan, "decode_path"), (linear, "launch_config"),
                         (attention_decode, "_plan"), (attention_decode, "decode_attention_plan")):
        monkeypatch.setattr(module, name, derived)
    monkeypatch.setattr(StepPlan, "build", derived)
    rt.step()
    assert all(a is b for a, b in zip(calls["attention"], plan.attention_launch))
    assert len(calls["attention"]) == 2
    path = plan.path
    assert all(a is b for a, b in zip(calls["linear"], [path.qkv, path.o, path.gate_up,
                                                        path.down] * 2))
    assert len(calls["linear"]) == 8
    # a plan built with another split count: the attention gets that launch
    other = plan.attention[0]._replace(num_splits=7)
    rt.plans[4, "greedy"] = dataclasses.replace(plan, attention=(other, other),
                                                attention_launch=(other.as_tensor(),) * 2)
    calls["attention"].clear()
    rt.step()
    assert [t[1].item() for t in calls["attention"]] == [7, 7]
    # and one on the GEMM path: no fused_linear launch at all, at the same 4 rows
    rt.plans[4, "greedy"] = dataclasses.replace(plan, path=plan.path._replace(
        fused_linear=False, split_norm=False))
    calls["linear"].clear()
    rt.step()
    assert calls["linear"] == []
    rt.plans[4, "greedy"] = plan
    rt.release_all()


def test_a_step_without_its_plan_is_refused(rt):
    admit(rt, 1)
    step = rt.runner._step
    with pytest.raises(RuntimeError, match="expected a plan of bucket 1, mode 'teacher'"):
        step(rt.state.active[:1], "teacher")
    rt.release_all()


@pytest.mark.gpu
def test_gpu_the_kernels_launch_as_the_plan_says(monkeypatch):
    rt = runtime(torch.bfloat16, "cuda", max_batch_size=4, bits=2, group_size=16)
    admit(rt, 3)
    rt.prepare(4, "greedy")
    plan = rt.plan(4, "greedy")
    for module, name in ((linear, "launch_config"), (attention_decode, "_plan")):
        monkeypatch.setattr(module, name, lambda *a, **k: pytest.fail("derived at run time"))
    seen = {"attention": [], "linear": []}
    of_tensor = attention_decode._Plan.of_tensor.__func__

    def record_plan(cls, launch):
        seen["attention"].append(of_tensor(cls, launch))
        return seen["attention"][-1]

    monkeypatch.setattr(attention_decode._Plan, "of_tensor", classmethod(record_plan))
    kernel = linear._fused_linear_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen["linear"].append((kw["BLOCK_M"], kw["BLOCK_K"], kw["NUM_STAGES"]))
                return kernel[grid](*args, **kw)
            return launch

    monkeypatch.setattr(linear, "_fused_linear_kernel", Recorder())
    rt.step()
    assert seen["attention"] == list(plan.attention)
    cfgs = [plan.linears[n] for n in ("qkv", "o", "gate_up", "down")] * 2
    assert seen["linear"] == [(c["BLOCK_M"], c["BLOCK_K"], c["NUM_STAGES"]) for c in cfgs]
    # another split count and another gate/up tile: the kernels launch so
    one = plan.attention[0]._replace(num_splits=1)
    gate_up = {**plan.linears["gate_up"], "BLOCK_K": 64}
    rt.plans[4, "greedy"] = dataclasses.replace(
        plan, attention=(one, one), attention_launch=(one.as_tensor(),) * 2,
        path=plan.path._replace(gate_up=linear.launch_tensor(gate_up)))
    seen["attention"].clear()
    seen["linear"].clear()
    rt.step()
    assert [p.num_splits for p in seen["attention"]] == [1, 1]
    assert seen["linear"][2][1] == 64 and seen["linear"][6][1] == 64
    torch.cuda.synchronize()


def test_a_launch_of_the_wrong_form_is_refused(rt):
    kv, cache = rt.cache.layers[0], rt.cache
    q = torch.zeros(1, 4, 64)
    for bad, match in ((torch.zeros(8), "launch: expected dtype"),
                       (torch.zeros(3, dtype=torch.int64), r"launch: expected shape \(8\)")):
        with pytest.raises(ValueError, match=match):
            ops.decode_attention(q, *kv, 0.125, cache.bits, cache.group_size, launch=bad)
    x, w = torch.zeros(2, 128), torch.zeros(256, 128)
    with pytest.raises(ValueError, match=r"launch: expected shape \(7\)"):
        ops.fused_linear(x, w, launch=torch.zeros(8, dtype=torch.int64))
    # the kernels' side (what a CUDA call runs; here under the interpreter, refused before it
    # launches): a launch that cannot serve the call
    split = rt.plan(1, "greedy").attention[0]
    gluon = split._replace(kernel=attention_decode.FRAGMENTS).as_tensor()
    with pytest.raises(ValueError, match="'fragments' does not cover this call"):
        attention_decode._decode_attention_triton(q, *kv, 0.125, cache.bits, cache.group_size,
                                                  gluon)
    cfg = {**linear.launch_config(2, 256, 128, torch.float32), "BLOCK_N": 16}
    with pytest.raises(ValueError, match="launch: expected BLOCK_N 32 with norm_out"):
        linear._fused_linear_norm_out_triton(x, w, None, None, torch.ones(256),
                                             linear.launch_tensor(cfg))
