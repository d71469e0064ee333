"""Device experiment: the 8-row GEMV of ``fused_linear``'s tensor-core path reading weights stored
tile by tile (each program's (BLOCK_N x BLOCK_K) tiles one after the other in memory) against the
same kernel on the usual row-major weights, on the four Llama-3.1-8B projections, no epilogue.

    cd /tmp/run && python /path/to/perf/gpu/tiled_trial.py          # after perf/gpu/check.sh

Why: ``stream_probe.py`` read each projection's bytes, split among programs as the GEMV splits
them, 4-7% faster when every program's share lay contiguous in memory than when it was a block of
rows read a tile at a time along K (gate/up: 56.4 against 60.3 us; q/k/v 15.2 against 16.4), and
``fused_linear`` is within 0.1-2.2 us of the row-block reads on every projection. Whether the
pipelined GEMV keeps that gain decides whether a tiled weight layout is worth its cost (prefill
and the one-row path read the same weights).
"""
import argparse
import importlib

import torch
import triton
import triton.language as tl

from linear_sweep import LAYERS, fused_plain, plain_cases, timed  # this folder's sweep

gdc = importlib.import_module("minikv_compile.ops._gdc")
lin = importlib.import_module("minikv_compile.ops.linear")


@triton.jit
def _gemv(x_ptr, w_ptr, y_ptr, M, N, K, KT, TILED: tl.constexpr, PDL: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          NUM_STAGES: tl.constexpr, K_PREFETCH: tl.constexpr):
    pid_n = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    cols = pid_n * BLOCK_N + offs_n
    kk = tl.arange(0, BLOCK_K)
    if K_PREFETCH > 0:  # row-major only: fused_linear's L2 prefetch before the PDL wait
        lin._prefetch_l2(w_ptr, cols, cols < N, K, K, K_PREFETCH, 64)
    gdc.launch_dependents_then_wait(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        a = tl.load(x_ptr + rows[:, None] * K + (k0 + kk)[None, :], mask=(rows < M)[:, None],
                    other=0.0)
        if TILED:  # tile (pid_n, k0 / BLOCK_K) at [pid_n, k0 / BLOCK_K] of (N/BN, K/BK, BN, BK)
            tile = (pid_n * KT + k0 // BLOCK_K).to(tl.int64) * (BLOCK_N * BLOCK_K)
            w = tl.load(w_ptr + tile + offs_n[:, None] * BLOCK_K + kk[None, :])
        else:
            w = tl.load(w_ptr + cols[:, None].to(tl.int64) * K + (k0 + kk)[None, :])
        acc = tl.dot(a, tl.trans(w), acc)
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows < M)[:, None])


def tiled(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    N, K = w.shape
    return w.view(N // bn, bn, K // bk, bk).permute(0, 2, 1, 3).contiguous()


def gemv(x, w, N, K, bn, bk, stages, is_tiled, warps=4, prefetch=0, pdl=False):
    M = x.shape[0]
    y = x.new_empty(M, N)
    _gemv[(N // bn,)](x, w, y, M, N, K, K // bk, TILED=is_tiled, PDL=True, BLOCK_M=16,
                      BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=stages, K_PREFETCH=prefetch,
                      num_warps=warps, launch_pdl=pdl)
    return y


CONFIGS = {"qkv": [(64, 256, 4), (32, 512, 4), (64, 256, 5)],
           "o": [(32, 512, 4), (16, 512, 4), (64, 256, 4)],
           "gate_up": [(128, 128, 4), (64, 256, 4), (64, 256, 3), (32, 512, 4)],
           "down": [(32, 512, 4), (16, 512, 4), (64, 256, 4)]}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", default=",".join(LAYERS))
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args()
    for name, N, K, ws, x, ref in plain_cases(args.layers, args.rows):
        wbytes = N * K * 2
        # fused_linear without epilogue in the same run, with and without PDL, and this kernel
        # (below: launched without PDL) as a PDL launch, with and without the L2 prefetch
        cfg = lin.launch_config(args.rows, N, K, torch.bfloat16)
        tile = (N, K, cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["NUM_STAGES"], False)
        line = []
        for _ in range(args.repeat):
            for pdl in (True, False):
                ms = timed(lambda w: fused_plain(x, w, pdl=pdl), ws)
                line.append(f"fused_linear pdl {pdl} {ms * 1e3:5.1f} us")
            for kp in (0, 512):
                ms = timed(lambda w: gemv(x, w, *tile, prefetch=kp, pdl=True), ws)
                line.append(f"this kernel pdl, prefetch {kp} {ms * 1e3:5.1f} us")
            ms = timed(lambda w: gemv(x, w, *tile), ws)
            line.append(f"this kernel {ms * 1e3:5.1f} us")
        print(f"{name} {N}x{K}: " + " | ".join(line), flush=True)
        for bn, bk, st in CONFIGS[name]:
            wt = [tiled(w, bn, bk) for w in ws]
            line = []
            for _ in range(args.repeat):
                for is_tiled, wl in ((False, ws), (True, wt)):
                    err = (gemv(x, wl[0], N, K, bn, bk, st, is_tiled).float() - ref).abs().max()
                    ms = timed(lambda w: gemv(x, w, N, K, bn, bk, st, is_tiled), wl)
                    line.append(f"{'tiled' if is_tiled else 'rows'} {ms * 1e3:5.1f} us "
                                f"({wbytes / ms / 1e9:4.2f} TB/s, err {err.item():.0e})")
            print(f"{name} {N}x{K} {args.rows} rows, {bn}x{bk}x{st}: " + " | ".join(line),
                  flush=True)
            del wt
        del ws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
