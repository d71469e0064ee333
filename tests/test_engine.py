"""The engine end to end on tiny random HF models (real model sizes in comments)."""
from __future__ import annotations

import pytest
import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config,
                          Qwen3Config)

from minikv_compile import minikv_compile
from minikv_compile.graphs import budget
from minikv_compile.graphs.step_plan import decode_path
from configs import snapkv
from reference_pipeline import ReferenceMiniKV

# Tiny shapes: 2 layers, 4 q / 2 kv heads, head dim 64 (Llama-3.1-8B: 32 layers, 32/8, 128;
# SmolLM2-135M: 30 layers, 9/3, 64). A large init spreads the logits so greedy ties are rare.
_COMMON = dict(vocab_size=101, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=64,
               max_position_embeddings=1024, initializer_range=0.1)


def tiny(kind: str = "llama", dtype=torch.float32, device="cpu", **over):
    cfg = {"llama": LlamaConfig, "qwen3": Qwen3Config, "mistral": MistralConfig,
           "qwen2": Qwen2Config}[kind](**{**_COMMON, **over})
    if kind == "mistral":
        cfg.sliding_window = None
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(cfg).to(device=device, dtype=dtype).eval()
    # No eos: both HF and the engine generate exactly the tokens asked for (the config's default
    # eos id 2 is a token of the 101-token vocabulary).
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(model, prompt, n):
    """HF's own greedy tokens (no eos: ``tiny`` clears it)."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompt_of(n, seed=0, vocab=101):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


FULL = dict(bits=16, heavy_budget=1.0, recent_budget=1.0)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral", "qwen2"])
def test_full_cache_reproduces_hf_greedy(kind):
    model = tiny(kind)
    cm = minikv_compile(model, snapkv(**FULL, residual_length=32, max_prompt_len=64,
                                            max_new_tokens=48))
    prompt = prompt_of(37)
    got = cm.generate([prompt], max_new_tokens=48).sequences[0]
    assert got == hf_greedy(model, prompt, 48)


@pytest.mark.parametrize("mode", [
    dict(),                                         # the paper's MiniKV: 25% / 25%, 2 bit
    dict(budget_policy="pyramid"),                  # MiniKV-pyramid
    dict(heavy_budget=1.0, recent_budget=1.0),      # KIVI: no eviction, 2 bit
    dict(bits=4),
    dict(bits=1, group_size=32),                    # SpeCache's 1-bit rule
    # keys over 128 tokens, values over the head's 64 channels; 101 tokens in the ring, then
    # flushed at once as one key group
    dict(heavy_budget=1.0, recent_budget=1.0, group_size=128, residual_length=128),
    dict(bits=16),                                  # H2O-style eviction at 16 bit
])
def test_minikv_matches_plain_reference(mode):
    model = tiny()
    # kept_floor=1: the budgets alone, so that a 101-token prompt is evicted from
    paper = dict(selection="h2o", snapkv_kernel=7, selection_block=1, sink_tokens=0, kept_floor=1)
    cfg = snapkv(**{**paper, **dict(residual_length=32, max_prompt_len=128, max_new_tokens=70),
                          **mode})
    cm = minikv_compile(model, cfg)
    # 101 kept 50% -> 51 tokens: 32 quantized + 19 in the ring (half the ring and 51 mod 16)
    prompt = prompt_of(101, seed=3)
    got = cm.generate([prompt], max_new_tokens=70).sequences[0]
    ref = ReferenceMiniKV(model, heavy=cfg.heavy_budget, recent=cfg.recent_budget, bits=cfg.bits,
                          group=cfg.group_size, ring=cfg.residual_length,
                          pyramid_depth=cfg.pyramid_depth if cfg.budget_policy == "pyramid" else None,
                          kept_floor=cfg.kept_floor)
    assert got == ref.generate(prompt, 70)  # 70 steps cross two flushes of the 32-token ring


def test_batch_of_unequal_prompts_equals_each_alone():
    model = tiny()
    cfg = snapkv(residual_length=32, max_prompt_len=128, max_new_tokens=40, max_batch_size=4)
    cm = minikv_compile(model, cfg)
    prompts = [prompt_of(n, seed=n) for n in (5, 100, 33)]
    batch = cm.generate(prompts, max_new_tokens=40).sequences
    assert batch == [cm.generate([p], max_new_tokens=40).sequences[0] for p in prompts]
    # the same prompts as a right-padded tensor with a mask
    ids = torch.zeros(3, 100, dtype=torch.int64)
    mask = torch.zeros(3, 100, dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
        mask[i, : len(p)] = 1
    assert cm.generate(ids, attention_mask=mask, max_new_tokens=40).sequences == batch


def test_eos_stops_each_sequence_and_streaming_matches():
    model = tiny()
    cm = minikv_compile(model, snapkv(residual_length=32, max_prompt_len=64, max_new_tokens=30,
                                            max_batch_size=2))
    prompts = [prompt_of(20, 1), prompt_of(40, 2)]
    free = cm.generate(prompts, max_new_tokens=30).sequences
    eos = free[0][5]  # a token the first sequence produces at step 5
    out = cm.generate(prompts, max_new_tokens=30, eos_token_id=eos)
    for full, got, why in zip(free, out.sequences, out.stop_reasons):
        cut = full.index(eos) + 1 if eos in full else len(full)
        assert got == full[:cut]
        assert why == ("eos" if eos in full else "length")
    streamed = []
    cm.generate(prompts, max_new_tokens=30, eos_token_id=eos, streamer=streamed.append)
    for i, seq in enumerate(out.sequences):
        assert [s[i] for s in streamed if s[i] is not None] == seq


def test_sampling_is_seeded_and_top_k_1_is_greedy():
    model = tiny()
    cm = minikv_compile(model, snapkv(residual_length=32, max_prompt_len=64, max_new_tokens=20))
    p = [prompt_of(30)]
    greedy = cm.generate(p, max_new_tokens=20).sequences
    assert cm.generate(p, max_new_tokens=20, do_sample=True, top_k=1).sequences == greedy
    torch.manual_seed(5)
    a = cm.generate(p, max_new_tokens=20, do_sample=True, temperature=1.5).sequences
    torch.manual_seed(5)
    b = cm.generate(p, max_new_tokens=20, do_sample=True, temperature=1.5).sequences
    assert a == b and a != greedy


def test_compiled_step_compiles_once_over_many_steps_and_requests():
    model = tiny(num_hidden_layers=1)
    cfg = snapkv(residual_length=16, max_prompt_len=64, max_new_tokens=600, compile=True)
    cm = minikv_compile(model, cfg)
    eager = minikv_compile(model, snapkv(**{**cfg.__dict__, "compile": False}))
    for n in (17, 50):  # new prompt lengths, then 599 steps = 37 flushes of the 16-token ring
        p = [prompt_of(n, seed=n)]
        assert cm.generate(p, max_new_tokens=600).sequences == eager.generate(p, max_new_tokens=600).sequences
    assert cm.stats["compiles"] == 3  # the start, one layer (every layer's), the choice


def test_kv_memory_report_matches_paper_formula_for_llama2_7b_shape():
    # LLaMA2-7B: 32 layers, 32 KV heads x 128 = 4096 wide; L = 4096, L_gen = 512, 25% / 25%.
    cfg = LlamaConfig(vocab_size=32, hidden_size=4096, intermediate_size=32, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4608)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    model = model.to_empty(device="cpu").to(torch.float16)
    cm = minikv_compile(model, snapkv(max_prompt_len=4096, max_new_tokens=512))
    rep = cm.kv_memory()
    assert rep.fp16_bytes == 2 * 32 * 4096 * (4096 + 512) * 2  # 2.4 GB
    assert rep.formula_bytes == 32 * 4096 * (2048 + 512)          # 0.33 GB (paper: 86% smaller)
    assert rep.quantized_region_bytes == rep.formula_bytes + rep.padding_bytes
    assert rep.ring_bytes == 32 * 2 * 32 * 128 * 128 * 2           # 128 fp16 tokens, K and V
    assert rep.total_bytes == rep.quantized_region_bytes + rep.ring_bytes + 32 * 2 * 4
    # The formula alone is 86.1% smaller than fp16 (the paper's figure); the ring the formula
    # leaves out brings the allocation to 83.3% smaller.
    assert rep.formula_bytes / rep.fp16_bytes == pytest.approx(1 - 0.861, abs=5e-4)
    assert rep.ratio == pytest.approx(1 - 0.833, abs=5e-4)


@pytest.mark.parametrize("bad, match", [
    (dict(input_ids=[list(range(65))]), "max_prompt_len"),
    (dict(input_ids=[[1]] * 3), "max_batch_size"),
    (dict(input_ids=[[1, 2]], max_new_tokens=999), "max_new_tokens"),
    (dict(input_ids=[[]]), "expected at least one token"),
    (dict(input_ids=[[1, 500]]), r"\[0, 101\)"),
    (dict(input_ids=[[1]], do_sample=True, temperature=0.0), "temperature"),
    (dict(input_ids=[[1]], do_sample=True, top_p=1.5), "top_p"),
])
def test_bad_requests_raise_and_leave_the_model_usable(bad, match):
    model = tiny()
    cm = minikv_compile(model, snapkv(residual_length=32, max_prompt_len=64, max_new_tokens=16,
                                            max_batch_size=2))
    p = [prompt_of(20)]
    before = cm.generate(p, max_new_tokens=16).sequences
    with pytest.raises(ValueError, match=match):
        cm.generate(**{"max_new_tokens": 8, **bad})
    assert cm.generate(p, max_new_tokens=16).sequences == before


@pytest.mark.parametrize("head_dim,fields", [
    (48, dict(group_size=32)),                         # 48 channels: no groups of 32
    (16, dict(bits=1, group_size=128, residual_length=128)),  # 16 channels: no 1-bit word
])
def test_value_groups_that_do_not_fit_the_head_are_refused(head_dim, fields):
    with pytest.raises(ValueError, match=rf"group_size: expected a divisor of head_dim={head_dim} "
                                         rf"or a size above it .*bits={fields.get('bits', 2)}"):
        minikv_compile(tiny(head_dim=head_dim), snapkv(**fields, max_prompt_len=64))


@pytest.mark.parametrize("cfg, match", [
    (dict(heavy_budget=1.5), "heavy_budget"),
    (dict(recent_budget=-0.1), "recent_budget"),
    (dict(bits=3), "bits"),
    (dict(group_size=8), "group_size"),
    (dict(residual_length=40), "multiple of group_size"),
    (dict(budget_policy="cone"), "budget_policy"),
    (dict(selection="random"), "selection"),
    (dict(max_batch_size=0), "max_batch_size"),
])
def test_invalid_config(cfg, match):
    with pytest.raises(ValueError, match=match):
        snapkv(**cfg)


def test_unsupported_models_and_placements():
    from transformers import GPT2Config

    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(NotImplementedError, match="llama, mistral, qwen2, qwen3"):
        minikv_compile(gpt2)
    with pytest.raises(ValueError, match="dtype"):
        minikv_compile(tiny(dtype=torch.float64))
    with pytest.raises(ValueError, match="CUDA"):
        minikv_compile(tiny(), snapkv(cuda_graphs=True))
    windowed = tiny("mistral")
    windowed.config.sliding_window = 32
    with pytest.raises(NotImplementedError, match="sliding-window"):
        minikv_compile(windowed, snapkv(max_prompt_len=64, max_new_tokens=8))


def test_pyramid_budgets_average_to_the_uniform_budget():
    cfg = snapkv(budget_policy="pyramid", heavy_budget=0.25, pyramid_depth=7)
    fracs = [budget.heavy_fraction(cfg, layer, 30) for layer in range(30)]
    assert fracs[0] == pytest.approx(0.25 * (2 - 1 / 7)) and fracs[-1] == pytest.approx(0.25 / 7)
    assert sum(fracs) / 30 == pytest.approx(0.25)
    assert all(a > b for a, b in zip(fracs, fracs[1:]))


# -- GPU ------------------------------------------------------------------------------------------

@pytest.mark.gpu
# Bucket 1 runs the fused linear layers (norm, gate, residual and RoPE inside the projections).
@pytest.mark.parametrize("lengths", [(9, 120, 64), (120,)], ids=["bucket4", "bucket1"])
def test_gpu_graph_replay_equals_the_step_it_captured_and_is_replayed(lengths):
    model = tiny(dtype=torch.bfloat16, device="cuda")
    n = len(lengths)
    base = dict(residual_length=32, max_prompt_len=128, max_new_tokens=200, max_batch_size=n)
    unreplayed = minikv_compile(model, snapkv(**base, compile=True, cuda_graphs=False))
    graph = minikv_compile(model, snapkv(**base))
    eager = minikv_compile(model, snapkv(**base, compile=False, cuda_graphs=False))
    prompts = [prompt_of(length, seed=length) for length in lengths]
    before = graph.stats["replays"]
    out = graph.generate(prompts, max_new_tokens=200)
    # Replaying the captured graph is the compiled step, bit for bit (199 steps, 6 flushes).
    assert out.sequences == unreplayed.generate(prompts, max_new_tokens=200).sequences
    assert graph.stats["replays"] - before == 199
    # The start, the layer and the choice, no per-step compile; several rows split the norm, and
    # there the first and the last of the 2 layers compile a layer each (the last hands no norm
    # on).
    assert len(graph.stats["graphs"]) == 1 and graph.stats["compiles"] == (4 if n > 1 else 3)
    # Compiled vs eager: inductor fuses bf16 elementwise chains in fp32 and rounds once, eager
    # rounds after every op, so greedy paths of a random model may part; the log-probs of the
    # same tokens must agree to bf16 precision: typically 2**-8 relative on |logp| ~ 2-5 (~0.02).
    # A rounding difference can also flip one 2-bit code (a whole quantization step on one key
    # channel), which is what the max allows for (0.13 seen on the H200 over 600 positions).
    # A wrong kernel or a stale cache entry moves log-probs by O(1).
    diff = torch.cat([(a - b).abs() for a, b in zip(graph.teacher_force(prompts, out.sequences),
                                                     eager.teacher_force(prompts, out.sequences))])
    assert diff.median() < 0.03 and diff.max() < 0.3


@pytest.mark.gpu
def test_gpu_full_cache_matches_hf_logits():
    # On the GPU the attention kernels differ from HF's (bf16 SDPA), so tokens are held to a
    # tolerance: the teacher-forced logits of 32 decode steps within 2e-2 relative (bf16).
    model = tiny(dtype=torch.bfloat16, device="cuda")
    prompt = prompt_of(100)
    cm = minikv_compile(model, snapkv(**FULL, max_prompt_len=128, max_new_tokens=32))
    ours = cm.generate([prompt], max_new_tokens=32).sequences[0]
    ids = torch.tensor([prompt + ours], device="cuda")
    ref = model(ids).logits[0, len(prompt) - 1: -1].float().argmax(-1).tolist()
    agree = sum(a == b for a, b in zip(ours, ref)) / len(ours)
    assert agree >= 0.9


# qwen2: q/k/v biases are fused too; qwen3: its q/k norms keep RoPE out of the fused launch
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_fused_projections_and_chunked_prefill_change_no_result(kind):
    from minikv_compile.models import get_adapter

    model = tiny(kind)
    # Norm weights and eps of their own per norm (HF initializes them all alike), so that a
    # norm's share handed to the wrong launch shows.
    g = torch.Generator().manual_seed(5)
    for i, block in enumerate(model.model.layers):
        for j, norm in enumerate((block.input_layernorm, block.post_attention_layernorm)):
            norm.weight.data = torch.rand(norm.weight.shape, generator=g) + 0.5
            norm.variance_epsilon = 0.01 * (1 + 2 * i + j)
    x = torch.randint(0, 101, (1, 9))
    before = model(x).logits
    plain, fused = get_adapter(model, 64), get_adapter(model, 64, fuse_projections=True)
    h = plain.embed(x)
    cos, sin = plain.rope(h, torch.arange(9)[None])
    for a, b in zip(plain.qkv(1, h, cos, sin), fused.qkv(1, h, cos, sin)):
        assert torch.equal(a, b)
    attn = torch.randn(1, 9, 4 * 64)
    whole = fused.finish_layer(1, h, attn)
    assert torch.equal(plain.finish_layer(1, h, attn), whole)
    whole_qkv = fused.qkv(1, h, cos, sin)
    fused.prefill_chunk = 4  # 9 tokens in chunks of 4, 4, 1: per-token ops, GEMM blocking aside
    torch.testing.assert_close(fused.finish_layer(1, h, attn), whole, rtol=1e-5, atol=1e-5)
    for chunk in (4, 64):  # prefill's form: the chunks written over their own input
        fused.prefill_chunk, own = chunk, h.clone()
        got = fused.finish_layer(1, own, attn, overwrite=True)
        assert (got is own) == (chunk < 9)
        torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-5)
    for a, b in zip(fused.qkv(1, h, cos, sin), whole_qkv):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # Decode steps (one row, or several at their own positions) run ops.fused_linear (norm,
    # RoPE, SiLU-gate and residual inside): on the CPU its reference is the module chain, so the
    # result is the same to the bit; at several rows the post-attention norm (and, with
    # finish_layer_normed, the next layer's input norm) is split over two launches, which moves
    # its roundings: fp32 here, so a few ulps.
    assert fused.fused_decode
    for rows in (slice(4, 5), slice(2, 8)):
        step = h[0, rows, None]                              # (rows, 1, hidden)
        c, s, a_out = cos[0, rows, None], sin[0, rows, None], attn[0, rows, None]
        path = decode_path(fused, rows.stop - rows.start, torch.float32)
        assert path.fused_linear
        for a, b in zip(plain.qkv(1, step, c, s), fused.qkv(1, step, c, s, path=path)):
            assert torch.equal(a, b)
        want = plain.finish_layer(0, step, a_out)
        out, normed = fused.finish_layer_normed(0, step, a_out, path)
        last = fused.layer_weights(0)._replace(next_norm=None)  # nothing handed on: same h
        assert torch.equal(fused.finish_layer_normed(last, step, a_out, path)[0], out)
        if rows.stop - rows.start == 1:
            assert torch.equal(out, want) and normed is None
            continue
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        assert not torch.equal(out, want)  # the split norm did run
        for a, b in zip(plain.qkv(1, out, c, s), fused.qkv(1, out, c, s, normed, path)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert fused.finish_layer_normed(1, step, a_out, path)[1] is None  # the last layer
    plans = {rows: decode_path(fused, rows, torch.bfloat16) for rows in (1, 16, 32, 33)}
    assert [(p.fused_linear, p.split_norm) for p in plans.values()] == [
        (True, False), (True, True), (True, True), (False, False)]  # above FUSED_MAX_ROWS = 32
    assert [plans[r].qkv[0].item() for r in (1, 16)] == [0, 1]  # USE_DOT: FMA at one row
    assert not decode_path(plain, 1, torch.float32).fused_linear
    # fp16 keeps ops.rms_norm: norm.weight * h, rounded before the division, could overflow.
    half = get_adapter(tiny(kind, dtype=torch.float16), 64, fuse_projections=True)
    step, a_out = h[0, 2:8, None].half(), attn[0, 2:8, None].half()
    path = decode_path(half, 6, torch.float16)
    assert path.fused_linear and not path.split_norm
    assert half.finish_layer_normed(0, step, a_out, path)[1] is None
    assert torch.equal(model(x).logits, before)  # the HF model is untouched by the fusion


@pytest.mark.parametrize("V", [101, 256, 1000, 128256])
def test_argmax_rows_is_argmax_ties_included(V):
    from minikv_compile.graphs.sampling import argmax_rows

    g = torch.Generator().manual_seed(V)
    ties = torch.randint(-3, 3, (3, V), generator=g).float()  # the first maximum must win
    ties[1, V // 2:] = 7.0                                     # a maximum spanning slices
    for x in (ties, torch.randn(3, V, generator=g)):
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


@pytest.mark.parametrize("V", [101, 256, 128256])
def test_cumsum_rows_is_cumsum(V):
    from minikv_compile.graphs.sampling import cumsum_rows

    probs = torch.rand(3, V, generator=torch.Generator().manual_seed(V)).softmax(dim=-1)
    # Summed in another order: equal to fp32 rounding of the running total (<= 1).
    torch.testing.assert_close(cumsum_rows(probs), probs.cumsum(dim=-1), rtol=0, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 3])
def test_gpu_sampling_step_compiles_and_replays_with_a_llama3_vocabulary(batch):
    # A 128k vocabulary (Llama 3's) at small batches is where inductor splits a long scan;
    # the sample step must compile, capture and replay there, seeded and exact at top_k=1.
    model = tiny(dtype=torch.bfloat16, device="cuda", vocab_size=128256)
    cm = minikv_compile(model, snapkv(max_prompt_len=64, max_new_tokens=24,
                                            max_batch_size=4))
    prompts = [prompt_of(40 + i, seed=i, vocab=128256) for i in range(batch)]
    greedy = cm.generate(prompts, max_new_tokens=24).sequences
    replays = cm.stats["replays"]
    kw = dict(max_new_tokens=24, do_sample=True, temperature=0.8, top_p=0.9, seed=7)
    first, again = cm.generate(prompts, **kw).sequences, cm.generate(prompts, **kw).sequences
    assert first == again and len(first[0]) == 24
    assert cm.generate(prompts, max_new_tokens=24, do_sample=True, top_k=1).sequences == greedy
    assert cm.stats["replays"] - replays == 3 * 23
