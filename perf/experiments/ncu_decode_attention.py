"""Where the decode-attention split kernel spends its shared-memory pipe, from Nsight Compute.

    python perf/experiments/ncu_decode_attention.py run [--bits 2] [--batch 8] [--tokens 16384]
                                                        [--kernel split|fragments]
    python perf/experiments/ncu_decode_attention.py summarize SOURCE.csv[.gz]

``run`` launches the op four times on one random cache (``bench_decode_attention``'s shapes) so
that ``ncu --launch-skip 3 --launch-count 1`` profiles a warm launch; ``ncu_decode.sh`` beside it
does both steps on the GPU machine. ``summarize`` reads ncu's per-instruction source page
(``ncu --import R --page source --csv --print-source sass``) and prints, per opcode, the share of
warp-stall samples, the shared-memory wavefronts against the conflict-free ideal, and the
instructions executed; then the instructions with the most excess wavefronts (bank conflicts).
"""
from __future__ import annotations

import argparse
import collections
import csv
import gzip
import sys
from typing import Dict, List, Optional


def run(bits: int, batch: int, tokens: int, kernel: Optional[str] = None) -> None:
    import torch

    from minikv_compile.ops import attention_decode as da
    from minikv_compile.perf.bench_decode_attention import ExperimentConfig, _cache, _plan

    cfg = ExperimentConfig(batch, tokens, bits)
    q = torch.randn(batch, cfg.H_q, cfg.D, dtype=getattr(torch, cfg.dtype), device="cuda")
    cache = _cache(cfg)
    plan = _plan(cfg, kernel)
    for _ in range(4):
        da._decode_attention_triton(q, *cache, cfg.D ** -0.5, bits, cfg.group_size, plan)
    torch.cuda.synchronize()


def _num(row: List[str], col: Dict[str, int], name: str) -> float:
    try:
        return float(row[col[name]])
    except (KeyError, ValueError):
        return 0.0


def summarize(path: str, top: int = 12) -> None:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    header = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    col = {name: i for i, name in enumerate(rows[header])}
    data = [r for r in rows[header + 1:] if len(r) == len(rows[header])]
    samples = "Warp Stall Sampling (All Samples)"
    wave, ideal = "L1 Wavefronts Shared", "L1 Wavefronts Shared Ideal"
    total_samples = sum(_num(r, col, samples) for r in data) or 1.0
    total_wave = sum(_num(r, col, wave) for r in data)
    total_ideal = sum(_num(r, col, ideal) for r in data)
    print(f"{path}: {sum(_num(r, col, 'Instructions Executed') for r in data):,.0f} warp "
          f"instructions, {total_wave:,.0f} shared-memory wavefronts ({total_ideal:,.0f} "
          f"conflict-free)")
    by_op: Dict[str, List[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    for r in data:
        words = r[col["Source"]].split()
        op = words[1] if words[0].startswith("@") else words[0]
        op = ".".join(op.split(".")[:2])
        acc = by_op[op]
        for i, name in enumerate((samples, wave, ideal, "Instructions Executed")):
            acc[i] += _num(r, col, name)
    print(f"\n{'opcode':<22} {'stall %':>8} {'wavefronts':>12} {'ideal':>12} {'executed':>12}")
    for op, (s, w, i, n) in sorted(by_op.items(), key=lambda kv: -kv[1][0])[:2 * top]:
        print(f"{op:<22} {100 * s / total_samples:8.1f} {w:12,.0f} {i:12,.0f} {n:12,.0f}")
    conflicted = sorted(data, key=lambda r: _num(r, col, ideal) - _num(r, col, wave))[:top]
    print(f"\n{'instruction':<60} {'wavefronts':>12} {'ideal':>12}")
    for r in conflicted:
        if _num(r, col, wave) > _num(r, col, ideal):
            print(f"{r[col['Source']].strip()[:60]:<60} {_num(r, col, wave):12,.0f} "
                  f"{_num(r, col, ideal):12,.0f}")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="launch the op 4 times (profile the 4th)")
    r.add_argument("--bits", type=int, default=2, choices=(2, 4, 16))
    r.add_argument("--batch", type=int, default=8)
    r.add_argument("--tokens", type=int, default=16384, help="quantized tokens per sequence")
    r.add_argument("--kernel", default="split", choices=("split", "fragments"),
                   help="the kernel of the split launch (fragments: the Gluon kernel)")
    s = sub.add_parser("summarize", help="summarize ncu's per-instruction source page")
    s.add_argument("source_csv")
    s.add_argument("--top", type=int, default=12)
    args = parser.parse_args(argv)
    if args.cmd == "run":
        run(args.bits, args.batch, args.tokens, args.kernel)
    else:
        summarize(args.source_csv, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
