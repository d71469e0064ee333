"""minikv::fused_linear: the kernel against the module chain it replaces and against fp64."""
from __future__ import annotations

import pytest
import torch

from minikv_compile.ops import fused_linear, rms_norm
from minikv_compile.ops.linear import (_fused_linear_triton, _rms_norm_triton, fused_linear_ref,
                                       launch_config, rms_norm_ref)

PROLOGUES = ["none", "rmsnorm"]


def make_case(M, N, K, prologue, dtype, device="cpu", bias=False, residual=False, outliers=False,
              rope_dim=0, rope_heads=0):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x = torch.randn(M, K, generator=g)
    if outliers:  # a few input channels 10-50x larger, as in real hidden states
        x[:, 3] *= 50
        x[:, K // 2] *= 10
    w = torch.randn(N, K, generator=g) / K ** 0.5
    args = dict(
        bias=torch.randn(N, generator=g) if bias else None,
        rms_weight=torch.rand(K, generator=g) + 0.5 if prologue == "rmsnorm" else None,
        residual=torch.randn(M, N, generator=g) if residual else None,
        rope_cos=None, rope_sin=None,
    )
    if rope_dim:  # a different position per row, as HF's rotary embedding makes them
        pos = torch.randint(0, 32768, (M, 1), generator=g).double()
        inv = 500000.0 ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
        ang = torch.cat([pos * inv] * 2, dim=1)
        args["rope_cos"], args["rope_sin"] = ang.cos().float(), ang.sin().float()
    to = dict(device=device, dtype=dtype)
    args = {k: (v.to(**to) if v is not None else None) for k, v in args.items()}
    args["rope_rows"] = rope_heads * rope_dim
    return x.to(**to), w.to(**to), args


def _operands(a):
    return (a["bias"], a["rms_weight"], a["residual"], a["rope_cos"], a["rope_sin"],
            a.get("rope_rows", 0))


def run_ref(x, w, a, prologue, eps=1e-5):
    return fused_linear_ref(x, w, *_operands(a), prologue, eps, a.get("glu_out", False))


def run_kernel(x, w, a, prologue, eps=1e-5, **kw):
    return _fused_linear_triton(x, w, *_operands(a), prologue, eps, a.get("glu_out", False), **kw)


def public(x, w, a, prologue, eps=1e-5):
    return fused_linear(x, w, a["bias"], rms_weight=a["rms_weight"], eps=eps,
                        residual=a["residual"], rope_cos=a["rope_cos"],
                        rope_sin=a["rope_sin"], rope_rows=a["rope_rows"],
                        glu_out=a.get("glu_out", False))


def assert_within_2x(out, x, w, a, prologue):
    """|out - fp64| <= 2 |same-precision module chain - fp64| (+ a hair for exact cases)."""
    a64 = {k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    oracle = run_ref(x.double(), w.double(), a64, prologue)
    base = run_ref(x, w, a, prologue)
    err = (out.double() - oracle).abs().max().item()
    base_err = (base.double() - oracle).abs().max().item()
    assert err <= 2 * base_err + 1e-5, f"kernel error {err:.3g} vs same-precision {base_err:.3g}"


# ----------------------------------------------------------------------------------------------
# CPU: the reference is the module chain; the kernel through the interpreter
# ----------------------------------------------------------------------------------------------


def test_reference_is_the_hf_module_chain():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, w, a = make_case(3, 24, 32, "rmsnorm", torch.float32, bias=True, residual=True)
    norm = LlamaRMSNorm(32, eps=1e-5)
    norm.weight.data = a["rms_weight"]
    want = a["residual"] + torch.nn.functional.linear(norm(x), w, a["bias"])
    assert torch.equal(run_ref(x, w, a, "rmsnorm"), want)
    # glu_out: LlamaMLP's act_fn(gate_proj(x)) * up_proj(x) from the [gate; up] weight
    x, w, a = make_case(2, 48, 32, "rmsnorm", torch.float32, bias=True)
    norm.weight.data = a["rms_weight"]
    y = torch.nn.functional.linear(norm(x), w, a["bias"])
    want = torch.nn.SiLU()(y[:, :24]) * y[:, 24:]
    assert torch.equal(run_ref(x, w, {**a, "glu_out": True}, "rmsnorm"), want)


@pytest.mark.interpret
@pytest.mark.parametrize("prologue", PROLOGUES)
@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_triton_matches_reference(prologue, M, dtype):
    # N and K not multiples of any block: the masks cover the edges.
    x, w, a = make_case(M, 40, 80, prologue, dtype, bias=True, residual=True, outliers=True)
    out = run_kernel(x, w, a, prologue)
    assert out.dtype == dtype and out.shape == (M, 40)
    assert_within_2x(out, x, w, a, prologue)
    torch.testing.assert_close(out, run_ref(x, w, a, prologue), rtol=2e-3, atol=2e-3)


@pytest.mark.interpret
@pytest.mark.parametrize("cfg", [
    dict(USE_DOT=False, BLOCK_M=1, BLOCK_N=4, BLOCK_K=32, NUM_STAGES=1, num_warps=4),
    dict(USE_DOT=True, BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, NUM_STAGES=2, num_warps=4),
])
def test_triton_block_configs_span_several_k_tiles(cfg):
    x, w, a = make_case(1, 24, 100, "rmsnorm", torch.float16, residual=True)  # 4 K tiles of 32
    assert_within_2x(run_kernel(x, w, a, "rmsnorm", **cfg), x, w, a, "rmsnorm")


@pytest.mark.interpret
@pytest.mark.parametrize("M,D,cfg", [
    (1, 16, {}),
    (1, 16, dict(USE_DOT=False, BLOCK_M=1, BLOCK_N=2, BLOCK_K=32, NUM_STAGES=1, num_warps=4)),
    (3, 16, {}),
    (1, 24, {}),
    (3, 24, {}),  # 24 columns per head: too narrow for the 16-row tensor-core tiles
])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_triton_rope_epilogue(M, D, cfg, dtype):
    # 3 rotated heads (q and k) then 24 plain columns (v): each rotated pair may sit in another
    # block of columns than its partner, the plain columns must come out untouched.
    R = 3 * D
    x, w, a = make_case(M, R + 24, 40, "rmsnorm", dtype, bias=True, rope_dim=D, rope_heads=3)
    out = run_kernel(x, w, a, "rmsnorm", **cfg)
    assert_within_2x(out, x, w, a, "rmsnorm")
    plain = run_ref(x, w, {**a, "rope_cos": None, "rope_sin": None, "rope_rows": 0}, "rmsnorm")
    torch.testing.assert_close(out[:, R:], plain[:, R:], rtol=2e-3, atol=2e-3)
    assert (out[:, :R] - plain[:, :R]).abs().max() > 0.1  # it did rotate


@pytest.mark.interpret
@pytest.mark.parametrize("M,cfg", [
    (1, {}),
    (3, {}),
    (3, dict(USE_DOT=True, BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, NUM_STAGES=2, num_warps=4)),
])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_triton_glu_epilogue(M, cfg, dtype):
    # 2 x 36 rows ([gate; up]): output columns j pair weight rows j and 36 + j; 36 is not a
    # multiple of any block, so the last program's gate and up rows are both partly masked.
    x, w, a = make_case(M, 72, 40, "rmsnorm", dtype, bias=True, outliers=True)
    a["glu_out"] = True
    out = run_kernel(x, w, a, "rmsnorm", **cfg)
    assert out.shape == (M, 36)
    assert_within_2x(out, x, w, a, "rmsnorm")
    torch.testing.assert_close(out, run_ref(x, w, a, "rmsnorm"), rtol=2e-3, atol=2e-3)


def test_launch_rule():
    assert launch_config(1, 4096, 4096, torch.bfloat16)["USE_DOT"] is False
    assert launch_config(8, 4096, 4096, torch.bfloat16)["USE_DOT"] is True


def test_public_op_on_cpu_opcheck_and_compile():
    x, w, a = make_case(2, 24, 32, "rmsnorm", torch.float32, bias=True, residual=True)
    assert torch.equal(public(x, w, a, "rmsnorm"), run_ref(x, w, a, "rmsnorm"))
    for prologue in PROLOGUES:
        x, w, a = make_case(2, 24, 32, prologue, torch.float32, residual=True)
        torch.library.opcheck(torch.ops.minikv.fused_linear.default,
                              (x, w, *_operands(a), prologue, 1e-5))
    x, w, a = make_case(2, 24, 32, "none", torch.float32, rope_dim=8, rope_heads=2)
    torch.library.opcheck(torch.ops.minikv.fused_linear.default, (x, w, *_operands(a), "none", 0.0))
    # RoPE as the adapter writes it: q * cos + rotate_half(q) * sin per head of 8
    q = (x @ w.t())[:, :16].view(2, 2, 8)
    half = torch.cat((-q[..., 4:], q[..., :4]), dim=-1)
    want = (q * a["rope_cos"][:, None] + half * a["rope_sin"][:, None]).reshape(2, 16)
    torch.testing.assert_close(public(x, w, a, "none")[:, :16], want)
    x, w, a = make_case(3, 24, 32, "rmsnorm", torch.float32, bias=True)
    args = (x, w, *_operands(a), "rmsnorm", 1e-5, True)
    torch.library.opcheck(torch.ops.minikv.fused_linear.default, args)
    assert torch.ops.minikv.fused_linear(*args).shape == (3, 12)
    x, w, a = make_case(1, 24, 32, "none", torch.float32)
    f = torch.compile(lambda x: fused_linear(x, w, glu_out=True), fullgraph=True, backend="eager")
    assert torch.equal(f(x), run_ref(x, w, {**a, "glu_out": True}, "none"))
    with pytest.raises(ValueError, match="prologue: expected one of"):
        torch.ops.minikv.fused_linear(x, w, *_operands(a), "glu", 1e-5)


def _bad(change):
    x, w, a = make_case(2, 24, 32, "none", torch.float32, bias=True, residual=True)
    kw = dict(bias=a["bias"], residual=a["residual"])
    return change(x, w, kw)


_COS = torch.ones(2, 8)


def _rope(**kw):
    return lambda x, w, kw0: (x, w, {**{k: v for k, v in kw0.items() if k != "residual"},
                                     "rope_cos": _COS, "rope_sin": _COS, "rope_rows": 16, **kw})


@pytest.mark.parametrize("change,message", [
    (lambda x, w, kw: (x[:, :31], w, kw), r"x: expected shape \(\*, 32\), got \(2, 31\)"),
    (lambda x, w, kw: (x, w.half(), kw), "weight: expected dtype"),
    (lambda x, w, kw: (x[0], w, kw), "x: expected 2 dims"),
    (lambda x, w, kw: (x, w, {**kw, "bias": kw["bias"][:5]}), r"bias: expected shape \(24\)"),
    (lambda x, w, kw: (x, w, {**kw, "residual": kw["residual"][:1]}),
     r"residual: expected shape \(2, 24\)"),
    (lambda x, w, kw: (x, w, {**kw, "rms_weight": torch.ones(31)}),
     r"rms_weight: expected shape \(32\)"),
    (lambda x, w, kw: (x.t().contiguous().t(), w, kw), "x: expected unit stride"),
    (lambda x, w, kw: (x[:0], w, kw), "expected non-empty"),
    (lambda x, w, kw: (x, w, {**kw, "rope_cos": _COS, "rope_sin": _COS, "rope_rows": 16}),
     "RoPE or a residual, got both"),
    (_rope(rope_sin=None), "both rope_cos and rope_sin or neither"),
    (_rope(rope_rows=12), r"rope_rows: expected a positive multiple of the head dim 8 <= N=24"),
    (_rope(rope_rows=32), r"rope_rows: expected a positive multiple of the head dim 8 <= N=24"),
    (_rope(rope_cos=torch.ones(1, 8)), r"rope_cos: expected shape \(2, 8\)"),
    (_rope(rope_cos=torch.ones(2, 7), rope_sin=torch.ones(2, 7), rope_rows=14),
     "expected an even head dim"),
    (lambda x, w, kw: (x, w, {**kw, "rope_rows": 8}), "rope_rows: expected 0 without"),
    (lambda x, w, kw: (x, w, {**kw, "glu_out": True}),
     "expected glu_out without a residual or RoPE, got a residual"),
    (_rope(glu_out=True), "expected glu_out without a residual or RoPE, got RoPE"),
    (lambda x, w, kw: (x, w[:23], {"glu_out": True}),
     "weight: expected an even number of rows"),
])
def test_bad_inputs_raise(change, message):
    x, w, kw = _bad(change)
    with pytest.raises(ValueError, match=message):
        fused_linear(x, w, **kw)


# ----------------------------------------------------------------------------------------------
# rms_norm: the prologue as a launch of its own
# ----------------------------------------------------------------------------------------------


def norm_case(M, K, dtype, device="cpu"):
    g = torch.Generator().manual_seed(M * 100 + K)
    x = torch.randn(M, K, generator=g)
    x[:, 1] *= 50  # an outlier channel
    w = torch.rand(K, generator=g) + 0.5
    return x.to(device=device, dtype=dtype), w.to(device=device, dtype=dtype)


def assert_norm_within_2x(out, x, w):
    """Twice the error of the same-precision reference, plus 4 fp32 ulps of the largest output:
    the 1 / RMS is an fp32 value either way, summed in another order (in fp32 the reference's
    own error is below an ulp, so 2x of it alone would demand the same summation order)."""
    oracle = rms_norm_ref(x.double(), w.double(), 1e-5)
    err = (out.double() - oracle).abs().max().item()
    base_err = (rms_norm_ref(x, w, 1e-5).double() - oracle).abs().max().item()
    ulps = 4 * torch.finfo(torch.float32).eps * oracle.abs().max().item()
    assert err <= 2 * base_err + ulps, f"kernel error {err:.3g} vs same-precision {base_err:.3g}"


def test_rms_norm_reference_is_the_hf_module():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    for dtype in (torch.float32, torch.bfloat16):
        x, w = norm_case(3, 40, dtype)
        norm = LlamaRMSNorm(40, eps=1e-5).to(dtype)
        norm.weight.data = w
        assert torch.equal(rms_norm(x, w, 1e-5), norm(x))


@pytest.mark.interpret
@pytest.mark.parametrize("M,K", [(1, 40), (3, 100), (2, 5000)])  # 5000: two column tiles
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)  # bf16: GPU only
def test_rms_norm_triton_matches_reference(M, K, dtype):
    x, w = norm_case(M, K, dtype)
    x = torch.cat([x, x], dim=1)[:, :K]  # a row stride of 2K: strided rows are read in place
    out = _rms_norm_triton(x, w, 1e-5)
    assert out.dtype == dtype and out.shape == (M, K) and out.is_contiguous()
    assert_norm_within_2x(out, x, w)
    # Only the sum of squares runs in another order: at most one rounding step apart.
    torch.testing.assert_close(out, rms_norm_ref(x, w, 1e-5), rtol=1e-2 if dtype != torch.float32
                               else 1e-5, atol=0)


def test_rms_norm_opcheck_compile_and_bad_inputs():
    x, w = norm_case(3, 32, torch.float32)
    torch.library.opcheck(torch.ops.minikv.rms_norm.default, (x, w, 1e-5))
    f = torch.compile(lambda x: rms_norm(x, w, 1e-5), fullgraph=True, backend="eager")
    assert torch.equal(f(x), rms_norm_ref(x, w, 1e-5))
    for args, message in [
        ((x, w[:31]), r"weight: expected shape \(32\)"),
        ((x, w.half()), "weight: expected dtype"),
        ((x[0], w), "x: expected 2 dims"),
        ((x.int(), w), "x: expected dtype"),
        ((x[:0], w), "x: expected a non-empty tensor"),
        ((x.t().contiguous().t(), w), "x: expected unit stride"),
    ]:
        with pytest.raises(ValueError, match=message):
            rms_norm(*args)


@pytest.mark.gpu
@pytest.mark.parametrize("M,K", [(8, 4096), (3, 5000), (1, 576)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_gpu_rms_norm(M, K, dtype):
    x, w = norm_case(M, K, dtype, "cuda")
    out = rms_norm(x, w, 1e-5)
    assert_norm_within_2x(out, x, w)
    torch.library.opcheck(torch.ops.minikv.rms_norm.default, (x, w, 1e-5))


# ----------------------------------------------------------------------------------------------
# GPU: Llama-3.1-8B layer sizes, the engine's rows (1) and a few rows (8)
# ----------------------------------------------------------------------------------------------

LLAMA_LAYERS = [  # (N, K, prologue, residual)
    pytest.param(6144, 4096, "rmsnorm", False, id="qkv"),
    # The adapter's several-row path: rms_norm launched before, the projection without prologue.
    pytest.param(6144, 4096, "none", False, id="qkv_norm_outside"),
    pytest.param(4096, 4096, "none", True, id="o"),
    pytest.param(28672, 4096, "rmsnorm", False, id="gate_up"),
    pytest.param(4096, 14336, "none", True, id="down"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("N,K,prologue,residual", LLAMA_LAYERS)
@pytest.mark.parametrize("M", [1, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_llama_layers(N, K, prologue, residual, M, dtype):
    rope = dict(rope_dim=128, rope_heads=40) if N == 6144 else {}  # q/k/v: 32 + 8 heads rotate
    x, w, a = make_case(M, N, K, "rmsnorm" if rope else prologue, dtype, "cuda",
                        residual=residual, outliers=True, **rope)
    if rope and prologue == "none":  # x as ops.rms_norm leaves it for the projection
        x = rms_norm(x, a["rms_weight"], 1e-5)
        a["rms_weight"] = None
    assert_within_2x(public(x, w, a, prologue), x, w, a, prologue)
    if N == 28672:  # gate/up as the engine runs it: silu(gate) * up in the epilogue
        a["glu_out"] = True
        out = public(x, w, a, prologue)
        assert out.shape == (M, N // 2)
        assert_within_2x(out, x, w, a, prologue)


@pytest.mark.gpu
def test_gpu_fp32_bias_opcheck_and_graph_capture():
    x, w, a = make_case(1, 300, 200, "rmsnorm", torch.float32, "cuda", bias=True, residual=True)
    assert_within_2x(run_kernel(x, w, a, "rmsnorm"), x, w, a, "rmsnorm")
    x, w, a = make_case(1, 512, 256, "rmsnorm", torch.bfloat16, "cuda", bias=True)
    torch.library.opcheck(torch.ops.minikv.fused_linear.default,
                          (x, w, *_operands(a), "rmsnorm", 1e-5, True))
    run = lambda: fused_linear(x, w, a["bias"], rms_weight=a["rms_weight"],  # noqa: E731
                               glu_out=True)
    want = run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(out, run()) and not torch.equal(out, want)
