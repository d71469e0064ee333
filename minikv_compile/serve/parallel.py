"""--tensor-parallel: every rank loads its shard; rank 0 listens and drives the others."""
from __future__ import annotations

import os
import sys

import torch

# --tensor-parallel: a collective waiting longer than this for a rank ends the group with an error
# (a stuck rank); above the slowest call one rank makes while another waits, a bucket's compile
# and capture at warm-up, and above the idle rank 0's heartbeat (ranks.HEARTBEAT_S).
RANK_TIMEOUT_S = 600


def leave_ranks(status: int) -> None:
    """Destroy the process group and exit now, past the interpreter's teardown, where c10d's
    gloo threads abort the process now and then (SIGABRT after all the work is done; seen on ~1
    run in 10 of the CPU tests)."""
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
