"""Short prompts are not compressed (issue 47, part 1): a prompt the residual ring can hold
stays in it in full precision, nothing evicted, so its tokens are the uncompressed cache's
until generated tokens fill the ring; and the budgets' floor in tokens (``kept_floor``) keeps
every token of a prompt up to that length, for every budget policy.

Tiny random Llama (2 layers, 4 q / 2 KV heads of 64; SmolLM2-135M: 30 layers, 9 / 3 heads of
64), fp32 on the CPU, eager engines built once per module; SmolLM2's real weights where their
converted copy is on this machine.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from minikv_compile import MiniKVConfig, minikv_compile
from minikv_compile.graphs import budget
from minikv_compile.graphs.prefill import prefill
from minikv_compile.models.smollm2 import default_cache_root
from configs import snapkv
from reference_pipeline import ReferenceMiniKV

R = MiniKVConfig().residual_length  # 128: the default ring
VOCAB = 101


def tiny():
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=1024, initializer_range=0.1)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.generation_config.eos_token_id = None  # exactly the tokens asked for
    return model


def random_prompts(seed: int, lengths):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def model():
    return tiny()


# Random lengths up to the ring, and as many new tokens as keep the longest one exact: the
# ring holds the prompt and every generated token written before the step that flushes it
# (token n is written by step n - 1, so L + n - 1 <= R).
LENGTHS = [1, 17, 64] + sorted(torch.randint(2, R - 8, (2,), generator=torch.Generator()
                                             .manual_seed(47)).tolist()) + [R - 8]
NEW = 9  # (R - 8) + 9 - 1 = R
CAP = dict(max_prompt_len=2 * R, max_new_tokens=2 * R, max_batch_size=len(LENGTHS))


@pytest.fixture(scope="module")
def full_tokens(model):
    """The uncompressed cache's greedy tokens (bits=16, nothing evicted), which are HF's."""
    prompts = random_prompts(0, LENGTHS)
    full = minikv_compile(model, MiniKVConfig(bits=16, heavy_budget=1.0, recent_budget=1.0, **CAP))
    got = full.generate(prompts, max_new_tokens=NEW).sequences
    assert got == [hf_greedy(model, p, NEW) for p in prompts]
    return prompts, got


@pytest.mark.parametrize("fields", [
    dict(),                                               # the library's default
    dict(preset="minikv"),                                # the paper's MiniKV
    dict(budget_policy="pyramid", bits=4, heavy_budget=0.05, recent_budget=0.05),  # 10% kept
    dict(bits=1, group_size=32),
    dict(heavy_budget=0.0, recent_budget=0.0, bits=16),   # budgets that keep nothing
    dict(preset="accurate"),                              # group 64, Hadamard, recall
])
def test_prompts_the_ring_holds_give_the_uncompressed_tokens(model, full_tokens, fields):
    fields = dict(fields)
    name = fields.pop("preset", None)
    config = (MiniKVConfig.preset(name, **fields, **CAP) if name
              else MiniKVConfig(**fields, **CAP))
    prompts, full = full_tokens
    cm = minikv_compile(model, config)
    assert cm.generate(prompts, max_new_tokens=NEW).sequences == full


def test_the_ring_holds_the_whole_prompt_after_prefill(model):
    """White box: every layer's counters after prefill are (0, L) and its ring rows are the
    prompt's keys and values, unquantized (the uncompressed cache's region holds the same)."""
    config = snapkv(max_prompt_len=2 * R, max_new_tokens=8, max_batch_size=2)
    full_cfg = MiniKVConfig(bits=16, heavy_budget=1.0, recent_budget=1.0, residual_length=16,
                            group_size=16, max_prompt_len=2 * R, max_new_tokens=8,
                            max_batch_size=2)
    cm, full = minikv_compile(model, config), minikv_compile(model, full_cfg)
    prompt = torch.tensor(random_prompts(1, [R])[0])
    with torch.inference_mode():
        prefill(cm.adapter, cm.runtime.cache, [config], [1], [prompt])
        prefill(full.adapter, full.runtime.cache, [full_cfg], [1], [prompt])
    for mine, theirs in zip(cm.runtime.cache.layers, full.runtime.cache.layers):
        assert mine.lens[1].tolist() == [0, R]
        assert theirs.lens[1].tolist() == [R, 0]  # a 16-token ring: all in the 16-bit region
        assert torch.equal(mine.k_ring[1, :, :R], theirs.k_cache[1, :, :R])
        assert torch.equal(mine.v_ring[1, :, :R], theirs.v_cache[1, :, :R])


def test_a_longer_prompt_leaves_about_half_a_ring_of_its_tail(model):
    """Past the ring: the last t kept tokens stay in it, 64 <= t < 80 (half the ring, whole
    groups before them in the region), nothing evicted below the floor; the ring's rows are the
    prompt's last t keys, the region's the first ones quantized."""
    config = snapkv(max_prompt_len=2 * R + 64, max_new_tokens=8)
    full_cfg = MiniKVConfig(bits=16, heavy_budget=1.0, recent_budget=1.0, residual_length=16,
                            group_size=16, max_prompt_len=2 * R + 64, max_new_tokens=8)
    cm, full = minikv_compile(model, config), minikv_compile(model, full_cfg)
    for L, prompt in zip([R + 1, R + 15, R + 16, 200, 300],
                         random_prompts(2, [R + 1, R + 15, R + 16, 200, 300])):
        with torch.inference_mode():
            prefill(cm.adapter, cm.runtime.cache, [config], [0], [torch.tensor(prompt)])
            prefill(full.adapter, full.runtime.cache, [full_cfg], [0], [torch.tensor(prompt)])
        for mine, theirs in zip(cm.runtime.cache.layers, full.runtime.cache.layers):
            n_quant, n_ring = mine.lens[0].tolist()
            assert n_quant + n_ring == L and n_quant % 16 == 0, (L, n_quant, n_ring)
            assert R // 2 <= n_ring < R // 2 + 16, (L, n_ring)
            assert n_ring == budget.prefill_ring_tokens(config, L)
            # the 16-bit cache (a 16-token ring) holds all but L mod 16 in its region
            keys = torch.cat([theirs.k_cache[0, :, :L // 16 * 16], theirs.k_ring[0, :, :L % 16]], 1)
            assert torch.equal(mine.k_ring[0, :, :n_ring], keys[:, n_quant:])


# -- the floor -----------------------------------------------------------------------------------

BUDGETS = [(0.25, 0.25), (0.0, 0.1), (0.3, 0.0), (0.0, 0.0), (0.02, 0.9), (1.0, 1.0)]


@pytest.mark.parametrize("policy", ["uniform", "pyramid"])
@pytest.mark.parametrize("heavy, recent", BUDGETS)
def test_below_the_floor_nothing_is_evicted(policy, heavy, recent):
    layers, floor = 7, 96
    config = snapkv(heavy_budget=heavy, recent_budget=recent, budget_policy=policy,
                          pyramid_depth=3, kept_floor=floor, max_prompt_len=400, max_new_tokens=5)
    previous = [0] * layers
    for L in range(1, 401):
        for layer in range(layers):
            n_rw, n_hh = budget.kept_tokens(config, L, layer, layers)
            kept = n_rw + n_hh
            assert n_rw >= 0 and n_hh >= 0 and kept <= L
            # the budgets' own count, from docs/algorithm.md ("Budgets")
            a = budget.heavy_fraction(config, layer, layers)
            own = min(L, math.ceil(recent * L - 1e-9)) + round(a * L)
            if L <= floor:
                assert kept == L, (L, layer)
            else:
                assert kept == max(floor, min(L, own)), (L, layer)
            assert kept >= previous[layer]  # non-decreasing in L: capacities hold the longest
            previous[layer] = kept
    caps = budget.capacities(config, layers)
    assert caps == [math.ceil((k + 5) / 16) * 16 for k in previous]


def test_the_floor_shares_its_tokens_in_the_budgets_ratio():
    config = snapkv(heavy_budget=0.1, recent_budget=0.3, kept_floor=1000)
    assert budget.kept_tokens(config, 2000, 0, 1) == (750, 250)   # 40% of 2000 = 800 < 1000
    assert budget.kept_tokens(config, 4000, 0, 1) == (1200, 400)  # the budgets' own 1600
    assert budget.kept_tokens(snapkv(heavy_budget=0.0, recent_budget=0.0, kept_floor=8),
                              50, 0, 1) == (8, 0)


def test_an_evicting_config_below_the_floor_is_the_same_cache_without_eviction(model):
    """End to end, past the ring (a 16-token ring): a prompt up to the floor gives the tokens
    of the same cache with budgets that keep everything; past the floor, the plain reference
    with the floor's count (shared 50 / 50 here)."""
    base = dict(selection="h2o", snapkv_kernel=7, selection_block=1, sink_tokens=0,
                residual_length=16, kept_floor=80, max_prompt_len=128, max_new_tokens=40)
    evicting = minikv_compile(model, snapkv(**base))
    whole = minikv_compile(model, snapkv(**base, heavy_budget=1.0, recent_budget=1.0))
    short, longer = random_prompts(3, [80, 120])
    assert evicting.generate([short], max_new_tokens=40).sequences == \
        whole.generate([short], max_new_tokens=40).sequences
    got = evicting.generate([longer], max_new_tokens=40).sequences[0]
    ref = ReferenceMiniKV(model, heavy=0.25, recent=0.25, bits=2, group=16, ring=16,
                          kept_floor=80)
    assert got == ref.generate(longer, 40)  # 120 tokens, 80 kept: 40 recent + 40 heavy
    assert got != whole.generate([longer], max_new_tokens=40).sequences[0]  # it did evict


def test_ring_tokens_after_follows_the_decode_steps_flushes():
    config = snapkv(residual_length=32, max_prompt_len=128, max_new_tokens=100,
                          kept_floor=1)
    for kept, written in itertools.product([1, 5, 31, 32, 33, 47, 64, 100], [0, 1, 31, 32, 33, 95]):
        t = budget.prefill_ring_tokens(config, kept)
        assert 0 <= t <= 32 and (kept - t) % 16 == 0
        assert t == (kept if kept <= 32 else 16 + (kept - 16) % 16)
        ring = t
        for _ in range(written):  # the decode step: flush a full ring, then write
            ring = 1 if ring == 32 else ring + 1
        assert budget.ring_tokens_after(config, kept, written) == ring


# -- SmolLM2 ------------------------------------------------------------------------------------

_CONVERTED = default_cache_root() / "smollm2-135m-instruct" / "config.json"
QUESTIONS = ["What is the capital of France?", "Name three colors.", "What is 12 times 12?"]


@pytest.mark.skipif(not _CONVERTED.is_file() and not os.environ.get("MINIKV_SMOLLM2_GGUF"),
                    reason="SmolLM2's weights are not on this machine (no converted copy in "
                           f"{_CONVERTED.parent}, no $MINIKV_SMOLLM2_GGUF); the tests never "
                           "download them")
def test_smollm2_short_questions_get_the_uncompressed_answers():
    from minikv_compile.models.smollm2 import load_smollm2
    model, tok = load_smollm2(dtype=torch.float32)
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": q}],
                                            add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]) for q in QUESTIONS]
    assert all(len(p) + 40 - 1 <= R for p in prompts), [len(p) for p in prompts]
    cap = dict(max_prompt_len=256, max_new_tokens=40, max_batch_size=3)
    full = minikv_compile(model, MiniKVConfig(bits=16, heavy_budget=1.0, recent_budget=1.0, **cap))
    default = minikv_compile(model, MiniKVConfig(**cap))
    want = full.generate(prompts, max_new_tokens=40, eos_token_id=tok.eos_token_id).sequences
    for p, w in zip(prompts, want):
        ids = torch.tensor([p])
        hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40,
                            do_sample=False, eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.eos_token_id)[0, len(p):].tolist()
        assert hf == w
    assert default.generate(prompts, max_new_tokens=40,
                            eos_token_id=tok.eos_token_id).sequences == want
    assert "Paris" in tok.decode(want[0])
