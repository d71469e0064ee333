"""Device experiment: where a ``fused_linear`` launch of the 8-row decode step spends its time,
from Nsight Compute's warp-stall samples split at the main loop.

    python perf/experiments/ncu_linear.py run qkv|o          # four launches (profile the 4th)
    python perf/experiments/ncu_linear.py regions SOURCE.csv # ncu --page source --csv --print-source sass

``run`` launches the layer as the engine does at 8 rows on the Llama-3.1-8B shape: q/k/v with
the "prescaled" norm and the RoPE of its q and k heads, o with the residual and ``norm_out``.
``regions`` sums the stall samples and executed instructions before the main loop (the
innermost backward branch with the most instructions), inside it, and after it, and prints the
opcodes with the most samples in each region.
"""
import argparse
import collections
import csv
import re

HIDDEN, QKV, HEAD_DIM, ROWS = 4096, 6144, 128, 8


def run(layer: str) -> None:
    import torch

    from minikv_compile.ops import linear as lin

    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(ROWS, HIDDEN, device=dev, dtype=dt)
    if layer == "qkv":
        w = torch.randn(QKV, HIDDEN, device=dev, dtype=dt) * 0.02
        sums = torch.rand(ROWS, 128, device=dev) * HIDDEN / 128
        cos = torch.rand(ROWS, HEAD_DIM, device=dev, dtype=dt)
        sin = torch.rand(ROWS, HEAD_DIM, device=dev, dtype=dt)
        args = (x, w, None, None, None, cos, sin, 40 * HEAD_DIM, "prescaled", 1e-5)
        kwargs = dict(rms_sumsq=sums)
    else:
        w = torch.randn(HIDDEN, HIDDEN, device=dev, dtype=dt) * 0.02
        r = torch.randn(ROWS, HIDDEN, device=dev, dtype=dt)
        g = torch.rand(HIDDEN, device=dev, dtype=dt)
        args = (x, w, None, None, r, None, None, 0, "none", 0.0)
        kwargs = dict(norm_out=g)
    for _ in range(4):
        lin._fused_linear_triton(*args, **kwargs)
    torch.cuda.synchronize()


def regions(path: str, top: int = 6) -> None:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    head = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    col = {name: i for i, name in enumerate(rows[head])}
    data = [r for r in rows[head + 1:] if len(r) == len(rows[head])]

    def num(r, name):
        try:
            return float(r[col[name]])
        except (KeyError, ValueError):
            return 0.0

    addr = [int(r[col["Address"]], 16) for r in data]
    loops = []  # (first, last) row indices of each backward branch
    for i, r in enumerate(data):
        m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", r[col["Source"]])
        if m and int(m.group(1), 16) < addr[i] and int(m.group(1), 16) in addr:
            loops.append((addr.index(int(m.group(1), 16)), i))
    if not loops:
        print("no backward branch found; regions not split")
        loops = [(len(data), len(data))]
    first, last = max(loops, key=lambda fl: fl[1] - fl[0])
    parts = {"before the loop": data[:first], "main loop": data[first:last + 1],
             "after the loop": data[last + 1:]}
    samples = "Warp Stall Sampling (All Samples)"
    total = sum(num(r, samples) for r in data) or 1.0
    for name, part in parts.items():
        s = sum(num(r, samples) for r in part)
        n = sum(num(r, "Instructions Executed") for r in part)
        print(f"{name:<16} {len(part):5d} instructions in the code, {n:12,.0f} executed, "
              f"{100 * s / total:5.1f}% of stall samples")
        by_op = collections.Counter()
        for r in part:
            words = r[col["Source"]].split()
            op = words[1] if words and words[0].startswith("@") else (words[0] if words else "?")
            by_op[op.split(".")[0]] += num(r, samples)
        top_ops = by_op.most_common(top)
        print("    " + ", ".join(f"{op} {100 * v / total:.1f}%" for op, v in top_ops))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("run").add_argument("layer", choices=("qkv", "o"))
    sub.add_parser("regions").add_argument("source_csv")
    a = ap.parse_args()
    run(a.layer) if a.cmd == "run" else regions(a.source_csv)


if __name__ == "__main__":
    main()
