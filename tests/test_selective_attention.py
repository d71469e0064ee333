"""selective_attention: causal attention output plus per-key cumulative scores.

Every implementation is checked against an independent fp64 computation (the full causal
softmax matrix, column sums). Output accuracy follows flash-attention's rule: the error against
fp64 is at most twice that of a same-precision PyTorch attention, plus one unit of rounding of
the output dtype. Scores are fp32 everywhere and held to a relative tolerance.
"""
import math
import os

import pytest
import torch
import torch.nn.functional as F

from minikv_compile.ops import causal_attention, selective_attention
from minikv_compile.ops.attention_prefill import (
    SUPPORTED_HEAD_DIMS,
    _PassConfig,
    _selective_attention_chunked,
    _selective_attention_triton,
    selective_attention_ref,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(
    not INTERPRET, reason="Triton on CPU tensors needs TRITON_INTERPRET=1"
)

# Scores are sums of fp32 probabilities. CPU paths compute them in fp32 with the exact exp:
# 1e-4 relative covers the fp32 rounding of the logits. The GPU kernels use ex2.approx and
# recompute q k^T in pass 2 with another tile order: 1e-3 relative.
SCORES_RTOL_CPU = 1e-4
SCORES_RTOL_GPU = 1e-3
SCORES_ATOL = 1e-6


# ---------------------------------------------------------------------------------------------
# Independent references
# ---------------------------------------------------------------------------------------------

def _attention_fp64(q, k, v, scale):
    """Plain causal softmax in float64, one query head at a time (bounded memory on GPU).

    Returns out (B, H_q, L, D) and scores (B, H_kv, L), both float64.
    """
    B, H_q, L, D = q.shape
    H_kv = k.shape[1]
    group = H_q // H_kv
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    scores = torch.zeros((B, H_kv, L), dtype=torch.float64, device=q.device)
    for i in range(H_q):
        kk, vv = k[:, i // group].double(), v[:, i // group].double()
        s = q[:, i].double() @ kk.transpose(-1, -2) * scale
        p = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
        out[:, i] = p @ vv
        scores[:, i // group] += p.sum(dim=1)
    return out, scores


def _attention_same_precision(q, k, v, scale):
    """What a plain PyTorch attention in the input dtype gives: logits and P @ V in that dtype,
    softmax in fp32 (flash-attention's "PyTorch, no upcast" baseline)."""
    H_q, L = q.shape[1], q.shape[2]
    group = H_q // k.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    out = torch.empty_like(q)
    for i in range(H_q):
        s = (q[:, i] @ k[:, i // group].transpose(-1, -2)) * scale
        p = torch.softmax(s.float().masked_fill(~causal, float("-inf")), dim=-1)
        out[:, i] = p.to(q.dtype) @ v[:, i // group]
    return out


def _assert_out_within_2x(out, out_pt, out_64):
    """flash-attention's standard: |out - fp64| <= 2 |same-precision PyTorch - fp64| + 1 ulp."""
    err = (out.double() - out_64).abs().max().item()
    err_pt = (out_pt.double() - out_64).abs().max().item()
    ulp = torch.finfo(out.dtype).eps * out_64.abs().max().item()
    assert err <= 2 * err_pt + ulp, f"max error {err:.3g} vs PyTorch same precision {err_pt:.3g}"


def _assert_scores_close(scores, scores_64, rtol):
    assert scores.dtype == torch.float32
    torch.testing.assert_close(scores.double(), scores_64, rtol=rtol, atol=SCORES_ATOL)


def _inputs(B, H_q, H_kv, L, D, dtype, device="cpu", outlier_channels=0):
    q = torch.randn(B, H_q, L, D, dtype=dtype, device=device)
    k = torch.randn(B, H_kv, L, D, dtype=dtype, device=device)
    v = torch.randn(B, H_kv, L, D, dtype=dtype, device=device)
    if outlier_channels:
        # Real keys after RoPE carry a few channels tens of times larger than the rest; the
        # logits then reach the hundreds and the softmax is nearly one-hot: only a running max
        # keeps exp2 finite.
        k[..., :outlier_channels] *= 40
        q[..., :outlier_channels] *= 4
    return q, k, v


# ---------------------------------------------------------------------------------------------
# CPU: reference and chunked implementation
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "B, H_q, H_kv, L, D", [(2, 4, 4, 33, 64), (1, 9, 3, 123, 64), (2, 8, 2, 5, 128)]
)
def test_reference_matches_fp64(B, H_q, H_kv, L, D, dtype):
    q, k, v = _inputs(B, H_q, H_kv, L, D, dtype)
    scale = 1 / math.sqrt(D)
    out_64, scores_64 = _attention_fp64(q, k, v, scale)
    out, scores = selective_attention_ref(q, k, v)
    assert out.dtype == dtype and out.shape == q.shape
    _assert_out_within_2x(out, _attention_same_precision(q, k, v, scale), out_64)
    _assert_scores_close(scores, scores_64, SCORES_RTOL_CPU)


@pytest.mark.parametrize("query_chunk", [1, 7, 64, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_matches_reference(query_chunk, dtype):
    q, k, v = _inputs(2, 6, 2, 150, 64, dtype)
    out, scores = _selective_attention_chunked(q, k, v, 0.125, query_chunk)
    out_ref, scores_ref = selective_attention_ref(q, k, v, 0.125)
    assert out.dtype == dtype and out.shape == q.shape and scores.shape == (2, 2, 150)
    # Same fp32 math in another order: fp32 outputs agree to rounding, 16-bit ones to one ulp.
    atol = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps * 4
    torch.testing.assert_close(out, out_ref, rtol=0, atol=atol)
    torch.testing.assert_close(scores, scores_ref, rtol=1e-5, atol=1e-6)


def test_op_on_cpu_runs_chunked_path():
    q, k, v = _inputs(1, 4, 2, 70, 32, torch.float32)
    out, scores = selective_attention(q, k, v, scale=0.3)
    out_c, scores_c = _selective_attention_chunked(q, k, v, 0.3)
    torch.testing.assert_close(out, out_c, rtol=0, atol=0)
    torch.testing.assert_close(scores, scores_c, rtol=0, atol=0)


@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_outlier_key_channels(impl):
    q, k, v = _inputs(1, 6, 2, 96, 64, torch.float16, outlier_channels=3)
    scale = 1 / math.sqrt(64)
    if impl == "reference":
        out, scores = selective_attention_ref(q, k, v, scale)
    else:
        out, scores = _selective_attention_chunked(q, k, v, scale, 16)
    out_64, scores_64 = _attention_fp64(q, k, v, scale)
    assert torch.isfinite(out).all() and torch.isfinite(scores).all()
    _assert_out_within_2x(out, _attention_same_precision(q, k, v, scale), out_64)
    _assert_scores_close(scores, scores_64, SCORES_RTOL_CPU)


@pytest.mark.parametrize("H_q, H_kv", [(4, 4), (9, 3), (8, 2)])
def test_scores_of_a_kv_head_sum_to_group_size_times_length(H_q, H_kv):
    # Each normalized row sums to 1, and a KV head collects H_q // H_kv rows per position.
    L = 77
    q, k, v = _inputs(2, H_q, H_kv, L, 64, torch.float32)
    _, scores = selective_attention(q, k, v)
    expected = torch.full((2, H_kv), float(H_q // H_kv * L))
    torch.testing.assert_close(scores.sum(-1), expected, rtol=1e-5, atol=0)
    # The last key is only seen by the last row, the first key by every row.
    assert (scores[..., -1] <= H_q // H_kv + 1e-5).all()


def test_length_one():
    q, k, v = _inputs(1, 4, 2, 1, 64, torch.float32)
    out, scores = selective_attention(q, k, v)
    # A single token attends only to itself: out = v, score = group size.
    torch.testing.assert_close(out, v.repeat_interleave(2, dim=1), rtol=0, atol=0)
    torch.testing.assert_close(scores, torch.full((1, 2, 1), 2.0), rtol=0, atol=0)


def test_matches_sdpa_on_cpu():
    q, k, v = _inputs(1, 8, 2, 100, 64, torch.float32)
    out, _ = selective_attention(q, k, v)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Triton kernels under the interpreter (CPU tensors, tiny shapes)
# ---------------------------------------------------------------------------------------------

# bf16 is left to the GPU tests: triton 3.9's interpreter returns garbage for bf16 tl.dot.
@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("D", [16, 64])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("L", [1, 17, 40])
def test_triton_interpreter_matches_fp64(L, group, D, dtype):
    q, k, v = _inputs(2, 2 * group, 2, L, D, dtype)
    scale = 1 / math.sqrt(D)
    out, scores = _selective_attention_triton(q, k, v, scale)
    out_64, scores_64 = _attention_fp64(q, k, v, scale)
    assert out.dtype == dtype and out.shape == q.shape and scores.shape == (2, 2, L)
    _assert_out_within_2x(out, _attention_same_precision(q, k, v, scale), out_64)
    _assert_scores_close(scores, scores_64, SCORES_RTOL_CPU)
    row_sums = torch.full((2, 2), float(group * L))
    torch.testing.assert_close(scores.sum(-1), row_sums, rtol=1e-5, atol=0)


# Pass 1 with one and two key steps per query block; pass 2 with query steps larger / smaller
# than its key blocks and several query blocks on one key block's diagonal: the diagonal
# bookkeeping differs in each. The two passes take their configs independently.
@needs_interpreter
@pytest.mark.parametrize(
    "fwd_config, scores_config",
    [
        (_PassConfig(32, 16, 1, 1), _PassConfig(32, 16, 1, 1)),
        (_PassConfig(16, 16, 1, 1), _PassConfig(16, 32, 1, 1)),
        (_PassConfig(32, 32, 1, 1), _PassConfig(16, 64, 1, 1)),
        (_PassConfig(64, 16, 1, 1), _PassConfig(64, 16, 1, 1)),
    ],
)
def test_triton_interpreter_block_configs(fwd_config, scores_config):
    q, k, v = _inputs(1, 4, 2, 71, 16, torch.float32)
    out, scores = _selective_attention_triton(q, k, v, 0.25, fwd_config, scores_config)
    out_ref, scores_ref = selective_attention_ref(q, k, v, 0.25)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scores, scores_ref, rtol=1e-5, atol=1e-6)


@needs_interpreter
@pytest.mark.parametrize("L", [1, 37])
def test_triton_interpreter_fwd_only_returns_lse(L):
    # Pass 1 alone (what the benchmark times separately): out and the base-2 log-sum-exp.
    q, k, v = _inputs(2, 6, 2, L, 16, torch.float32)
    out, lse = _selective_attention_triton(q, k, v, 0.3, fwd_only=True)
    out_ref, _ = selective_attention_ref(q, k, v, 0.3)
    s = (q @ k.repeat_interleave(3, dim=1).transpose(-1, -2)) * 0.3
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    lse_ref = s.masked_fill(~causal, float("-inf")).logsumexp(dim=-1) / math.log(2)
    assert lse.shape == (2, 6, L) and lse.dtype == torch.float32
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-5, atol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("scale", [-0.4, 0.0])
def test_triton_interpreter_nonpositive_scale(scale):
    # The unmasked forward loop takes the row max on raw logits and scales it afterwards; with a
    # negative scale that max is the scaled row minimum, with a zero scale every logit is 0.
    q, k, v = _inputs(1, 4, 2, 45, 16, torch.float32)
    out, scores = _selective_attention_triton(q, k, v, scale)
    out_ref, scores_ref = selective_attention_ref(q, k, v, scale)
    assert torch.isfinite(out).all() and torch.isfinite(scores).all()
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scores, scores_ref, rtol=1e-5, atol=1e-6)


@needs_interpreter
def test_triton_interpreter_outlier_key_channels():
    q, k, v = _inputs(1, 6, 2, 40, 64, torch.float16, outlier_channels=3)
    scale = 1 / math.sqrt(64)
    out, scores = _selective_attention_triton(q, k, v, scale)
    out_64, scores_64 = _attention_fp64(q, k, v, scale)
    assert torch.isfinite(out).all() and torch.isfinite(scores).all()
    _assert_out_within_2x(out, _attention_same_precision(q, k, v, scale), out_64)
    _assert_scores_close(scores, scores_64, SCORES_RTOL_CPU)


@needs_interpreter
def test_triton_interpreter_strided_inputs():
    # Projections come out as (B, L, H, D); the kernels read the transposed view in place.
    B, L, D = 1, 23, 16
    q = torch.randn(B, L, 6, D).transpose(1, 2)
    k = torch.randn(B, L, 2, D).transpose(1, 2)
    v = torch.randn(B, L, 2, D).transpose(1, 2)
    out, scores = _selective_attention_triton(q, k, v, 0.25)
    out_ref, scores_ref = selective_attention_ref(
        q.contiguous(), k.contiguous(), v.contiguous(), 0.25
    )
    assert out.is_contiguous()
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scores, scores_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B, H_q, H_kv, L, D", [(2, 4, 4, 33, 64), (1, 9, 3, 123, 64)])
def test_causal_attention_matches_fp64(B, H_q, H_kv, L, D, dtype):
    # selective attention's output without its scores (SDPA on CPU)
    q, k, v = _inputs(B, H_q, H_kv, L, D, dtype)
    scale = 0.3
    out = causal_attention(q, k, v, scale=scale)
    out_64, _ = _attention_fp64(q, k, v, scale)
    assert out.dtype == dtype and out.shape == q.shape and out.is_contiguous()
    _assert_out_within_2x(out, _attention_same_precision(q, k, v, scale), out_64)


@pytest.mark.parametrize("bad, match", [
    (dict(k=torch.randn(1, 3, 8, 16), v=torch.randn(1, 3, 8, 16)), "KV heads dividing H_q=4"),
    (dict(v=torch.randn(1, 2, 7, 16)), "v"),
    (dict(q=torch.randn(1, 4, 8, 24), k=torch.randn(1, 2, 8, 24), v=torch.randn(1, 2, 8, 24)),
     "head dim in"),
    (dict(q=torch.randn(1, 4, 0, 16), k=torch.randn(1, 2, 0, 16), v=torch.randn(1, 2, 0, 16)),
     "non-empty"),
])
def test_causal_attention_rejects_bad_inputs(bad, match):
    args = dict(q=torch.randn(1, 4, 8, 16), k=torch.randn(1, 2, 8, 16), v=torch.randn(1, 2, 8, 16))
    with pytest.raises(ValueError, match=match):
        causal_attention(**{**args, **bad})


def test_opcheck_causal_attention_cpu():
    q, k, v = _inputs(2, 6, 2, 20, 16, torch.float32)
    torch.library.opcheck(torch.ops.minikv.causal_attention.default, (q, k, v, 0.25))


def test_kernel_config_rejects_bad_blocks():
    with pytest.raises(ValueError, match="power of two"):
        _PassConfig(48, 16, 4, 3)
    with pytest.raises(ValueError, match="power of two"):
        _PassConfig(64, 8, 4, 3)
    with pytest.raises(ValueError, match="num_warps"):
        _PassConfig(64, 64, 3, 3)
    with pytest.raises(ValueError, match="num_stages"):
        _PassConfig(64, 64, 4, 0)
    # Pass 1 needs whole key steps per query block; pass 2 takes any pair. Checked before launch.
    q, k, v = _inputs(1, 4, 2, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="multiple of block_n"):
        _selective_attention_triton(q, k, v, 0.25, fwd_config=_PassConfig(32, 64, 4, 3))


# ---------------------------------------------------------------------------------------------
# Registration: opcheck, torch.compile, input validation
# ---------------------------------------------------------------------------------------------

def test_opcheck_cpu():
    q, k, v = _inputs(2, 6, 2, 20, 16, torch.float32)
    torch.library.opcheck(torch.ops.minikv.selective_attention.default, (q, k, v, 0.25))


def test_compile_fullgraph_no_recompile_across_lengths():
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(selective_attention, backend=counter, fullgraph=True, dynamic=True)
    for L in (17, 33):
        q, k, v = _inputs(1, 4, 2, L, 16, torch.float32)
        out, scores = compiled(q, k, v)
        out_ref, scores_ref = selective_attention(q, k, v)
        torch.testing.assert_close(out, out_ref, rtol=0, atol=0)
        torch.testing.assert_close(scores, scores_ref, rtol=0, atol=0)
    assert counter.frame_count == 1


def _bad_inputs():
    def t(*shape, dtype=torch.float32, device="cpu"):
        return torch.randn(*shape, dtype=dtype, device=device)

    ok_q, ok_kv = (1, 4, 8, 16), (1, 2, 8, 16)
    return [
        ("q 3-d", (t(4, 8, 16), t(*ok_kv), t(*ok_kv)), "q: expected 4 dims"),
        ("int q", (t(*ok_q).int(), t(*ok_kv), t(*ok_kv)), "q: expected dtype"),
        ("k dtype", (t(*ok_q), t(*ok_kv, dtype=torch.float16), t(*ok_kv)), "k: expected dtype"),
        ("v dtype", (t(*ok_q), t(*ok_kv), t(*ok_kv, dtype=torch.bfloat16)), "v: expected dtype"),
        ("heads", (t(1, 6, 8, 16), t(1, 4, 8, 16), t(1, 4, 8, 16)), "dividing H_q=6"),
        ("length", (t(*ok_q), t(1, 2, 9, 16), t(1, 2, 9, 16)), r"k: expected shape \(1, \*, 8"),
        ("head dim", (t(*ok_q), t(1, 2, 8, 32), t(1, 2, 8, 32)), "k: expected shape"),
        ("batch", (t(*ok_q), t(2, 2, 8, 16), t(2, 2, 8, 16)), "k: expected shape"),
        ("v shape", (t(*ok_q), t(*ok_kv), t(1, 1, 8, 16)), "v: expected shape"),
        ("device", (t(*ok_q), t(*ok_kv, device="meta"), t(*ok_kv)), "k: expected device"),
        ("unsupported D", (t(1, 4, 8, 48), t(1, 2, 8, 48), t(1, 2, 8, 48)), "head dim in"),
        ("empty", (t(1, 4, 0, 16), t(1, 2, 0, 16), t(1, 2, 0, 16)), "non-empty"),
    ]


@pytest.mark.parametrize("name, args, message", _bad_inputs(), ids=[c[0] for c in _bad_inputs()])
def test_bad_input_raises_value_error(name, args, message):
    with pytest.raises(ValueError, match=message):
        selective_attention(*args)


def test_supported_head_dims_are_powers_of_two():
    assert all(d >= 16 and d & (d - 1) == 0 for d in SUPPORTED_HEAD_DIMS)


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

# SDPA (FlashAttention) and our kernel both round P to the input dtype before P @ V, at
# different points: allow two units of rounding of each dtype between them.
SDPA_TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("L", [1, 17, 1000, 4099])
def test_gpu_matches_sdpa_and_fp64(L, D, dtype):
    B = 2 if L <= 1000 else 1
    q, k, v = _inputs(B, 32, 8, L, D, dtype, device="cuda")
    scale = 1 / math.sqrt(D)
    out, scores = selective_attention(q, k, v)
    out_64, scores_64 = _attention_fp64(q, k, v, scale)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert out.dtype == dtype and out.shape == q.shape and scores.shape == (B, 8, L)
    _assert_out_within_2x(out, _attention_same_precision(q, k, v, scale), out_64)
    torch.testing.assert_close(out, sdpa, rtol=SDPA_TOL[dtype], atol=SDPA_TOL[dtype])
    _assert_scores_close(scores, scores_64, SCORES_RTOL_GPU)
    row_sums = torch.full((B, 8), 4.0 * L, device="cuda")
    torch.testing.assert_close(scores.sum(-1), row_sums, rtol=1e-4, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [16, 32, 256])
def test_gpu_other_head_dims(D):
    q, k, v = _inputs(2, 8, 2, 333, D, torch.bfloat16, device="cuda")
    scale = 1 / math.sqrt(D)
    out, scores = selective_attention(q, k, v)
    out_64, scores_64 = _attention_fp64(q, k, v, scale)
    _assert_out_within_2x(out, _attention_same_precision(q, k, v, scale), out_64)
    _assert_scores_close(scores, scores_64, SCORES_RTOL_GPU)


@pytest.mark.gpu
def test_gpu_outlier_key_channels():
    q, k, v = _inputs(1, 32, 8, 1000, 128, torch.bfloat16, device="cuda", outlier_channels=4)
    scale = 1 / math.sqrt(128)
    out, scores = selective_attention(q, k, v)
    out_64, scores_64 = _attention_fp64(q, k, v, scale)
    assert torch.isfinite(out).all() and torch.isfinite(scores).all()
    _assert_out_within_2x(out, _attention_same_precision(q, k, v, scale), out_64)
    _assert_scores_close(scores, scores_64, SCORES_RTOL_GPU)


@pytest.mark.gpu
def test_gpu_negative_scale():
    # The forward's unmasked loop takes the scaled row minimum as its running max here.
    q, k, v = _inputs(1, 8, 2, 333, 64, torch.bfloat16, device="cuda")
    out, scores = selective_attention(q, k, v, scale=-0.125)
    out_64, scores_64 = _attention_fp64(q, k, v, -0.125)
    _assert_out_within_2x(out, _attention_same_precision(q, k, v, -0.125), out_64)
    _assert_scores_close(scores, scores_64, SCORES_RTOL_GPU)


@pytest.mark.gpu
def test_gpu_fwd_only_and_per_pass_configs():
    L, scale = 1000, 1 / math.sqrt(128)
    q, k, v = _inputs(1, 32, 8, L, 128, torch.bfloat16, device="cuda")
    out, scores = _selective_attention_triton(q, k, v, scale)
    # Pass 1 alone gives the same out and the base-2 log-sum-exp of every row.
    out_1, lse = _selective_attention_triton(q, k, v, scale, fwd_only=True)
    assert torch.equal(out_1, out) and lse.shape == (1, 32, L)
    s = (q.float() @ k.float().repeat_interleave(4, dim=1).transpose(-1, -2)) * scale
    causal = torch.ones(L, L, dtype=torch.bool, device="cuda").tril()
    lse_ref = s.masked_fill(~causal, float("-inf")).logsumexp(dim=-1) / math.log(2)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-4, atol=1e-3)
    # Other tiles for each pass, chosen independently: same math in another order.
    out_2, scores_2 = _selective_attention_triton(
        q, k, v, scale, _PassConfig(64, 32, 4, 2), _PassConfig(128, 32, 8, 3)
    )
    tol = SDPA_TOL[torch.bfloat16]
    torch.testing.assert_close(out_2, out, rtol=tol, atol=tol)
    torch.testing.assert_close(scores_2, scores, rtol=1e-3, atol=1e-5)


@pytest.mark.gpu
def test_gpu_deterministic():
    q, k, v = _inputs(1, 32, 8, 4099, 128, torch.bfloat16, device="cuda")
    out_a, scores_a = selective_attention(q, k, v)
    out_b, scores_b = selective_attention(q, k, v)
    assert torch.equal(out_a, out_b) and torch.equal(scores_a, scores_b)


@pytest.mark.gpu
def test_gpu_strided_inputs():
    B, L, D = 1, 1000, 128
    q = torch.randn(B, L, 32, D, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    k = torch.randn(B, L, 8, D, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    v = torch.randn(B, L, 8, D, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    out, scores = selective_attention(q, k, v)
    out_c, scores_c = selective_attention(q.contiguous(), k.contiguous(), v.contiguous())
    assert torch.equal(out, out_c) and torch.equal(scores, scores_c)


@pytest.mark.gpu
def test_gpu_extra_memory_is_linear_in_length():
    # Beyond q/k/v/out only the fp32 LSE (B, H_q, L) and scores (B, H_kv, L) may be allocated:
    # 4 MiB + 1 MiB here, where a materialized attention would need 128 GiB.
    L = 32768
    q, k, v = _inputs(1, 32, 8, L, 128, torch.bfloat16, device="cuda")
    selective_attention(q, k, v)  # compile both kernels outside the measured call
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out, scores = selective_attention(q, k, v)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before - out.numel() * out.element_size()
    assert extra < 16 * 2**20, f"extra memory {extra / 2**20:.1f} MiB"


@pytest.mark.gpu
def test_gpu_rejects_fp32():
    q, k, v = _inputs(1, 4, 2, 8, 64, torch.float32, device="cuda")
    with pytest.raises(ValueError, match="on CUDA"):
        selective_attention(q, k, v)


@pytest.mark.gpu
def test_gpu_opcheck():
    q, k, v = _inputs(1, 8, 2, 100, 64, torch.float16, device="cuda")
    torch.library.opcheck(torch.ops.minikv.selective_attention.default, (q, k, v, 0.125))


@pytest.mark.gpu
def test_gpu_compile_fullgraph():
    compiled = torch.compile(selective_attention, fullgraph=True)
    q, k, v = _inputs(1, 8, 2, 300, 128, torch.bfloat16, device="cuda")
    out, scores = compiled(q, k, v)
    out_ref, scores_ref = selective_attention(q, k, v)
    assert torch.equal(out, out_ref) and torch.equal(scores, scores_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("L", [17, 4099])
def test_gpu_causal_attention_is_the_first_pass(L):
    # The same launch as selective attention's pass 1 (bit-equal output), read through strides
    # as the prefill hands it over ((B, L, H, D) projections viewed as (B, H, L, D))
    q = torch.randn(1, L, 32, 128, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    k = torch.randn(1, L, 8, 128, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    v = torch.randn(1, L, 8, 128, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    out = causal_attention(q, k, v)
    out_sel, _ = selective_attention(q, k, v)
    assert torch.equal(out, out_sel) and out.is_contiguous()
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    tol = SDPA_TOL[torch.bfloat16]
    torch.testing.assert_close(out, sdpa, rtol=tol, atol=tol)
    torch.library.opcheck(torch.ops.minikv.causal_attention.default, (q, k, v, 0.125))
