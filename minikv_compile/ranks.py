"""Serving over tensor-parallel ranks: rank 0's runtime tells the other ranks what to do.

Under tensor parallel (``MiniKVConfig.tensor_parallel``) every call that runs the model has
collectives inside, so every rank must make the same calls on its runtime of slots, in the same
order. ``generate`` gets that by every rank calling it with the same arguments. A server cannot:
requests reach rank 0 alone, whose scheduler decides, turn by turn, what to admit, step and
release. So rank 0's scheduler drives a ``ReplicatedRuntime``, which sends each such call to the
other ranks (one ``broadcast_object_list`` of the call and its arguments) before making it
itself, and every other rank runs ``follow`` until rank 0 says stop::

    rank 0:  Scheduler(engine, ...)  ->  ReplicatedRuntime(engine)  ->  its runtime
                                        | (prepare, admit_batch_in_pieces, next, close,
                                        v  step, release, noop; stop)
    rank r:  follow(engine)  ->  its runtime, the same calls

Reads (``free_slots``, ``poll``, ``check_request``, ...) stay on rank 0: every rank holds the
same tokens (the logits are gathered before each choice). A call that raises on rank 0 raises on
the others too (same model, same arguments); they carry on, as rank 0's scheduler does. A failure
on one rank alone (out of memory) is not reconciled: the ranks' next collective then fails after
the process group's timeout.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Iterator, Optional

import torch.distributed as dist

log = logging.getLogger(__name__)

# The calls a follower makes; "next" / "close" act on the admission under way.
_CALLS = ("prepare", "admit_batch_in_pieces", "next", "close", "step", "release", "noop",
          "stop")
# An idle rank 0 says so this often: the others wait in a collective, which the process group's
# timeout (``serve``: ``RANK_TIMEOUT_S``) would otherwise end.
HEARTBEAT_S = 10.0
# What rank 0 reads of its own runtime (every rank holds the same): anything else of the runtime
# changes its slots or runs the model, and on rank 0 alone would leave the ranks apart.
_READS = frozenset({"buckets", "state", "config", "free_slots", "admitted", "check_request",
                    "poll", "poll_later", "finished", "outputs", "runner"})


class ReplicatedRuntime:
    """Rank 0's runtime of a tensor-parallel engine: the calls that run the model or change the
    slots go to every rank (``follow``) before rank 0 makes them; the reads of ``_READS`` are
    rank 0's runtime's own; any other attribute is an ``AttributeError``."""

    def __init__(self, engine):
        tp = engine.adapter.tp
        if tp.rank != 0:
            raise ValueError(f"ReplicatedRuntime: expected rank 0 (the others run "
                             f"minikv_compile.ranks.follow), got rank {tp.rank}")
        self._rt, self._group = engine.runtime, tp.group
        self.last_sent = time.monotonic()  # when the other ranks last got a call

    def __getattr__(self, name: str) -> Any:
        if name in _READS:
            return getattr(self._rt, name)
        raise AttributeError(f"ReplicatedRuntime.{name}: expected a call every rank makes "
                             f"({', '.join(c for c in _CALLS if c not in ('next', 'close'))}) or "
                             f"a read ({', '.join(sorted(_READS))}); {name} on rank 0 alone "
                             f"would leave the ranks apart")

    def _send(self, call: str, *args) -> None:
        dist.broadcast_object_list([(call, args)], src=0, group=self._group)
        self.last_sent = time.monotonic()

    def prepare(self, bucket: int, mode: str) -> Optional[float]:
        self._send("prepare", bucket, mode)
        return self._rt.prepare(bucket, mode)

    def step(self) -> None:
        self._send("step")
        self._rt.step()

    def release(self, slot: int) -> None:
        self._send("release", slot)
        self._rt.release(slot)

    def admit_batch_in_pieces(self, slots, requests, layers_per_piece: int) -> Iterator[None]:
        self._send("admit_batch_in_pieces", list(slots), list(requests), layers_per_piece)
        return _Pieces(self, self._rt.admit_batch_in_pieces(slots, requests, layers_per_piece))

    def heartbeat(self) -> None:
        """Nothing to do (``HEARTBEAT_S``): keeps the other ranks' wait under the timeout."""
        self._send("noop")

    def stop_followers(self) -> None:
        """End every other rank's ``follow`` (rank 0's last call), and wait for them there: no
        rank tears its process group down while another is still in a collective."""
        self._send("stop")
        dist.barrier(group=self._group)


class _Pieces:
    """An admission's generator whose every ``next`` and ``close`` the other ranks make too."""

    def __init__(self, runtime: ReplicatedRuntime, pieces: Iterator[None]):
        self._runtime, self._pieces = runtime, pieces

    def __iter__(self) -> "_Pieces":
        return self

    def __next__(self) -> None:
        self._runtime._send("next")
        return next(self._pieces)

    def close(self) -> None:
        self._runtime._send("close")
        self._pieces.close()


def follow(engine) -> None:
    """On a rank other than 0: make rank 0's calls on this rank's runtime, in its order, until
    rank 0 sends stop (``ReplicatedRuntime.stop_followers``). A call that raises here raised on
    rank 0 too, which carries on: so does this loop."""
    tp, rt = engine.adapter.tp, engine.runtime
    if tp.rank == 0:
        raise ValueError("follow: expected a rank other than 0 (rank 0 serves through "
                         "ReplicatedRuntime), got rank 0")
    pieces: Optional[Iterator[None]] = None
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=tp.group)
        call, args = box[0]
        if call not in _CALLS:
            raise RuntimeError(f"follow: expected one of {_CALLS} from rank 0, got {call!r}")
        if call == "stop":
            dist.barrier(group=tp.group)  # (ReplicatedRuntime.stop_followers)
            return
        if call == "noop":
            continue
        try:
            if call == "admit_batch_in_pieces":
                pieces = rt.admit_batch_in_pieces(*args)
            elif call == "next":
                next(pieces)
            elif call == "close":
                pieces.close()
            else:
                getattr(rt, call)(*args)
        except StopIteration:
            pass  # the admission is complete, as rank 0's is
        except Exception as e:  # noqa: BLE001 - rank 0 raised the same and handles it
            log.warning("rank %d: %s raised %s: %s (as on rank 0, whose scheduler handles it)",
                        tp.rank, call, type(e).__name__, e)


__all__ = ["ReplicatedRuntime", "follow"]
