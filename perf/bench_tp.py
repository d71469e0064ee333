"""Benchmark tensor-parallel decode: ms/token over the GPUs of one host against its floor.

    torchrun --nproc-per-node N -m minikv_compile.perf.bench_tp [--shape llama3.1-70b] \\
        [--cases 1x32768,8x4096] [--methods minikv,kivi] [--out tp.json] [--tiny]

Every rank builds its shard of a random-weight model of ``--shape``: cut from the model on the
meta device (``models.shard_model``), then materialized on its own GPU, because the Llama-3.1-70B
shape is ~141 GB of bf16 weights, more than one H200 holds. Per method and case (batch x prompt)
every rank compiles the engine with ``tensor_parallel=N`` and runs the same ``generate`` calls
(``harness.time_decode``: ms per step of a timed call after a warm-up call); rank 0 writes the
rows. The tensor-parallel floor of a case is what one rank cannot avoid per step: its shard's
weight and KV bytes over its measured copy bandwidth (``measure.copy_bandwidth``), plus the
step's collectives as the step runs them (``2 L`` all-reduces of ``(B, hidden)`` and one gather
of the ``(B, V / N)`` logits, captured in one CUDA graph and replayed).

``--tiny`` runs the plumbing on the tiny shape (on the CPU over gloo where there is no GPU);
its figures are not performance figures.

``--methods hf-static``: HF's own tensor parallelism on the same ranks, as its users run it
(``from_pretrained(..., tp_plan="auto")`` under torchrun, ``generate`` with a ``StaticCache``
and its default auto-compile), timed by the same ``time_decode``. There is no 141 GB checkpoint
to read (nor disk for one): ``LlamaForCausalLM.from_pretrained(None, config=..., state_dict={},
tp_plan="auto")`` has every weight missing, so HF materializes only this rank's shard of each
parameter and initializes it. Its phase runs after ours, with our shard freed (both would not
fit one H200). Each engine row of a case HF ran gets ``x_hf``, its time over HF's.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import List

import torch
import torch.distributed as dist

from minikv_compile.models import TensorParallel, shard_model
from minikv_compile.models.parallel import join_torchrun
from minikv_compile.perf.argtypes import comma_list, shape_list
from minikv_compile.perf.harness import (ENGINE_METHODS, SHAPES, EngineRunner, HFRunner,
                                         floor_figures, make_prompts, model_summary,
                                         time_decode)
from minikv_compile.perf.measure import copy_bandwidth, git_info, write_json

def sharded_model(shape: str, tp: TensorParallel, device: torch.device, dtype: torch.dtype):
    """This rank's shard of a random-weight model of ``shape``: cut on the meta device, then
    materialized on ``device`` (weights N(0, 0.02), RoPE's buffers computed anew)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**SHAPES[shape].config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    shard_model(model, tp)
    model.to_empty(device=device)
    torch.manual_seed(tp.rank)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    with torch.device(device):  # (its buffers are not weights: computed, not loaded)
        model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    model.eval()
    gen = model.generation_config
    gen.eos_token_id, gen.pad_token_id, gen.do_sample = None, 0, False
    return model


def hf_sharded_model(shape: str, dtype: torch.dtype):
    """HF's tensor-parallel model of ``shape`` on this rank's device, random weights (see the
    module docstring); the concrete class (``AutoModelForCausalLM.from_pretrained(None)`` looks
    for a path). The same seed on every rank: the replicated parameters must agree."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(None, config=LlamaConfig(**SHAPES[shape].config),
                                             state_dict={}, dtype=dtype, tp_plan="auto")
    model.eval()
    gen = model.generation_config
    gen.eos_token_id, gen.pad_token_id, gen.do_sample = None, 0, False
    return model


def step_collectives_ms(tp: TensorParallel, batch: int, hidden: int, layers: int,
                        vocab_share: int, dtype: torch.dtype, device: torch.device,
                        reps: int = 20) -> float:
    """Mean ms of one step's collectives as the step runs them: ``2 layers`` all-reduces of
    ``(batch, hidden)`` and one gather of the ``(batch, vocab_share)`` logits, back to back,
    on the GPU captured in one CUDA graph and replayed (timed alone with a host sync each, an
    all-reduce took 72 us on 2 H200s, which put the floor above the captured step itself);
    on the CPU run eagerly. Not ``measure.graph_ms``: its ``do_bench`` picks the replay count by
    time, and every rank must replay the collectives the same number of times."""
    x = torch.randn(batch, hidden, dtype=dtype, device=device)
    logits = torch.randn(batch, vocab_share, dtype=dtype, device=device)

    def collectives() -> torch.Tensor:
        for _ in range(2 * layers):
            tp.all_reduce(x)
        return tp.gather_vocab(logits, vocab_share * tp.world)

    if device.type != "cuda":
        collectives()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(reps):
            collectives()
        return 1e3 * (time.perf_counter() - start) / reps
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            collectives()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        collectives()
    dist.barrier()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def _engine_row(model, method: str, batch: int, prompt_len: int, tp: TensorParallel,
                summary: dict, dtype: torch.dtype, device: torch.device, bandwidth, args) -> dict:
    """One engine row: ms per token, this rank's bytes and collectives, and the floor."""
    runner = EngineRunner(model, method, batch=batch, prompt_len=prompt_len,
                          new_tokens=args.timed_tokens + 1, tensor_parallel=tp.world)
    timing = time_decode(runner, make_prompts(batch, prompt_len, summary["vocab"]),
                         args.warm_tokens, args.timed_tokens)
    step_comm_ms = step_collectives_ms(tp, batch, summary["hidden"], summary["layers"],
                                       model.lm_head.weight.shape[0], dtype, device)
    # this rank's bytes: its weights (the shard), its KV heads' share of the cache
    floor = floor_figures(model, method, prompt_len, batch, timing["generated_mid"], None, None)
    kv = floor["kv_bytes_read"] // tp.world
    row = {"method": method, "batch": batch, "prompt_len": prompt_len, "ranks": tp.world,
           "ms_per_token": timing["ms_per_token"],
           "weight_bytes_per_rank": floor["weight_bytes_read"], "kv_bytes_per_rank": kv,
           "step_collectives_ms": step_comm_ms, "warm_s": timing["warm_s"],
           "prefill_s": timing["prefill_s"], "setup": runner.setup_info()}
    if bandwidth:
        row["floor_ms"] = (1e3 * (floor["weight_bytes_read"] + kv) / bandwidth["bytes_per_s"]
                           + step_comm_ms)
        row["x_floor"] = timing["ms_per_token"] / row["floor_ms"]
    runner.close()
    if tp.rank == 0:
        print(f"{method} {batch}x{prompt_len} on {tp.world} ranks: "
              f"{timing['ms_per_token']:.2f} ms/token"
              + (f", floor {row['floor_ms']:.2f} ms (x{row['x_floor']:.2f})" if bandwidth
                 else ""), flush=True)
    return row


def _free(device: torch.device) -> None:
    """Give a closed engine's or a freed model's memory back before the next one is built (an
    engine is freed by the collector, not when its last name goes)."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default=None, help="default llama3.1-70b (tiny with --tiny)")
    ap.add_argument("--cases", type=shape_list, default=None,
                    help="BxL comma list (default 1x32768,8x4096)")
    ap.add_argument("--methods", type=comma_list(tuple(ENGINE_METHODS) + ("hf-static",),
                                                 "methods"), default=["minikv"])
    ap.add_argument("--warm-tokens", type=int, default=8)
    ap.add_argument("--timed-tokens", type=int, default=64)
    ap.add_argument("--out", default=None, help="JSON file for the rows (rank 0)")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args(argv)
    try:
        device = join_torchrun("bench_tp", None, torch.cuda.is_available(), timeout_s=900)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    tp = TensorParallel.from_default_group(dist.get_world_size())
    shape = args.shape or ("tiny" if args.tiny else "llama3.1-70b")
    cases = args.cases or ([(1, 96), (2, 64)] if args.tiny else [(1, 32768), (8, 4096)])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else None
    rows: List[dict] = []
    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "git": git_info(Path.cwd()).get("sha")}

    def save() -> None:
        """Rank 0 rewrites the file after every row, so that a run cut short keeps its rows."""
        for row in rows:  # each engine row against HF's of its case
            hf = [r for r in rows if r["method"].startswith("hf")
                  and (r["batch"], r["prompt_len"]) == (row["batch"], row["prompt_len"])]
            if hf and not row["method"].startswith("hf"):
                row["x_hf"] = {r["method"]: row["ms_per_token"] / r["ms_per_token"] for r in hf}
        if tp.rank == 0 and args.out:
            write_json(args.out, {"shape": shape, "summary_per_rank": summary, "env": env,
                                  "bandwidth": bandwidth, "rows": rows})

    ours = [m for m in args.methods if not m.startswith("hf")]
    theirs = [m for m in args.methods if m.startswith("hf")]
    summary = None
    if ours:
        model = sharded_model(shape, tp, device, dtype)
        summary = model_summary(model)
        for method in ours:
            for batch, prompt_len in cases:
                rows.append(_engine_row(model, method, batch, prompt_len, tp, summary, dtype,
                                        device, bandwidth, args))
                save()
                _free(device)  # the last case's engine (its cache, its graphs' pool)
        del model
        _free(device)
    if theirs:
        start = time.perf_counter()
        model = hf_sharded_model(shape, dtype)
        build_s = time.perf_counter() - start  # its shard materialized and initialized
        vocab = model.config.vocab_size
        for method in theirs:
            for batch, prompt_len in cases:
                runner = HFRunner(model, method, batch=batch, prompt_len=prompt_len,
                                  new_tokens=args.timed_tokens + 1)
                timing = time_decode(runner, make_prompts(batch, prompt_len, vocab),
                                     args.warm_tokens, args.timed_tokens)
                rows.append({"method": method, "batch": batch, "prompt_len": prompt_len,
                             "ranks": tp.world, "ms_per_token": timing["ms_per_token"],
                             "warm_s": timing["warm_s"], "prefill_s": timing["prefill_s"],
                             "build_s": build_s, "setup": runner.setup_info()})
                save()
                runner.close()
                _free(device)
                if tp.rank == 0:
                    print(f"{method} {batch}x{prompt_len} on {tp.world} ranks: "
                          f"{timing['ms_per_token']:.2f} ms/token", flush=True)
        del model
        _free(device)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
