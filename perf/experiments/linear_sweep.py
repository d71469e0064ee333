"""Device experiment: ``minikv::fused_linear`` launch configurations on the four linear layers of a
Llama-3.1-8B decode step (``--shape 70b-tp4``: one rank of Llama-3.1-70B over 4 GPUs), each beside what the step runs without it (inductor's RMSNorm /
SiLU-gate / residual / RoPE kernels around a cuBLAS GEMV, compiled and graph-captured the same
way; q/k/v includes the RoPE of its q and k heads on both sides).

    python perf/experiments/linear_sweep.py --batches 1,8 [--shape 70b-tp4]   # after perf/gpu_check.sh

Every timing is a CUDA graph over enough weight copies to read >= 3x L2 from HBM per replay
(median of ``do_bench``); "TB/s" counts the weight bytes only. Prints one line per (layer,
batch, config).
"""
import argparse
import itertools

import torch
import torch.nn.functional as F

from minikv_compile.ops import linear as lin
from minikv_compile.perf.measure import copy_bandwidth, graph_ms, replicas, row_environment

HEAD_DIM = 128
# shape: (hidden, intermediate, query heads, KV heads) of one rank: Llama-3.1-8B on one GPU, and
# Llama-3.1-70B's shard over 4 and 2 tensor-parallel ranks (issue 50: its step's kernels at a
# quarter of the bytes)
SHAPES = {"8b": (4096, 14336, 32, 8), "70b-tp4": (8192, 7168, 16, 2),
          "70b-tp2": (8192, 14336, 32, 4)}
ROPE_ROWS = 0  # q/k/v: RoPE over the q and k heads' rows (set by main from the shape)


def layers(shape: str):
    """name: (N, K, prologue, residual, glu_out) of the four linear layers of one rank."""
    hidden, inter, h_q, h_kv = SHAPES[shape]
    return {
        "qkv": ((h_q + 2 * h_kv) * HEAD_DIM, hidden, "rmsnorm", False, False),
        "o": (hidden, h_q * HEAD_DIM, "none", True, False),
        "gate_up": (2 * inter, hidden, "rmsnorm", False, True),  # silu(gate) * up in the epilogue
        "down": (hidden, inter, "none", True, False),
    }


def row_configs():  # one row, FMA
    for bn, bk, w in itertools.product((4, 8), (512, 1024), (4, 8)):
        yield dict(USE_DOT=False, BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=1, num_warps=w)


def dot_configs(warps=(4,)):  # several rows: tensor-core tiles of 16 (padded) rows
    # Deep pipelines win (the 95b9f44 sweep: BLOCK_K 512 x 4 stages best on o and down);
    # (BLOCK_N + 16) x BLOCK_K x stages bf16 must fit in shared memory.
    for bn, bk, st in ((32, 512, 4), (16, 512, 4), (64, 256, 4), (64, 256, 5), (128, 128, 4),
                       (32, 256, 4), (16, 256, 4), (16, 256, 6), (64, 128, 4), (32, 128, 8),
                       (64, 256, 3), (64, 128, 6), (128, 128, 3), (32, 256, 6)):
        for w in warps:
            yield dict(USE_DOT=True, BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=st,
                       num_warps=w)


def timed(fn, ws) -> float:
    """ms per call: a graph of >= 8 calls cycling through the weight copies (the first call's
    write-back of do_bench's L2 flush, ~50 MB, is then shared by 8 calls, not charged to one)."""
    return graph_ms([lambda w=ws[i % len(ws)]: fn(w) for i in range(max(8, len(ws)))])


def baseline_fn(prologue: str, glu_out: bool, eps: float = 1e-5):
    """The unfused chain as the decode step writes it (HF RMSNorm, act_fn(gate) * up, h + ...)."""
    def run(x, w, nw, r, cos, sin):
        if prologue == "rmsnorm":
            a = lin.rms_norm_ref(x, nw, eps)  # HF's LlamaRMSNorm
        else:
            a = x
        y = F.linear(a, w)
        if cos is not None:  # as the adapter's eager path writes it, compiled
            qk = y[:, :ROPE_ROWS].view(y.shape[0], -1, HEAD_DIM)
            half = torch.cat((-qk[..., HEAD_DIM // 2:], qk[..., :HEAD_DIM // 2]), dim=-1)
            qk = qk * cos[:, None] + half * sin[:, None]
            y = torch.cat((qk.flatten(1), y[:, ROPE_ROWS:]), dim=1)
        if glu_out:
            g, u = y.chunk(2, dim=-1)
            y = F.silu(g) * u
        return y + r if r is not None else y
    return torch.compile(run, fullgraph=True, dynamic=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--layers", default="qkv,o,gate_up,down")
    ap.add_argument("--shape", default="8b", choices=tuple(SHAPES))
    ap.add_argument("--quick", action="store_true", help="default config only")
    ap.add_argument("--warps", default="4", help="warps per program of the tensor-core "
                    "configs (comma-separated); with --quick, the default tile at each")
    args = ap.parse_args()
    global ROPE_ROWS
    LAYERS = layers(args.shape)
    ROPE_ROWS = (SHAPES[args.shape][2] + SHAPES[args.shape][3]) * HEAD_DIM
    warps = tuple(int(w) for w in args.warps.split(","))
    dev, dt = torch.device("cuda"), torch.bfloat16
    copy = copy_bandwidth(dev)["bytes_per_s"]
    env = row_environment()
    print(f"{env['gpu']}, driver {env['driver']}, torch {env['torch']}, triton {env['triton']}, "
          f"git {env['git_sha']}: copy {copy / 1e12:.2f} TB/s")
    torch.manual_seed(0)
    for name in args.layers.split(","):
        N, K, prologue, residual, glu_out = LAYERS[name]
        wbytes = N * K * 2
        reps = max(2, replicas(wbytes))  # >= 2: a copy is evicted before it is read again
        ws = [torch.randn(N, K, device=dev, dtype=dt) / K ** 0.5 for _ in range(reps)]
        nw = torch.rand(K, device=dev, dtype=dt) + 0.5 if prologue == "rmsnorm" else None
        base = baseline_fn(prologue, glu_out)
        for M in (int(b) for b in args.batches.split(",")):
            x = torch.randn(M, K, device=dev, dtype=dt)
            r = torch.randn(M, N, device=dev, dtype=dt) if residual else None
            ang = torch.rand(M, HEAD_DIM // 2, device=dev) * 6.28
            cos, sin = (torch.cat([f(ang)] * 2, 1).to(dt) for f in (torch.cos, torch.sin))
            if name != "qkv":
                cos = sin = None
            rows = ROPE_ROWS if cos is not None else 0
            operands = (None, nw, r, cos, sin, rows, prologue, 1e-5, glu_out)
            ref = lin.fused_linear_ref(x, ws[0], *operands).float()
            b_ms = timed(lambda w: base(x, w, nw, r, cos, sin), ws)
            a = torch.randn(M, K, device=dev, dtype=dt)
            c_ms = timed(lambda w: F.linear(a, w), ws)
            print(f"{name:8s} M {M}: baseline (inductor + cuBLAS) {b_ms * 1e3:7.1f} us "
                  f"{wbytes / b_ms / 1e9:5.2f} TB/s; cuBLAS GEMV alone {c_ms * 1e3:7.1f} us "
                  f"{wbytes / c_ms / 1e9:5.2f} TB/s", flush=True)
            default = lin.launch_config(M, N, K, dt)
            # The default, and with other amounts of its weights prefetched toward L2 before its
            # PDL wait.
            cfgs = [default]
            if M > 1:  # the tensor-core path's warps and L2 prefetch (the one-row path has none)
                cfgs += [{**default, "num_warps": w} for w in warps if w != default["num_warps"]]
                cfgs += [{**default, "K_PREFETCH": k} for k in (0, 512, 1024, 2048)
                         if k != default["K_PREFETCH"]]
            # Several rows take the RMSNorm outside (as the adapter runs them: ops.rms_norm,
            # then the kernel without prologue); "norm_inside" times it inside, "norm_compiled"
            # as HF's module compiled by inductor (no PDL).
            outside = prologue == "rmsnorm" and M > 1
            if outside:
                cfgs += [{**default, "norm_inside": True}, {**default, "norm_compiled": True}]
            if not args.quick:
                cfgs += list(row_configs() if M == 1 else dot_configs(warps))
            normc = torch.compile(lin.rms_norm_ref, fullgraph=True, dynamic=False)
            plain = (None, None, r, cos, sin, rows, "none", 1e-5, glu_out)

            def fused(w, kw):
                kw = dict(kw)
                inside, compiled = kw.pop("norm_inside", False), kw.pop("norm_compiled", False)
                if outside and not inside:
                    a = normc(x, nw, 1e-5) if compiled else lin.rms_norm(x, nw, 1e-5)
                    return lin._fused_linear_triton(a, w, *plain, **kw)
                return lin._fused_linear_triton(x, w, *operands, **kw)

            best = None
            for cfg in cfgs:
                kw = dict(cfg)
                try:
                    y = fused(ws[0], kw)
                    err = (y.float() - ref).abs().max().item()
                    ms = timed(lambda w: fused(w, kw), ws)
                except Exception as e:  # noqa: BLE001 - a config that does not compile
                    print(f"  {cfg}: failed {type(e).__name__}: {str(e)[:120]}")
                    continue
                tag = "default " if cfg is default else ""
                print(f"  {tag}{cfg}: {ms * 1e3:7.1f} us {wbytes / ms / 1e9:5.2f} TB/s "
                      f"{b_ms / ms:5.2f}x  err {err:.1e}", flush=True)
                if best is None or ms < best[0]:
                    best = (ms, cfg)
            print(f"  best {best[1]}: {best[0] * 1e3:.1f} us = {b_ms / best[0]:.2f}x baseline\n",
                  flush=True)


if __name__ == "__main__":
    main()
