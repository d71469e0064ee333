"""Device experiment: how fast P programs (about one per SM) read HBM, against the bytes each
keeps in flight, with nothing else in the kernel (no shared memory, no tensor cores).

    cd /tmp/run && python /path/to/perf/gpu/stream_probe.py          # after perf/gpu/check.sh

Why: at 8 rows every ``fused_linear`` launch streams ~29-30 GB/s per SM whatever its tile,
stages or load path (cp.async or TMA), so q/k/v (96 programs of 64 weight rows) moves ~2.9
TB/s and o (128 programs) ~3 TB/s, against ~4 TB/s for gate/up and down. Whether that is a
per-SM ceiling of the machine (then the cure is to spread every projection evenly over all
SMs) or of the kernels' pipelines (then more bytes in flight is) decides what to build next.

Each program XORs a contiguous chunk of int32 words, a tile of UNROLL x (32 x warps) 16-byte
loads at a time, the next tile loaded while the current one is folded (so ~1-2 tiles are in
flight per program). Chunks of 512 KB (q/k/v's bytes per program) and 4 MB (steady state);
every call reads a region of the buffer the calls before it did not, > 3x L2 per replay.
"""
import argparse

import torch
import triton
import triton.language as tl

from minikv_compile.perf.bench_decode_attention import _graph_ms, copy_bandwidth


@triton.jit
def _stream(src, out, N_ITER, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, UNROLL)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    base = src + pid * N_ITER * (UNROLL * BLOCK)
    cur = tl.load(base + offs)
    acc = tl.zeros((BLOCK,), tl.int32)
    for i in range(1, N_ITER):
        nxt = tl.load(base + i * (UNROLL * BLOCK) + offs)
        acc ^= tl.xor_sum(cur, axis=0)
        cur = nxt
    acc ^= tl.xor_sum(cur, axis=0)
    tl.store(out + pid * BLOCK + tl.arange(0, BLOCK), acc)


@triton.jit
def _stream_rows(src, out, K, ROWS: tl.constexpr, BK: tl.constexpr):
    """Program p reads rows [p ROWS, (p + 1) ROWS) of a (N, K) int32 matrix, a (ROWS, BK) tile
    at a time along K, the next tile in flight while this one is folded: the order in which a
    GEMV program reads its weight rows."""
    pid = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, ROWS)[:, None] * K + tl.arange(0, BK)[None, :]
    base = src + pid * ROWS * K
    cur = tl.load(base + offs)
    acc = tl.zeros((BK,), tl.int32)
    for k0 in range(BK, K, BK):
        nxt = tl.load(base + k0 + offs)
        acc ^= tl.xor_sum(cur, axis=0)
        cur = nxt
    acc ^= tl.xor_sum(cur, axis=0)
    tl.store(out + pid * BK + tl.arange(0, BK), acc)


@triton.jit
def _stream_rows_persistent(src, out, K, N_BLOCKS, ROWS: tl.constexpr, BK: tl.constexpr):
    """``_stream_rows``'s row blocks dealt round-robin to a fixed grid, the block after this
    one's first tile in flight while this one's last is folded (one flat loop over (block, k))."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    offs = tl.arange(0, ROWS)[:, None] * K + tl.arange(0, BK)[None, :]
    steps = K // BK
    n_mine = (N_BLOCKS - pid + P - 1) // P
    cur = tl.load(src + pid.to(tl.int64) * ROWS * K + offs)
    acc = tl.zeros((BK,), tl.int32)
    for it in range(1, n_mine * steps):
        blk = (pid + (it // steps) * P).to(tl.int64)
        nxt = tl.load(src + blk * ROWS * K + (it % steps) * BK + offs)
        acc ^= tl.xor_sum(cur, axis=0)
        cur = nxt
    acc ^= tl.xor_sum(cur, axis=0)
    tl.store(out + pid * BK + tl.arange(0, BK), acc)


def rows_mode(buf, out, args):
    """The (N, K) matrices of the 8-row projections, read row block by row block."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for N, K in ((6144, 4096), (4096, 4096), (4096, 14336), (28672, 4096)):
        words = K // 2  # bf16 pairs per row
        line = []
        for cfg in args.row_configs.split(","):
            persistent = cfg.startswith("p")
            warps, rows, bk = (int(v) for v in cfg.lstrip("p").split("x"))
            P = N // rows
            per_call = N * words
            calls = max(8, min(64, (3 * 50 << 20) // (4 * per_call) + 1))

            def call(i):
                if persistent:
                    _stream_rows_persistent[(min(P, sms),)](buf[i * per_call:], out, words, P,
                                                            ROWS=rows, BK=bk, num_warps=warps)
                else:
                    _stream_rows[(P,)](buf[i * per_call:], out, words, ROWS=rows, BK=bk,
                                       num_warps=warps)

            ms = _graph_ms([lambda i=i: call(i) for i in range(calls)])
            line.append(f"{cfg} {ms * 1e3:5.1f} us {4 * per_call / (ms * 1e-3) / 1e12:4.2f} TB/s")
        print(f"rows {N} x {K} bf16: " + " | ".join(line), flush=True)
    print("(per config WARPSxROWSxBK int32 words: us per call, TB/s)")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--programs", default="66,96,128,132,264")
    p.add_argument("--chunks-kb", default="512,4096")
    p.add_argument("--configs", default="4x8,8x8,8x16,16x8,16x16,32x8",
                   help="WARPSxUNROLL list; bytes in flight per tile: warps x 32 x 16 x UNROLL")
    p.add_argument("--row-configs", default="8x64x128,8x64x256,8x32x256,8x16x512,4x64x128",
                   help="WARPSxROWSxBK list for the row-block reads (rows_mode); a leading p: "
                        "the blocks dealt to one program per SM (persistent)")
    p.add_argument("--rows-only", action="store_true")
    args = p.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"copy {copy_bandwidth() / 1e12:.2f} TB/s, {sms} SMs", flush=True)
    buf = torch.randint(-2**31, 2**31 - 1, (3 << 28,), dtype=torch.int32, device="cuda")  # 3 GiB
    out = torch.empty(64 << 20, dtype=torch.int32, device="cuda")
    rows_mode(buf, out, args)
    if args.rows_only:
        return
    for chunk_kb in [int(c) for c in args.chunks_kb.split(",")]:
        for P in [int(v) for v in args.programs.split(",")]:
            line = []
            for cfg in args.configs.split(","):
                warps, unroll = (int(v) for v in cfg.split("x"))
                block = warps * 32 * 4
                tile = unroll * block
                words = chunk_kb * 256
                n_iter = words // tile
                per_call = P * n_iter * tile
                calls = max(8, min(64, (3 * 50 << 20) // (4 * per_call) + 1))
                if calls * per_call > buf.numel():
                    line.append(f"{cfg} -")
                    continue

                def call(i):
                    _stream[(P,)](buf[i * per_call:], out, n_iter, BLOCK=block, UNROLL=unroll,
                                  num_warps=warps)

                ms = _graph_ms([lambda i=i: call(i) for i in range(calls)])
                tb = 4 * per_call / (ms * 1e-3) / 1e12
                per_sm = tb * 1e3 / min(P, sms)
                line.append(f"{cfg} {ms * 1e3:6.1f} us {tb:4.2f} TB/s {per_sm:3.0f}")
            print(f"chunk {chunk_kb:5d} KB, P {P:4d}: " + " | ".join(line), flush=True)
    print("(per config: us per call, total TB/s, GB/s per busy SM)")


if __name__ == "__main__":
    main()
