"""Device experiment: an 8-row GEMV whose weights go from HBM straight into the tensor cores'
registers (a Gluon kernel, no shared memory on the weight path), beside ``fused_linear``'s default
launch without epilogue, on the four Llama-3.1-8B projections.

    cd /tmp/run && python /path/to/perf/gpu/gemv_gluon_trial.py      # after perf/gpu/check.sh

Why: ``stream_probe.py`` read 96 x 512 KB (q/k/v's bytes per program) in 15.1 us with 8 warps of
16-byte loads into registers, 64 KB a tile in flight per SM (45 GB/s per SM at 4 MB a program),
where every ``fused_linear`` launch at 8 rows, staged through shared memory by cp.async or TMA,
streams ~30 GB/s per SM (q/k/v 17-19 us).

Kernel: a program owns ``16 MT`` weight rows; its ``W`` warps split K (warp w: columns
``[w K / W, (w + 1) K / W)``), each loading ``KC`` columns of its rows at a time into registers,
the next chunk in flight while this one is multiplied (``mma.m16n8k16``: weight rows on M, the
8 rows of x on N); the warps' partial products are summed through shared memory at the end.
Lane ``(g, t)`` (lane ``4 g + t``) loads 16 bytes at columns ``32 j + 8 t + [0, 8)`` of rows
``16 m + 8 h + g``; the K index ``k = 16 (2 j + s1) + 8 q + 2 t + e`` of the operands is column
``32 j + 8 t + 4 s1 + 2 q + e``, and x^T is loaded in the same order, so the loaded registers are
the operands as they stand (checked at compile time: ``assert_trivial``).
"""
import argparse

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from linear_sweep import LAYERS, plain_baseline, plain_cases, report_variant  # this folder's sweep



@gluon.jit
def _pdl(x, ENABLED: gl.constexpr):
    if ENABLED:
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents;\n griddepcontrol.wait; "
                                  "// $0 $1", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _load_chunk(w_rows, x_rows, M, K, KW, k0, W: gl.constexpr, MT: gl.constexpr, KC: gl.constexpr,
                RAW_A: gl.constexpr, RAW_B: gl.constexpr, A3: gl.constexpr, B3: gl.constexpr):
    """This chunk's A (W, 16 MT, KC) and B (W, KC, 8) operands, loaded 16 bytes per lane. KW:
    K / W, an argument so that the compiler knows its divisibility (16-byte loads)."""
    # A: (warp, lane, register) -> row 16 m + 8 h + g, column 32 j + 8 t + e8
    wa = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, RAW_A)))[:, None, None]
    la = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, RAW_A)))[None, :, None]
    ra = gl.arange(0, MT * 2 * KC // 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, RAW_A)))
    ra = ra[None, None, :]
    JN: gl.constexpr = KC // 32
    row_a = 16 * (ra // (16 * JN)) + 8 * ((ra // (8 * JN)) % 2) + la // 4
    col_a = wa * KW + k0 + 32 * ((ra // 8) % JN) + 8 * (la % 4) + ra % 8
    a = gl.load(w_rows + row_a.to(gl.int64) * K + col_a)
    # (w, g, t, m, h, j, s1, q, e) -> (w, m, h, g, j, s1, q, t, e)
    a = gl.reshape(a, (W, 8, 4, MT, 2, JN, 2, 2, 2))
    a = gl.permute(a, (0, 3, 4, 1, 5, 6, 7, 2, 8))
    a = gl.convert_layout(gl.reshape(a, (W, 16 * MT, KC)), A3, assert_trivial=True)
    # B: (warp, lane, register) -> x row g, column 32 j + 8 t + e8
    wb = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, RAW_B)))[:, None, None]
    lb = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, RAW_B)))[None, :, None]
    rb = gl.arange(0, KC // 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, RAW_B)))[None, None, :]
    col_b = wb * KW + k0 + 32 * (rb // 8) + 8 * (lb % 4) + rb % 8
    b = gl.load(x_rows + (lb // 4) * K + col_b, mask=(lb // 4) < M, other=0.0)
    # (w, g, t, j, s1, q, e) -> (w, j, s1, q, t, e, g)
    b = gl.reshape(b, (W, 8, 4, JN, 2, 2, 2))
    b = gl.permute(b, (0, 3, 4, 5, 2, 6, 1))
    b = gl.convert_layout(gl.reshape(b, (W, KC, 8)), B3, assert_trivial=True)
    return a, b


@gluon.jit
def _gemv8_kernel(x_ptr, w_ptr, y_ptr, M, N, K, KW, W: gl.constexpr, MT: gl.constexpr,
                  KC: gl.constexpr, PDL: gl.constexpr):
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1, 1],
                                                  instr_shape=[1, 16, 8])
    A3: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B3: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    RAW_A: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, MT * 2 * KC // 4],
                                           threads_per_warp=[1, 32, 1], warps_per_cta=[W, 1, 1],
                                           order=[2, 1, 0])
    RAW_B: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, KC // 4],
                                           threads_per_warp=[1, 32, 1], warps_per_cta=[W, 1, 1],
                                           order=[2, 1, 0])
    n0 = gl.program_id(0) * (16 * MT)
    w_rows = w_ptr + n0.to(gl.int64) * K
    a, b = _load_chunk(w_rows, x_ptr, M, K, KW, 0, W, MT, KC, RAW_A, RAW_B, A3, B3)
    _pdl(n0, PDL)
    acc = gl.zeros([W, 16 * MT, 8], gl.float32, layout=MMA)
    for k0 in range(KC, KW, KC):
        a_n, b_n = _load_chunk(w_rows, x_ptr, M, K, KW, k0, W, MT, KC, RAW_A, RAW_B, A3, B3)
        acc = mma_v2(a, b, acc)
        a, b = a_n, b_n
    acc = mma_v2(a, b, acc)
    y = gl.sum(acc, axis=0)                                             # (16 MT, 8)
    OUT: gl.constexpr = gl.SliceLayout(0, MMA)
    rows = n0 + gl.arange(0, 16 * MT, layout=gl.SliceLayout(1, OUT))
    cols = gl.arange(0, 8, layout=gl.SliceLayout(0, OUT))
    gl.store(y_ptr + cols[None, :] * N + rows[:, None], y.to(y_ptr.dtype.element_ty),
             mask=(cols < M)[None, :])


def gemv8(x, w, W=8, MT=4, KC=64, pdl=True):
    M, K = x.shape
    N = w.shape[0]
    assert M <= 8 and N % (16 * MT) == 0 and K % (W * KC) == 0
    y = x.new_empty(M, N)
    _gemv8_kernel[(N // (16 * MT),)](x, w, y, M, N, K, K // W, W=W, MT=MT, KC=KC, PDL=pdl,
                                     num_warps=W)
    return y


CONFIGS = [(8, 4, 64), (8, 4, 32), (8, 2, 64), (8, 2, 128), (4, 4, 64), (4, 2, 128),
           (16, 2, 64), (8, 1, 128), (16, 1, 64), (16, 1, 128), (4, 8, 32)]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", default=",".join(LAYERS))
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--configs", default=None, help="WxMTxKC list instead of CONFIGS")
    args = p.parse_args()
    configs = ([tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
               if args.configs else CONFIGS)
    for name, N, K, ws, x, ref in plain_cases(args.layers, args.rows):
        base = plain_baseline(name, x, ws)
        for W, MT, KC in configs:
            report_variant(f"W{W} MT{MT} KC{KC} ({N // (16 * MT)} programs)",
                           lambda x, w: gemv8(x, w, W, MT, KC), x, ws, ref, base)
        del ws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
