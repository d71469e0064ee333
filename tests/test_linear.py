"""minikv::fused_linear: the kernel against the module chain it replaces and against fp64."""
from __future__ import annotations

import re

import pytest
import torch

from minikv_compile.ops import fused_linear, rms_norm
from minikv_compile.ops.linear import (_fused_linear_norm_out_triton, _fused_linear_triton,
                                       _rms_norm_triton, fused_linear_norm_out_ref,
                                       fused_linear_ref, launch_config, norm_out_blocks,
                                       rms_norm_ref)
from aot import compile_for_sm90

PROLOGUES = ["none", "rmsnorm"]
# One row (FMA), a few rows on the default tiles, and on tiles small enough for several of them.
ROWS_AND_TILES = [
    (1, {}),
    (3, {}),
    (3, dict(USE_DOT=True, BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, NUM_STAGES=2, num_warps=4)),
    (16, dict(USE_DOT=True, BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, NUM_STAGES=2, num_warps=4)),
    (24, dict(USE_DOT=True, BLOCK_M=32, BLOCK_N=16, BLOCK_K=32, NUM_STAGES=2, num_warps=4)),
]


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
@pytest.mark.parametrize("M,cfg", ROWS_AND_TILES)
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
    for N, K in ((4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336)):
        # 17-32 rows: one tile of 32 (each program reads its weight rows once)
        assert launch_config(32, N, K, torch.bfloat16)["BLOCK_M"] == 32
        assert launch_config(16, N, K, torch.bfloat16)["BLOCK_M"] == 16
        # norm_out_blocks asks for 2 rows for any several: BLOCK_N must not depend on how many
        for dtype in (torch.bfloat16, torch.float32):
            widths = {launch_config(m, N, K, dtype)["BLOCK_N"] for m in range(2, 65)}
            assert widths == {norm_out_blocks(2, N, K, dtype)[1]}


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
    (lambda x, w, kw: (x, w, {**kw, "norm_out": torch.ones(24), "rms_weight": torch.ones(32)}),
     "expected norm_out without a prologue, RoPE or glu_out, got rms_weight"),
    (lambda x, w, kw: (x, w, {"norm_out": torch.ones(24), "glu_out": True}),
     "expected norm_out without a prologue, RoPE or glu_out, got glu_out"),
    (lambda x, w, kw: (x, w, {**kw, "norm_out": torch.ones(32)}), r"norm_out: expected shape \(24\)"),
    (lambda x, w, kw: (x, w, {**kw, "norm_out": torch.ones(24).half()}), "norm_out: expected dtype"),
    (lambda x, w, kw: (x, w, {**kw, "rms_sumsq": torch.ones(2, 3), "rms_weight": torch.ones(32)}),
     "expected rms_weight .* or rms_sumsq .*, got both"),
    (lambda x, w, kw: (x, w, {**kw, "rms_sumsq": torch.ones(2, 3).half()}),
     "rms_sumsq: expected dtype"),
    (lambda x, w, kw: (x, w, {**kw, "rms_sumsq": torch.ones(3, 3)}),
     r"rms_sumsq: expected shape \(2, \*\)"),
    (lambda x, w, kw: (x, w, {**kw, "rms_sumsq": torch.ones(3, 2).t()}),
     "rms_sumsq: expected unit stride"),
    (lambda x, w, kw: (x, w, {"norm_out": torch.ones(24), "rms_sumsq": torch.ones(2, 3)}),
     "expected norm_out without a prologue, RoPE or glu_out, got rms_sumsq"),
    (_rope(norm_out=torch.ones(24)), "expected norm_out without a prologue, RoPE or glu_out, "
                                     "got RoPE"),
    (lambda x, w, kw: (x, w, {**kw, "rms_sumsq": torch.ones(2, 4097)}),
     "rms_sumsq: expected 1 to 4096 sums per row, got 4097"),
    (lambda x, w, kw: (x, w, {**kw, "rms_sumsq": torch.ones(2, 0)}),
     "rms_sumsq: expected 1 to 4096 sums per row, got 0"),
])
def test_bad_inputs_raise(change, message):
    x, w, kw = _bad(change)
    with pytest.raises(ValueError, match=message):
        fused_linear(x, w, **kw)


# ----------------------------------------------------------------------------------------------
# The norm split over two launches: norm_out (the launch before) and rms_sumsq (the projection)
# ----------------------------------------------------------------------------------------------


def split_norm_case(M, N, N2, dtype, device="cpu", K=40):
    """A producer (x (M, K) -> h (M, N) with a residual), the RMSNorm weight after it and a
    consumer projection (N2, N) with a bias; h's channel 3 is an outlier (x 30)."""
    g = torch.Generator().manual_seed(M * 100 + N + N2)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g) / K ** 0.5
    r = torch.randn(M, N, generator=g)
    r[:, 3] *= 30
    nw = torch.rand(N, generator=g) + 0.5
    w2 = torch.randn(N2, N, generator=g) / N ** 0.5
    b2 = torch.randn(N2, generator=g)
    return [t.to(device=device, dtype=dtype) for t in (x, w, r, nw, w2, b2)]


def assert_split_norm_within_2x(out, h, nw, w2, b2, consumer, eps=1e-5):
    """The consumer's output against HF's chain (norm, then the projection and its epilogue) in
    fp64, within twice the error of that chain in h's precision (+ a hair for exact cases)."""
    chain = lambda *t: consumer(rms_norm_ref(t[0], t[1], eps), *t[2:])  # noqa: E731
    oracle = chain(h.double(), nw.double(), w2.double(), b2.double())
    err = (out.double() - oracle).abs().max().item()
    base_err = (chain(h, nw, w2, b2).double() - oracle).abs().max().item()
    assert err <= 2 * base_err + 1e-5, f"split-norm error {err:.3g} vs chain {base_err:.3g}"


def _plain(a, w, b):
    return torch.nn.functional.linear(a, w, b)


def _glu(a, w, b):
    y = torch.nn.functional.linear(a, w, b)
    gate, up = y.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def test_norm_out_reference_and_the_prescaled_projection():
    x, w, r, nw, w2, b2 = split_norm_case(3, 40, 24, torch.bfloat16)
    h, h_scaled, sumsq = fused_linear_norm_out_ref(x, w, None, r, nw)
    torch.testing.assert_close(h, (x.double() @ w.double().t() + r.double()).to(h.dtype),
                               rtol=1e-2, atol=1e-2)
    # The weight product as HF's RMSNorm rounds it (weight * normalized.to(dtype)): once,
    # from the exact product.
    assert torch.equal(h_scaled, (nw.double() * h.double()).to(h.dtype))
    P, width = norm_out_blocks(3, 40, 40, torch.bfloat16)
    assert sumsq.shape == (3, P) and sumsq.dtype == torch.float32 and P > 1
    hf = h.float() ** 2
    for p in range(P):
        torch.testing.assert_close(sumsq[:, p], hf[:, p * width: (p + 1) * width].sum(1))
    for glu, consumer in ((False, _plain), (True, _glu)):
        out = fused_linear(h_scaled, w2, b2, rms_sumsq=sumsq, eps=1e-5, glu_out=glu)
        assert_split_norm_within_2x(out, h, nw, w2, b2, consumer)
    # In fp32 it is the chain up to the order of roundings.
    x, w, r, nw, w2, b2 = split_norm_case(2, 40, 24, torch.float32)
    h, h_scaled, sumsq = fused_linear(x, w, residual=r, norm_out=nw)
    want = _plain(rms_norm(h, nw, 1e-5), w2, b2)
    torch.testing.assert_close(fused_linear(h_scaled, w2, b2, rms_sumsq=sumsq, eps=1e-5), want,
                               rtol=1e-5, atol=1e-5)


def test_op_prologue_names_its_operand():
    # The op may be called without the wrapper: its prologue and operands must agree.
    x, w, r, nw, w2, b2 = split_norm_case(2, 40, 24, torch.float32)
    sums = torch.ones(2, 3)
    for prologue, rms_sumsq, want, got in [("prescaled", None, ["rms_sumsq"], []),
                                           ("none", sums, [], ["rms_sumsq"]),
                                           ("rmsnorm", sums, ["rms_weight"], ["rms_sumsq"]),
                                           ("rmsnorm", None, ["rms_weight"], [])]:
        message = f"prologue {prologue!r}: expected the operands {want}, got {got}"
        with pytest.raises(ValueError, match=re.escape(message)):
            torch.ops.minikv.fused_linear(x, w, None, None, None, None, None, 0, prologue, 1e-5,
                                          False, rms_sumsq)


def test_norm_out_refuses_more_sums_than_a_prescaled_launch_takes():
    x, w = torch.ones(1, 8), torch.ones(4 * 4096 + 4, 8)  # one row: blocks of 4 columns
    with pytest.raises(ValueError, match=r"norm_out: expected at most 4096 column blocks of "
                                         r"sums per row .* got 4097 \(16388 columns in blocks "
                                         r"of 4\)"):
        fused_linear(x, w, norm_out=torch.ones(4 * 4096 + 4))
    assert fused_linear(x, w[:4096 * 4], norm_out=torch.ones(4096 * 4))[2].shape == (1, 4096)


def test_split_norm_opcheck_and_compile():
    x, w, r, nw, w2, b2 = split_norm_case(3, 40, 24, torch.float32)
    torch.library.opcheck(torch.ops.minikv.fused_linear_norm_out.default, (x, w, None, r, nw))
    torch.library.opcheck(torch.ops.minikv.fused_linear_norm_out.default, (x, w, w[:, 0], None, nw))
    h, h_scaled, sumsq = fused_linear(x, w, residual=r, norm_out=nw)
    torch.library.opcheck(torch.ops.minikv.fused_linear.default,
                          (h_scaled, w2, b2, None, None, None, None, 0, "prescaled", 1e-5, False,
                           sumsq))

    def two_launches(x):
        h, h_scaled, sumsq = fused_linear(x, w, residual=r, norm_out=nw)
        return h, fused_linear(h_scaled, w2, b2, rms_sumsq=sumsq, eps=1e-5)

    f = torch.compile(two_launches, fullgraph=True, backend="eager")
    for a, b in zip(f(x), two_launches(x)):
        assert torch.equal(a, b)


@pytest.mark.interpret
@pytest.mark.parametrize("M,cfg", ROWS_AND_TILES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_triton_split_norm_matches_reference(M, cfg, dtype):
    # 42 and 72 columns: 42 is not a multiple of any block (4 at one row, 16 and 32 at more), so
    # the last block of sums is partly masked.
    x, w, r, nw, w2, b2 = split_norm_case(M, 42, 72, dtype)
    h, h_scaled, sumsq = _fused_linear_norm_out_triton(x, w, None, r, nw, **cfg)
    ref = fused_linear_norm_out_ref(x, w, None, r, nw)
    torch.testing.assert_close(h, ref[0], rtol=2e-3, atol=2e-3)
    assert torch.equal(h_scaled, nw * h)
    width = cfg.get("BLOCK_N", norm_out_blocks(M, 42, 40, dtype)[1])
    assert 42 % width and sumsq.shape == (M, -(-42 // width))
    hf = h.float() ** 2
    for p in range(sumsq.shape[1]):
        torch.testing.assert_close(sumsq[:, p], hf[:, p * width: (p + 1) * width].sum(1))
    for glu, consumer in ((False, _plain), (True, _glu)):
        out = _fused_linear_triton(h_scaled, w2, b2, None, None, None, None, 0, "prescaled", 1e-5,
                                   glu, rms_sumsq=sumsq, **cfg)
        assert_split_norm_within_2x(out, h, nw, w2, b2, consumer)
        want = fused_linear_ref(h_scaled, w2, b2, None, None, None, None, 0, "prescaled", 1e-5,
                                glu, sumsq)
        torch.testing.assert_close(out, want, rtol=2e-3, atol=2e-3)


@pytest.mark.interpret
@pytest.mark.parametrize("M", [1, 3])
def test_triton_prescaled_with_rope(M):
    # The q/k/v launch of a several-row step: the split norm, then RoPE over 3 heads of 16.
    x, w, a = make_case(M, 3 * 16 + 24, 40, "none", torch.float16, bias=True, rope_dim=16,
                        rope_heads=3)
    nw = torch.rand(40, generator=torch.Generator().manual_seed(3)).half() + 0.5
    sumsq = (x.float() ** 2).view(M, 4, 10).sum(-1)  # any blocks of columns will do
    out = _fused_linear_triton(nw * x, w, a["bias"], None, None, a["rope_cos"], a["rope_sin"],
                               a["rope_rows"], "prescaled", 1e-5, rms_sumsq=sumsq)
    assert_within_2x(out, x, w, {**a, "rms_weight": nw}, "rmsnorm")


_AOT_BODY = """
import torch
from minikv_compile.ops import linear as lin

SIG = {name: "*bf16" for name in ("x_ptr", "w_ptr", "b_ptr", "nw_ptr", "r_ptr", "cos_ptr",
                                  "sin_ptr", "g_ptr", "y_ptr", "ys_ptr")}
SIG.update(ss_ptr="*fp32", so_ptr="*fp32", eps="fp32")
for name in lin._fused_linear_kernel.arg_names:
    SIG.setdefault(name, "i32")

def fused(M, N, K, prologue, **kw):
    cfg = lin.launch_config(M, N, K, torch.bfloat16)
    cfg.pop("num_warps")
    flags = dict(PROLOGUE=lin.PROLOGUES.index(prologue), HAS_BIAS=False, HAS_RESIDUAL=False,
                 ROPE=False, HEAD_DIM=128, GLU_OUT=False, NORM_OUT=False, FP32_DOT=False,
                 PDL=True, LINE=64, BLOCK_P=128)
    consts = dict(cfg, **flags)
    consts.update(kw)
    build(lin._fused_linear_kernel, {k: v for k, v in SIG.items() if k not in consts}, consts)

for M in (1, 8, 32):   # the engine's launches of a Llama-3.1-8B layer
    fused(M, 6144, 4096, "prescaled" if M > 1 else "rmsnorm", ROPE=True)
    fused(M, 4096, 4096, "none", HAS_RESIDUAL=True, NORM_OUT=True)
    fused(M, 28672, 4096, "prescaled" if M > 1 else "rmsnorm", GLU_OUT=True)
    fused(M, 4096, 14336, "none", HAS_RESIDUAL=True, NORM_OUT=M > 1)
"""


def test_fused_linear_kernels_compile_for_sm90():
    # The engine's launches for an H100/H200, without a GPU (tests/aot.py says why).
    compile_for_sm90(_AOT_BODY)


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
@pytest.mark.parametrize("M", [1, 8, 16, 24, 32])
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


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 8, 16, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_split_norm_llama_layers(M, dtype):
    # o_proj handing the post-attention norm's share to gate/up (SiLU-gate epilogue), and
    # q/k/v (RoPE epilogue) taking the input norm's share from the down projection before it.
    x, w, r, nw, w2, b2 = split_norm_case(M, 4096, 28672, dtype, "cuda", K=4096)
    h, h_scaled, sumsq = fused_linear(x, w, residual=r, norm_out=nw)
    ref = fused_linear_norm_out_ref(x, w, None, r, nw)
    torch.testing.assert_close(h, ref[0], rtol=1e-2, atol=1e-2)
    assert torch.equal(h_scaled, nw * h) and sumsq.shape == ref[2].shape
    torch.testing.assert_close(sumsq.sum(1), (h.float() ** 2).sum(1), rtol=1e-5, atol=0)
    out = fused_linear(h_scaled, w2, b2, rms_sumsq=sumsq, eps=1e-5, glu_out=True)
    assert_split_norm_within_2x(out, h, nw, w2, b2, _glu)
    torch.library.opcheck(torch.ops.minikv.fused_linear_norm_out.default, (x, w, None, r, nw))
    x, w, a = make_case(M, 6144, 4096, "none", dtype, "cuda", outliers=True, rope_dim=128,
                        rope_heads=40)
    nw = nw[:4096]
    sumsq = (x.float() ** 2).view(M, 128, 32).sum(-1)
    args = (nw * x, w, None, None, None, a["rope_cos"], a["rope_sin"], a["rope_rows"],
            "prescaled", 1e-5, False, sumsq)
    assert_within_2x(torch.ops.minikv.fused_linear(*args), x, w, {**a, "rms_weight": nw},
                     "rmsnorm")
    torch.library.opcheck(torch.ops.minikv.fused_linear.default, args)
