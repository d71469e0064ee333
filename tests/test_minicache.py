"""MiniCache's reference (ops/minicache.py) against an independent SLERP: the rotation of layer
l's unit direction by t * Omega inside the plane the two vectors span, in fp64."""
import math

import pytest
import torch

from minikv_compile.ops.minicache import (MergedPair, merge_pair, restore, retained_count,
                                          shared_direction)


def plane_rotation(a: torch.Tensor, b: torch.Tensor, t: float):
    """(e, omega) in fp64: u rotated towards w by t * omega in span(u, w), omega = acos(u . w)."""
    u = a.double() / a.double().norm(dim=-1, keepdim=True)
    w = b.double() / b.double().norm(dim=-1, keepdim=True)
    cos = (u * w).sum(-1, keepdim=True).clamp(-1, 1)
    omega = torch.acos(cos)
    perp = w - cos * u
    v = perp / perp.norm(dim=-1, keepdim=True)
    return torch.cos(t * omega) * u + torch.sin(t * omega) * v, omega[..., 0]


def random_pair(shape, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64).to(dtype),
            torch.randn(shape, generator=g, dtype=torch.float64).to(dtype))


@pytest.mark.parametrize("t", [0.0, 0.25, 0.6, 1.0])
def test_slerp_is_the_plane_rotation(t):
    a, b = random_pair((2, 3, 37, 5))
    e, omega = shared_direction(a, b, t)
    ref, ref_omega = plane_rotation(a, b, t)
    assert e.dtype == torch.float64
    torch.testing.assert_close(e, ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(omega, ref_omega, atol=1e-12, rtol=0)
    # fp32 inputs: computed in fp32, held to fp32's rounding
    e32, _ = shared_direction(a.float(), b.float(), t)
    assert e32.dtype == torch.float32
    torch.testing.assert_close(e32.double(), ref, atol=2e-6, rtol=0)


def test_endpoints_are_the_layers_directions():
    a, b = random_pair((1, 2, 11, 8), seed=1)
    e0, _ = shared_direction(a, b, 0.0)
    e1, _ = shared_direction(a, b, 1.0)
    torch.testing.assert_close(e0, a / a.norm(dim=-1, keepdim=True), atol=1e-15, rtol=0)
    torch.testing.assert_close(e1, b / b.norm(dim=-1, keepdim=True), atol=1e-14, rtol=0)


def test_merge_retains_the_largest_angles_and_restores_them_exactly():
    a, b = random_pair((2, 3, 50, 16), dtype=torch.float32, seed=2)
    pair = merge_pair(a, b, t=0.6, retain=0.2)
    R = retained_count(50, 0.2)
    assert R == 10
    assert pair.direction.shape == (2, 3, 40, 16) and pair.direction.dtype == torch.float32
    assert pair.magnitude.shape == (2, 2, 3, 40) and pair.magnitude.dtype == torch.float16
    assert pair.retained_index.shape == (2, 3, R) and pair.retained.shape == (2, 2, 3, R, 16)
    # the retained set is the R largest fp64 angles, ascending
    _, omega = plane_rotation(a, b, 0.6)
    want = omega.topk(R, dim=-1).indices.sort(dim=-1).values
    assert torch.equal(pair.retained_index, want)
    xa, xb = restore(pair)
    idx = want[..., None].expand(2, 3, R, 16)
    assert torch.equal(xa.gather(2, idx), a.gather(2, idx))
    assert torch.equal(xb.gather(2, idx), b.gather(2, idx))
    # merged positions: fp16 magnitude times the exact SLERP direction
    e, _ = plane_rotation(a, b, 0.6)
    merged = torch.ones(2, 3, 50, dtype=torch.bool).scatter_(-1, want, False)
    for x_hat, x in ((xa, a), (xb, b)):
        ref = x.double().norm(dim=-1, keepdim=True).half().double() * e
        torch.testing.assert_close(x_hat.double()[merged], ref[merged], atol=1e-5, rtol=1e-5)


def test_retain_everything_restores_both_layers_exactly():
    a, b = random_pair((3, 2, 17, 7), dtype=torch.float16, seed=3)
    pair = merge_pair(a, b, t=0.6, retain=1.0)
    assert pair.direction.shape == (3, 2, 0, 7)
    xa, xb = restore(pair)
    assert xa.dtype == torch.float16
    assert torch.equal(xa, a) and torch.equal(xb, b)


def test_retain_nothing_at_t0_gives_layer_l_up_to_its_fp16_magnitude():
    a, b = random_pair((1, 2, 33, 9), dtype=torch.float32, seed=4)
    pair = merge_pair(a, b, t=0.0, retain=0.0)
    assert pair.retained_index.shape == (1, 2, 0)
    xa, _ = restore(pair)
    torch.testing.assert_close(xa, a, atol=0, rtol=2 ** -11 + 1e-6)


def test_degenerate_angles_and_zero_vectors():
    u = torch.tensor([3.0, 4.0, 0.0], dtype=torch.float64) / 5
    tiny = 1e-5  # a rotation by 1e-5 rad: NLERP, within O(omega^3) of SLERP
    near = torch.tensor([math.cos(tiny) * 0.6 - math.sin(tiny) * 0.8,
                         math.cos(tiny) * 0.8 + math.sin(tiny) * 0.6, 0.0], dtype=torch.float64)
    other = torch.tensor([0.0, 0.0, 2.0], dtype=torch.float64)
    zero = torch.zeros(3, dtype=torch.float64)
    x_l = torch.stack([u, u * 2, u, u, zero, zero, u])[None, None]    # (1, 1, 7, 3)
    x_l1 = torch.stack([u * 3, near, -2 * u, -2 * u, other, zero, other])[None, None]
    e6, omega6 = shared_direction(x_l, x_l1, 0.6)
    e4, _ = shared_direction(x_l, x_l1, 0.4)
    close = lambda x, y: torch.testing.assert_close(x, y, atol=1e-15, rtol=0)
    close(e6[0, 0, 0], u)                                                # parallel: that direction
    assert omega6[0, 0, 0] < 1e-15
    # (acos loses digits at this angle, so the reference rotates by the known 0.6 * tiny)
    ref = torch.tensor([math.cos(0.6 * tiny) * 0.6 - math.sin(0.6 * tiny) * 0.8,
                        math.cos(0.6 * tiny) * 0.8 + math.sin(0.6 * tiny) * 0.6, 0.0],
                       dtype=torch.float64)
    torch.testing.assert_close(e6[0, 0, 1], ref, atol=1e-14, rtol=0)
    close(e6[0, 0, 2], -u)                                               # opposite: nearer end
    close(e4[0, 0, 3], u)
    assert abs(float(omega6[0, 0, 2]) - math.pi) < 1e-15
    assert torch.equal(e6[0, 0, 4], other / 2) and omega6[0, 0, 4] == 0  # one zero: the other's
    assert torch.equal(e6[0, 0, 5], zero) and omega6[0, 0, 5] == 0       # both zero: zero
    # retention takes the opposite and orthogonal tokens before the zero ones
    pair = merge_pair(x_l, x_l1, 0.6, retain=3 / 7)
    assert pair.retained_index.tolist() == [[[2, 3, 6]]]
    xa, xb = restore(pair)
    assert torch.equal(xa[0, 0, 4], zero) and torch.equal(xa[0, 0, 5], zero)
    assert torch.equal(xb[0, 0, 4], other) and torch.equal(xb[0, 0, 5], zero)
    torch.testing.assert_close(xa[0, 0, :2], x_l[0, 0, :2], atol=0, rtol=2 ** -11)
    torch.testing.assert_close(xb[0, 0, :2], x_l1[0, 0, :2], atol=1e-9, rtol=2 ** -11)
    assert torch.isfinite(xa).all() and torch.isfinite(xb).all()


@pytest.mark.parametrize("shape,retain", [((1, 1, 1, 1), 0.0), ((1, 1, 1, 1), 1.0),
                                          ((2, 1, 5, 1), 0.5), ((1, 4, 9, 3), 0.05)])
def test_odd_shapes(shape, retain):
    a, b = random_pair(shape, dtype=torch.float32, seed=5)
    pair = merge_pair(a, b, 0.6, retain)
    T = shape[2]
    assert pair.retained_index.shape[-1] == math.ceil(retain * T)
    xa, xb = restore(pair)
    assert xa.shape == shape and xb.shape == shape
    if shape[-1] == 1:  # 1-D vectors are parallel or opposite: the restored sign is one layer's
        e, _ = shared_direction(a, b, 0.6)
        assert set(e.abs().flatten().tolist()) <= {1.0}


def test_bad_input_is_refused():
    a, b = random_pair((1, 1, 4, 2), dtype=torch.float32)
    with pytest.raises(ValueError, match="t: expected"):
        merge_pair(a, b, t=1.5)
    with pytest.raises(ValueError, match="retain: expected"):
        merge_pair(a, b, retain=-0.1)
    with pytest.raises(ValueError, match="x_l1: expected shape"):
        merge_pair(a, b[..., :1])
    with pytest.raises(ValueError, match="x_l: expected 4 dims"):
        merge_pair(a[0], b[0])
    with pytest.raises(ValueError, match="fp16 magnitudes"):
        merge_pair(a * 1e6, b)
    pair = merge_pair(a, b, retain=0.5)
    with pytest.raises(ValueError, match="repeated"):
        restore(pair._replace(retained_index=torch.zeros_like(pair.retained_index)))
    with pytest.raises(ValueError, match="magnitude: expected dtype"):
        restore(MergedPair(pair.direction, pair.magnitude.float(), pair.retained_index, pair.retained))
