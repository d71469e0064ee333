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
from configs import snapkv
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


@pytest.mark.parametrize("value", ["hadamard ", "Hadamard", "walsh", 1, True])
def test_bad_rotation_raises_naming_the_field(value):
    with pytest.raises(ValueError, match="rotation"):
        snapkv(rotation=value)


def test_rotation_defaults_by_bits():
    """None (the default) rotates a quantized cache and leaves a 16-bit one alone."""
    assert MiniKVConfig().rotation == "hadamard" and MiniKVConfig(bits=4).rotation == "hadamard"
    assert MiniKVConfig(bits=16).rotation == "none"
    assert MiniKVConfig(rotation="none").rotation == "none"


def test_head_dim_not_a_power_of_two_raises():
    model = tiny(head_dim=48)  # 48 = 3 groups of 16: the group_size check alone would pass
    with pytest.raises(ValueError, match="rotation='hadamard'.*power of two, got 48; pass "
                                         "rotation='none'"):
        minikv_compile(model, MiniKVConfig(group_size=16, max_prompt_len=64, max_new_tokens=8))
    minikv_compile(model, snapkv(group_size=16, rotation="none", max_prompt_len=64,
                                       max_new_tokens=8))  # no rotation: fine


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])  # qwen2: v bias; qwen3: q/k norm
def test_full_cache_with_rotation_reproduces_hf_greedy(kind):
    model = tiny(kind)
    cfg = snapkv(**FULL, rotation="hadamard", residual_length=32, max_prompt_len=64,
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
    plain = minikv_compile(model, snapkv(**base)).teacher_force([prompt], [targets])[0]
    rotated = minikv_compile(model, snapkv(**base, rotation="hadamard")
                             ).teacher_force([prompt], [targets])[0]
    torch.testing.assert_close(rotated, plain, atol=2e-5, rtol=1e-5)


def test_two_bit_rotated_engine_runs_and_differs():
    """At 2 bits the rotation changes what is quantized (so the answer may change)."""
    model = tiny()
    prompt, targets = prompt_of(101, seed=3), prompt_of(70, seed=4)
    base = dict(residual_length=32, max_prompt_len=128, max_new_tokens=70)
    plain = minikv_compile(model, snapkv(**base)).teacher_force([prompt], [targets])[0]
    rotated = minikv_compile(model, snapkv(**base, rotation="hadamard")
                             ).teacher_force([prompt], [targets])[0]
    assert torch.isfinite(rotated).all() and not torch.equal(rotated, plain)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_users_model_is_unchanged(kind):
    model = tiny(kind)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    cm = minikv_compile(model, snapkv(rotation="hadamard", residual_length=32,
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


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: q/k/v biases fused too
def test_a_second_fused_adapter_shares_the_first_ones_weights(kind):
    """A second engine on one model takes the fused tensors the first one made (no copy: a
    70B shard had no room for one); a rotated second engine rotates a copy of [q; k; v] and
    leaves the first engine's tensors and the user's modules as they were."""
    model = tiny(kind)
    ref_model = copy.deepcopy(model)
    first = get_adapter(model, 64, fuse_projections=True)
    qkv = [f["qkv"][0].clone() for f in first.fused]
    second = get_adapter(model, 64, fuse_projections=True)
    for a, b in zip(first.fused, second.fused):
        assert not a["shared"] and b["shared"]
        for key in ("qkv", "gate_up"):
            for x, y in zip(a[key], b[key]):
                assert (x is None) == (y is None)
                if x is not None:
                    assert x.data_ptr() == y.data_ptr() and torch.equal(x, y)
    rotated = get_adapter(model, 64, fuse_projections=True)
    rotated.rotate_heads("hadamard")
    ref = get_adapter(ref_model, 64, fuse_projections=True)  # the same, on a model of its own
    ref.rotate_heads("hadamard")
    for f, saved in zip(first.fused, qkv):
        assert torch.equal(f["qkv"][0], saved)
    for a, b in zip(model.model.layers, ref_model.model.layers):
        assert torch.equal(a.self_attn.v_proj.weight, b.self_attn.v_proj.weight)
    h = torch.randn(1, 9, 128)
    cos, sin = ref.rope(h, torch.arange(9)[None])
    for layer in range(ref.num_layers):
        for x, y in zip(rotated.qkv(layer, h, cos, sin), ref.qkv(layer, h, cos, sin)):
            assert torch.equal(x, y)


def test_compiled_rotated_step_equals_eager():
    # The q/k rotation runs inside the compiled layers (CPU inductor here): greedy tokens at
    # batch 1 and sampled ones at a dynamic batch size (bucket 4) equal the eager engine's.
    # (Each mode at one batch size: the rotation is in the layer, which both modes share; the
    # two other (batch, mode) pairs cost two compiles of the choice and test nothing more.)
    model = tiny()
    base = dict(residual_length=32, max_prompt_len=128, max_new_tokens=30, max_batch_size=4,
                rotation="hadamard")
    compiled = minikv_compile(model, snapkv(**base, compile=True))
    eager = minikv_compile(model, snapkv(**base, compile=False))
    for n, kw in ((1, dict()), (3, dict(do_sample=True, seed=3))):
        prompts = [prompt_of(60 + 17 * i, seed=i) for i in range(n)]
        assert (compiled.generate(prompts, max_new_tokens=30, **kw).sequences
                == eager.generate(prompts, max_new_tokens=30, **kw).sequences)
    # the start, the layer and the choice at 1 (greedy) and at 2..4 (sample): no plan of this
    # CPU model splits the norm, so every layer is one kind of call
    assert compiled.stats["compiles"] == 6


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


# -- minikv::hadamard_heads ------------------------------------------------------------------------

from minikv_compile.ops import hadamard_heads  # noqa: E402
from minikv_compile.ops.rotation import _hadamard_heads_triton, hadamard_heads_ref  # noqa: E402

ULP = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 2.0 ** -20}


def _heads_oracle(x: torch.Tensor, D: int, rotated: int) -> torch.Tensor:
    """float64, one head at a time, against the Sylvester matrix built here."""
    S = torch.ones(1, 1, dtype=torch.float64)
    while S.shape[0] < D:
        S = torch.cat([torch.cat([S, S], 1), torch.cat([S, -S], 1)])
    y = x.double().clone()
    for m in range(x.shape[0]):
        for i in range(rotated // D):
            y[m, i * D:(i + 1) * D] = x[m, i * D:(i + 1) * D].double() @ S / D ** 0.5
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("impl", ["ref", pytest.param("triton", marks=pytest.mark.interpret)])
@pytest.mark.parametrize("M,D,heads,rotated_heads", [(1, 16, 5, 4), (3, 32, 3, 3), (17, 64, 4, 2),
                                                     (2, 256, 2, 1)])  # 256: two column tiles
def test_hadamard_heads_matches_the_oracle(impl, dtype, M, D, heads, rotated_heads):
    # a column slice of wider rows (the [q; k] of a fused [q; k; v] row) as the input
    wide = torch.randn(M, heads * D + 24, generator=torch.Generator().manual_seed(M)).to(dtype)
    x = wide[:, 8: 8 + heads * D]
    rotated = rotated_heads * D
    y = (hadamard_heads_ref if impl == "ref" else _hadamard_heads_triton)(x, D, rotated)
    assert y.shape == x.shape and y.dtype == dtype and y.is_contiguous()
    want = _heads_oracle(x, D, rotated)
    # one rounding to the output dtype after fp32 sums of D exact products
    torch.testing.assert_close(y[:, :rotated].double(), want[:, :rotated], rtol=ULP[dtype],
                               atol=ULP[dtype] * D ** 0.5)
    assert torch.equal(y[:, rotated:], x[:, rotated:])  # the rest copied bit for bit


def test_hadamard_heads_twice_is_identity():
    x = torch.randn(4, 256)
    torch.testing.assert_close(hadamard_heads(hadamard_heads(x, 128), 128), x, rtol=0, atol=1e-5)


@pytest.mark.parametrize("args,match", [
    ((torch.randn(2, 64).t(), 16), "x: expected unit stride"),
    ((torch.randn(2, 72), 24), r"head_dim: expected one of \(16, 32, 64, 128, 256\), got 24"),
    ((torch.randn(2, 64), 16, 24), r"rotated: expected a multiple of head_dim=16 in "
                                   r"\[16, 64\] \(x's columns\), got 24"),
    ((torch.randn(2, 64), 16, 80), "got 80"),
    ((torch.randn(2, 64).int(), 16), "x: expected dtype"),
])
def test_hadamard_heads_bad_inputs(args, match):
    with pytest.raises(ValueError, match=match):
        hadamard_heads(*args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_hadamard_heads_head_dim_256(dtype):
    x = torch.randn(5, 4 * 256, device="cuda").to(dtype)
    y = hadamard_heads(x, 256, 3 * 256)
    torch.testing.assert_close(y.cpu().double(), _heads_oracle(x.cpu(), 256, 3 * 256),
                               rtol=ULP[dtype], atol=ULP[dtype] * 16)


def test_hadamard_heads_opcheck():
    torch.library.opcheck(torch.ops.minikv.hadamard_heads.default, (torch.randn(3, 96), 32, 64))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("M", [1, 8, 64])
def test_gpu_hadamard_heads_llama3_qkv(M, dtype):
    # Llama-3-8B's fused [q; k; v] row: 32 + 8 heads rotated, 8 copied
    qkv = torch.randn(M, 48 * 128, device="cuda").to(dtype)
    y = hadamard_heads(qkv, 128, 40 * 128)
    want = _heads_oracle(qkv.cpu(), 128, 40 * 128)
    torch.testing.assert_close(y.cpu().double(), want, rtol=ULP[dtype], atol=ULP[dtype] * 128 ** 0.5)
    assert torch.equal(y[:, 40 * 128:], qkv[:, 40 * 128:])
    torch.library.opcheck(torch.ops.minikv.hadamard_heads.default, (qkv, 128, 40 * 128))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama", "qwen3"])  # RoPE in the projection's epilogue / after
def test_gpu_rotation_changes_no_logit_at_16_bits(kind):
    """The CUDA decode step (fused projections, the rotation of q and k in one launch) against
    the same engine without rotation: the log-probs agree to bf16 rounding."""
    model = tiny(kind, dtype=torch.bfloat16, device="cuda")
    prompt, targets = prompt_of(61, seed=2), prompt_of(40, seed=5)
    base = dict(bits=16, heavy_budget=1.0, recent_budget=1.0, residual_length=32,
                max_prompt_len=64, max_new_tokens=40)
    plain = minikv_compile(model, snapkv(**base)).teacher_force([prompt], [targets])[0]
    rotated = minikv_compile(model, snapkv(**base, rotation="hadamard")
                             ).teacher_force([prompt], [targets])[0]
    assert (rotated - plain).abs().max() < 0.05


def test_hadamard_heads_kernel_compiles_for_sm90():
    # tensor-core dot in bf16 / fp16 at D 64 / 128 (one column tile), 256 (two), fp32 (ieee)
    from aot import compile_for_sm90
    compile_for_sm90("""
from minikv_compile.ops import rotation as r
for dt, D in (("bf16", 128), ("fp16", 64), ("bf16", 256), ("fp32", 128)):
    build(r._hadamard_heads_kernel, {"x_ptr": "*" + dt, "y_ptr": "*" + dt, "M": "i32", "K": "i32",
          "ROT": "i32", "stride_xm": "i32", "inv_sqrt_d": "fp32"},
          dict(D=D, BLOCK_N=min(D, 128), BLOCK_R=16, BLOCK_C=1024, PDL=True, INTERPRET=False))
""")
