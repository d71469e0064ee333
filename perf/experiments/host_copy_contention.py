"""Host copies of the size recall's prompt snapshots make, timed in N processes at once (issue
46: context first with recall ran ~10x slower in the accuracy harness's two-GPU calls).

Each process clones ``slots`` slot rows of ``2 x layers`` tensors shaped as recall's host store
(what ``StaticKVCache.snapshot`` does with the host copy) and writes them back (``restore``), a
few rounds, and prints the times. The tensors are pageable, not pinned as on a GPU machine: a
CPU-only reproduction, whose copies are the same CPU work. With ``--processes N`` the N run at once, each with torch's
default threads (a thread per core) unless ``--threads`` says otherwise::

    python perf/experiments/host_copy_contention.py                 # one process
    python perf/experiments/host_copy_contention.py --processes 3   # three at once
    python perf/experiments/host_copy_contention.py --processes 3 --threads 1
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time

import torch


def one(a: argparse.Namespace) -> None:
    if a.threads:
        torch.set_num_threads(a.threads)
    # SmolLM2's host copy: 3 KV heads x 64 channels in bf16, a slot's rows strided by capacity
    stores = [torch.zeros(a.slots, 3, a.tokens + 256, 64, dtype=torch.bfloat16)
              for _ in range(2 * a.layers)]
    for r in range(a.rounds):
        t0 = time.perf_counter()
        snaps = [[s[b, :, :a.tokens].clone() for s in stores] for b in range(a.slots)]
        t1 = time.perf_counter()
        for b in range(a.slots):
            for s, x in zip(stores, snaps[b]):
                s[b, :, :a.tokens].copy_(x)
        t2 = time.perf_counter()
        print(f"process {a.rank} threads {torch.get_num_threads()} round {r}: clones "
              f"{1e3 * (t1 - t0):.0f} ms, writes back {1e3 * (t2 - t1):.0f} ms", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="torch threads a process (0: default)")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rank >= 0 or a.processes == 1:
        a.rank = max(a.rank, 0)
        one(a)
        return
    args = [sys.executable, __file__, "--threads", str(a.threads), "--slots", str(a.slots),
            "--layers", str(a.layers), "--tokens", str(a.tokens), "--rounds", str(a.rounds)]
    procs = [subprocess.Popen(args + ["--rank", str(i)]) for i in range(a.processes)]
    sys.exit(max(proc.wait() for proc in procs))


if __name__ == "__main__":
    main()
