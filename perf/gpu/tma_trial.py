"""Device experiment: the weight tiles of an 8-row GEMV through TMA (host tensor descriptors)
instead of ``fused_linear``'s cp.async pipeline, on the four Llama-3.1-8B projections, no epilogue.

    cd /tmp/run && python /path/to/perf/gpu/tma_trial.py          # after perf/gpu/check.sh

Why: at 8 rows every projection streams ~29 GB/s per SM (q/k/v 96 programs x 512 KB in 18.2 us,
down 128 x 917 KB in 31.7 us), whatever the tile; 16-byte cp.async requests may be what limits
the bytes in flight per SM, where one TMA instruction moves a whole tile.
"""
import argparse
import importlib

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from linear_sweep import LAYERS, plain_baseline, plain_cases, report_variant  # this folder's sweep

gdc = importlib.import_module("minikv_compile.ops._gdc")
CONFIGS = [(64, 256, 4), (64, 256, 3), (32, 256, 6), (64, 128, 6), (32, 128, 8), (128, 128, 4),
           (128, 64, 6), (128, 128, 3), (16, 256, 8)]


@triton.jit
def _tma_gemv(x_ptr, x_desc, w_desc, y_ptr, M, N, K, stride_xm, stride_ym, PDL: tl.constexpr,
              X_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    n0 = tl.program_id(0) * BLOCK_N
    rows = tl.arange(0, BLOCK_M)
    kk = tl.arange(0, BLOCK_K)
    m_ok = rows < M
    gdc.launch_dependents_then_wait(PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        if X_TMA:
            a = x_desc.load([0, k0])
        else:
            a = tl.load(x_ptr + rows[:, None] * stride_xm + (k0 + kk)[None, :],
                        mask=m_ok[:, None], other=0.0)
        w = w_desc.load([n0, k0])
        acc = tl.dot(a, tl.trans(w), acc)
    cols = n0 + tl.arange(0, BLOCK_N)
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & (cols < N)[None, :])


def tma_gemv(x, w, bn, bk, stages, x_tma=False):
    M, K = x.shape
    N = w.shape[0]
    y = x.new_empty(M, N)
    w_desc = TensorDescriptor.from_tensor(w, [bn, bk])
    x_desc = TensorDescriptor.from_tensor(x, [16, bk])
    _tma_gemv[(triton.cdiv(N, bn),)](x, x_desc, w_desc, y, M, N, K, x.stride(0), y.stride(0),
                                     PDL=True, X_TMA=x_tma, BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk,
                                     NUM_STAGES=stages, num_warps=4, launch_pdl=True)
    return y


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", default=",".join(LAYERS))
    p.add_argument("--rows", type=int, default=8)
    args = p.parse_args()
    for name, N, K, ws, x, ref in plain_cases(args.layers, args.rows):
        base = plain_baseline(name, x, ws)
        for bn, bk, st in CONFIGS:
            for x_tma in (False, True):
                report_variant(f"TMA {bn}x{bk}x{st} x_tma={x_tma}",
                               lambda x, w: tma_gemv(x, w, bn, bk, st, x_tma), x, ws, ref, base)
        del ws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
