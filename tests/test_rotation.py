"""``MiniKVConfig.rotation="hadamard"``: q/k rotated after RoPE, v and the attention output
rotated through folded weights (issue 25). Tiny random HF models as in test_engine.py
(SmolLM2-135M: head dim 64, Llama-3.1-8B: 128)."""
from __future__ import annotations

import copy

import pytest
import torch

from minikv_compile import MiniKVConfig, minikv_compile
from minikv_compile.models import get_adapter
from minikv_compile.models.llama import hadamard_matrix
from test_engine import FULL, hf_greedy, prompt_of, tiny


@pytest.mark.parametrize("n", [1, 2, 4, 16, 64, 128, 256])
def test_hadamard_is_orthonormal(n):
    H = hadamard_matrix(n)
    assert H.shape == (n, n) and H.dtype == torch.float32
    torch.testing.assert_close(H @ H.T, torch.eye(n), atol=1e-6, rtol=0)
    assert torch.equal(H.abs(), torch.full((n, n), n ** -0.5))


@pytest.mark.parametrize("n", [0, 3, 48, 96, 80])
def test_hadamard_needs_a_power_of_two(n):
    with pytest.raises(ValueError, match="power of two"):
        hadamard_matrix(n)


def test_rotated_keys_give_the_same_scores():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, 7, 64, generator=g), torch.randn(3, 11, 64, generator=g)
    k[..., 5] += 40.0  # an outlier channel, what the rotation is for
    H = hadamard_matrix(64)
    torch.testing.assert_close((q @ H) @ (k @ H).transpose(1, 2), q @ k.transpose(1, 2),
                               atol=1e-3, rtol=1e-5)
    # and the outlier is spread: every channel of the rotated key carries 1/8 of it (5 + noise)
    assert (k @ H).abs().amax(dim=-1).mean() < k.abs().amax(dim=-1).mean() / 4


@pytest.mark.parametrize("value", ["hadamard ", "Hadamard", "walsh", 1, None, True])
def test_bad_rotation_raises_naming_the_field(value):
    with pytest.raises(ValueError, match="rotation"):
        MiniKVConfig(rotation=value)


def test_head_dim_not_a_power_of_two_raises():
    model = tiny(head_dim=48)  # 48 = 3 groups of 16: the group_size check alone would pass
    with pytest.raises(ValueError, match="rotation='hadamard'.*power of two, got 48"):
        minikv_compile(model, MiniKVConfig(rotation="hadamard", max_prompt_len=64, max_new_tokens=8))
    minikv_compile(model, MiniKVConfig(max_prompt_len=64, max_new_tokens=8))  # no rotation: fine


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])  # qwen2: v bias; qwen3: q/k norm
def test_full_cache_with_rotation_reproduces_hf_greedy(kind):
    model = tiny(kind)
    cfg = MiniKVConfig(**FULL, rotation="hadamard", residual_length=32, max_prompt_len=64,
                       max_new_tokens=48)
    prompt = prompt_of(37)
    got = minikv_compile(model, cfg).generate([prompt], max_new_tokens=48).sequences[0]
    assert got == hf_greedy(model, prompt, 48)


@pytest.mark.parametrize("budgets", [dict(heavy_budget=1.0, recent_budget=1.0),
                                     dict(heavy_budget=0.25, recent_budget=0.25)])
def test_rotation_changes_no_logit_at_16_bits(budgets):
    """Scores, selection and attention are the same up to fp32 rounding, eviction included."""
    model = tiny("qwen2")
    prompt, targets = prompt_of(61, seed=2), prompt_of(40, seed=5)
    base = dict(bits=16, residual_length=32, max_prompt_len=64, max_new_tokens=40, **budgets)
    plain = minikv_compile(model, MiniKVConfig(**base)).teacher_force([prompt], [targets])[0]
    rotated = minikv_compile(model, MiniKVConfig(**base, rotation="hadamard")
                             ).teacher_force([prompt], [targets])[0]
    torch.testing.assert_close(rotated, plain, atol=2e-5, rtol=1e-5)


def test_two_bit_rotated_engine_runs_and_differs():
    """At 2 bits the rotation changes what is quantized (so the answer may change)."""
    model = tiny()
    prompt, targets = prompt_of(101, seed=3), prompt_of(70, seed=4)
    base = dict(residual_length=32, max_prompt_len=128, max_new_tokens=70)
    plain = minikv_compile(model, MiniKVConfig(**base)).teacher_force([prompt], [targets])[0]
    rotated = minikv_compile(model, MiniKVConfig(**base, rotation="hadamard")
                             ).teacher_force([prompt], [targets])[0]
    assert torch.isfinite(rotated).all() and not torch.equal(rotated, plain)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_users_model_is_unchanged(kind):
    model = tiny(kind)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    cm = minikv_compile(model, MiniKVConfig(rotation="hadamard", residual_length=32,
                                            max_prompt_len=64, max_new_tokens=8))
    cm.generate([prompt_of(40)], max_new_tokens=8)
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[n], after[n]) for n in before)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_fused_projections_fold_like_the_modules(kind):
    """The CUDA layout (fused [q; k; v], built in place) on the CPU, through the prefill
    branches that do not need a GPU: the same q, k, v and layer output as the modules' path,
    and the model's own v_proj keeps its unrotated weights."""
    model = tiny(kind)
    fused_model = copy.deepcopy(model)
    v_before = [b.self_attn.v_proj.weight.clone() for b in fused_model.model.layers]
    plain = get_adapter(model, 64)
    fused = get_adapter(fused_model, 64, fuse_projections=True)
    for a in (plain, fused):
        a.rotate_heads("hadamard")
    for block, v in zip(fused_model.model.layers, v_before):
        assert torch.equal(block.self_attn.v_proj.weight, v)
    h = torch.randn(1, 9, 128)
    cos, sin = plain.rope(h, torch.arange(9)[None])
    for layer in range(plain.num_layers):
        for x, y in zip(plain.qkv(layer, h, cos, sin), fused.qkv(layer, h, cos, sin)):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
        attn = torch.randn(1, 9, 4 * 64)
        torch.testing.assert_close(plain.finish_layer(layer, h, attn),
                                   fused.finish_layer(layer, h, attn), atol=1e-5, rtol=1e-5)
    fused.unfuse()
    for block, v in zip(fused_model.model.layers, v_before):
        assert torch.equal(block.self_attn.v_proj.weight, v)


def test_compiled_rotated_step_equals_eager():
    # The q/k rotation runs inside the compiled layers (CPU inductor here): greedy and sampled
    # tokens equal the eager engine's, at batch 1 and at a dynamic batch size (bucket 4).
    model = tiny()
    base = dict(residual_length=32, max_prompt_len=128, max_new_tokens=30, max_batch_size=4,
                rotation="hadamard")
    compiled = minikv_compile(model, MiniKVConfig(**base, compile=True))
    eager = minikv_compile(model, MiniKVConfig(**base, compile=False))
    for n in (1, 3):
        prompts = [prompt_of(60 + 17 * i, seed=i) for i in range(n)]
        for kw in (dict(), dict(do_sample=True, seed=3)):
            assert (compiled.generate(prompts, max_new_tokens=30, **kw).sequences
                    == eager.generate(prompts, max_new_tokens=30, **kw).sequences)
    # the start and the layer at 1 and 2..4, the choice per mode at each
    assert compiled.stats["compiles"] == 8


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_unfused_after_rotation_computes_what_the_fused_did(kind):
    # unfuse_projections() on a rotated engine: the modules' path must keep the folded v rows
    # (they lived in the fused tensor only); the user's v_proj stays unrotated.
    model = tiny(kind)
    fused_model = copy.deepcopy(model)
    plain = get_adapter(model, 64)
    fused = get_adapter(fused_model, 64, fuse_projections=True)
    for a in (plain, fused):
        a.rotate_heads("hadamard")
    fused.unfuse()
    h = torch.randn(1, 9, 128)
    cos, sin = plain.rope(h, torch.arange(9)[None])
    for layer in range(plain.num_layers):
        for x, y in zip(plain.qkv(layer, h, cos, sin), fused.qkv(layer, h, cos, sin)):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    for a, b in zip(model.model.layers, fused_model.model.layers):
        assert torch.equal(a.self_attn.v_proj.weight, b.self_attn.v_proj.weight)
